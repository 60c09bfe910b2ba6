"""Options every client verb shares."""

from __future__ import annotations

import typer

from muster.client import Client

ControllerOpt = typer.Option(
    None,
    "--controller",
    "-c",
    envvar="MUSTER_CONTROLLER",
    help="controller URL [default: http://127.0.0.1:7070]",
)
TokenOpt = typer.Option(
    None,
    "--token",
    envvar="MUSTER_TOKEN",
    help="join token (`muster token`); needed when the controller is off loopback",
)


def client(controller: str | None, token: str | None) -> Client:
    return Client(controller, token)
