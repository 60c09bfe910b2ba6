"""``muster gc``: delete what ended jobs left behind (policy: muster.controller.retention)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import typer

from muster.cli.main import app, out, reports_errors
from muster.controller.retention import collect, cutoff_for
from muster.errors import UserError
from muster.spec import parse_duration
from muster.store import ensure_data_dir, open_store


def parse_retention(text: str, flag: str) -> timedelta:
    """A retention such as '7d', '36h' or seconds; '0' is zero."""
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise UserError(f"{flag} {text!r}: {exc}") from None
    if not isinstance(seconds, int) or seconds < 0:
        raise UserError(f"{flag} {text!r}: give a duration such as 7d, 36h or 3600")
    return timedelta(seconds=seconds)


@app.command()
@reports_errors
def gc(
    older_than: str = typer.Option(
        "7d", "--older-than", help="age past which an ended job's leftovers go: 7d, 36h, ..."
    ),
    db: str = typer.Option(None, "--db", help="SQLite path or postgresql://... [data dir]"),
    artifacts: Path = typer.Option(None, help="the controller's --artifacts directory [data dir]"),
    logs: bool = typer.Option(False, "--logs", help="also delete those jobs' log lines"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print what would go; delete nothing"),
) -> None:
    """Delete outputs, bundles (and with --logs, log lines) of jobs that ended long ago."""
    retention = parse_retention(older_than, "--older-than")
    root = artifacts or ensure_data_dir() / "artifacts"
    store = open_store(db)
    try:
        report = collect(store, root, cutoff_for(retention), logs=logs, dry_run=dry_run)
    finally:
        store.db.dispose()
    out.print(report.summary(), markup=False)
    for job in report.jobs:
        out.print(f"  job {job}", markup=False)
    for sha in report.bundles:
        out.print(f"  bundle {sha}", markup=False)
