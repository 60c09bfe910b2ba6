"""``muster token``: the join string agents need, or (``--api``) the API token users need."""

from __future__ import annotations

import typer

from muster.cli.main import app, out, reports_errors
from muster.controller.credentials import credentials
from muster.controller.tls import controller_certificate, join_string
from muster.store import open_store


@app.command()
@reports_errors
def token(
    db: str = typer.Option(None, "--db", help="the controller's database [data dir]"),
    api: bool = typer.Option(
        False, "--api", help="print the API token (submit, cancel, read) instead"
    ),
) -> None:
    """Print the join string for agents (the join secret, then the TLS certificate's sha256
    they pin); with --api, the API token for users in the same form."""
    store = open_store(db)
    creds = credentials(store)
    secret = creds.api_token if api else creds.join_secret
    out.print(join_string(secret, controller_certificate(store)[0]), markup=False)
