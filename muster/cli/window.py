"""``muster start JOB`` and ``muster status JOB``: a window job's join window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from muster.cli.common import ControllerOpt, TokenFileOpt, client
from muster.cli.main import app, out, reports_errors


def print_window(job_id: str, view: dict[str, Any]) -> None:
    if view.get("phase") is None:
        out.print(f"{job_id}: no join window (state {view['job_state']})", markup=False)
        return
    head = f"{job_id}: window {view['phase']} (job {view['job_state']})"
    if "quorum" in view:
        target = view["target"] if view["target"] is not None else "none"
        head += (
            f", start {view['start']}, {view['ranks']} rank(s) in, quorum {view['quorum']}, "
            f"target {target}"
        )
        if view.get("next_deadline_in") is not None:
            head += f", clock {view['next_deadline_in']:.0f}s"
    out.print(head, markup=False)
    if view.get("startable"):
        out.print(f"startable: muster start {job_id}", markup=False)
    if view.get("reason") and view["phase"] == "failed":
        out.print(f"reason: {view['reason']}", markup=False)
    roster = view.get("roster") or []
    if roster:
        table = Table(box=None, pad_edge=False)
        for column in ("HOST", "RANKS", "WORKER"):
            table.add_column(column)
        for m in roster:
            last = m["first_rank"] + m["ranks"] - 1
            span = f"{m['first_rank']}-{last}" if m["ranks"] > 1 else str(m["first_rank"])
            table.add_row(m["host"], span, m["worker"])
        out.print(table)


@app.command()
@reports_errors
def status(
    job_id: str = typer.Argument(None, help="a membership: window job [every open window]"),
    controller: str = ControllerOpt,
    token_file: Path | None = TokenFileOpt,
) -> None:
    """Show a window job's join window: phase, rules, the roster in rank order (without JOB:
    every window still open)."""
    api = client(controller, token_file)
    if job_id is not None:
        print_window(job_id, api.window(job_id))
        return
    open_ones = [
        j["id"]
        for j in api.jobs()
        if j["state"] == "queued" and (j.get("why_pending") or "").startswith("join window")
    ]
    if not open_ones:
        out.print("no join window is open", markup=False)
    for job in open_ones:
        print_window(job, api.window(job))


@app.command()
@reports_errors
def start(
    job_id: str = typer.Argument(..., help="a membership: window job whose window is staging"),
    controller: str = ControllerOpt,
    token_file: Path | None = TokenFileOpt,
) -> None:
    """Fire a staging join window (start: manual or hybrid): the world forms now, with the
    walk-ins on its roster. Refused, with the reason, below quorum or in auto mode."""
    view = client(controller, token_file).start(job_id)
    print_window(job_id, view)
