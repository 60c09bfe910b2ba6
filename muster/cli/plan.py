"""``muster plan job.yaml --workers inventory.yaml``: a dry-run placement."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from muster.cli.main import app, out, reports_errors
from muster.cli.render import commands, print_commands, ranks_text, summary
from muster.plan import gang_addressing, rank_plan
from muster.scheduler import Placement, place_gang
from muster.spec import WorkerView, load_inventory_file, load_job_file


@app.command()
@reports_errors
def plan(
    job_file: Path = typer.Argument(..., help="the job's YAML file"),
    workers: Path = typer.Option(
        ..., "--workers", "-w", help="YAML list of worker inventories (all taken as idle)"
    ),
) -> None:
    """Place the job on a described pool without running it: members, path class, commands."""
    spec = load_job_file(job_file)
    pool = [WorkerView(inventory=w) for w in load_inventory_file(workers)]
    outcome = place_gang(spec, pool)
    out.print(summary(spec))
    if not isinstance(outcome, Placement):
        out.print(f"[yellow]unplaceable:[/] {outcome.reason}")
        raise typer.Exit(1)
    port = spec.gang.rendezvous.port or 29500
    addressing = gang_addressing(outcome.path, outcome.members, port)
    out.print(f"[green]placed[/] on the [bold]{outcome.path.value}[/] path")
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("node", "worker", "hostname", "address", "interface", "ranks"):
        table.add_column(column)
    for node, member in zip(rank_plan(spec).nodes, outcome.members, strict=True):
        table.add_row(
            node.label,
            member.id,
            member.hostname,
            addressing.addresses[node.node_rank],
            addressing.interfaces[node.node_rank],
            ranks_text(node.ranks),
        )
    out.print(table)
    port_text = str(spec.gang.rendezvous.port or "PORT")
    print_commands(out, commands(spec, addressing.master_addr, port_text))
