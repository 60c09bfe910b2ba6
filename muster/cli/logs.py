"""``muster logs JOB [-f] [--rank N] [--node R]``."""

from __future__ import annotations

from pathlib import Path

import typer

from muster.cli.common import ControllerOpt, TokenFileOpt, client
from muster.cli.follow import follow_logs
from muster.cli.main import app, reports_errors


@app.command()
@reports_errors
def logs(
    job_id: str = typer.Argument(...),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing until the job ends"),
    rank: int = typer.Option(None, help="only this global rank"),
    node: int = typer.Option(None, help="only this node's lines: its ranks' and its torchrun's"),
    controller: str = ControllerOpt,
    token_file: Path | None = TokenFileOpt,
) -> None:
    """Print a job's lines as [rankN] text (torchrun's own lines as [nodeR])."""
    follow_logs(client(controller, token_file), job_id, rank=rank, node=node, follow=follow)
