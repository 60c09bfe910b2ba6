"""``muster validate job.yaml``: check a job and print its rank plan and torchrun commands."""

from __future__ import annotations

from pathlib import Path

import typer

from muster.cli.main import app, out, reports_errors
from muster.cli.render import commands, print_commands, summary
from muster.spec import load_job_file


@app.command()
@reports_errors
def validate(job_file: Path = typer.Argument(..., help="the job's YAML file")) -> None:
    """Check a job spec; print the rank plan and the command every node will run."""
    spec = load_job_file(job_file)
    port = str(spec.gang.rendezvous.port or "PORT")
    out.print(f"[green]valid[/] {summary(spec)}")
    print_commands(out, commands(spec, "NODE0_ADDR", port))
    if spec.gang.num_workers > 1:
        out.print(
            "NODE0_ADDR (and PORT, unless rendezvous.port is set) are chosen when the gang is "
            "placed; `muster plan JOB --workers INVENTORY` shows a dry run."
        )
