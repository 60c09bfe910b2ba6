"""``muster token``: the join token agents need."""

from __future__ import annotations

import typer

from muster.cli.main import app, out, reports_errors
from muster.controller.app import join_token
from muster.controller.tls import controller_certificate, join_string
from muster.store import open_store


@app.command()
@reports_errors
def token(
    db: str = typer.Option(None, "--db", help="the controller's database [data dir]"),
) -> None:
    """Print the join string: the token, then the TLS certificate's sha256 that agents pin."""
    store = open_store(db)
    secret = join_token(store)
    out.print(join_string(secret, controller_certificate(store)[0]), markup=False)
