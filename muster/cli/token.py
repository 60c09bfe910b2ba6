"""``muster token``: the join token agents need."""

from __future__ import annotations

import typer

from muster.cli.main import app, out, reports_errors
from muster.controller.app import join_token
from muster.store import open_store


@app.command()
@reports_errors
def token(
    db: str = typer.Option(None, "--db", help="the controller's database [data dir]"),
) -> None:
    """Print the join token (made at the controller's first start)."""
    out.print(join_token(open_store(db)), markup=False)
