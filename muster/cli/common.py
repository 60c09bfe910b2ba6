"""Options every client verb shares, and how a secret is read (never from argv)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import typer

from muster.client import Client
from muster.errors import UserError

ControllerOpt = typer.Option(
    None,
    "--controller",
    "-c",
    envvar="MUSTER_CONTROLLER",
    help="controller URL [default: http://127.0.0.1:7070]",
)
TokenFileOpt = typer.Option(
    None,
    "--token-file",
    help="file (mode 0600) holding the API token `muster token --api` prints "
    "[or set MUSTER_API_TOKEN]; needed over TLS or off loopback",
)


def read_secret(path: Path | None, env: str, what: str) -> str | None:
    """A secret from a file only its owner can read, else from the variable ``env``.

    Secrets never travel on a command line: any process on the machine reads argv.
    """
    if path is not None:
        try:
            mode = path.stat().st_mode
            text = path.read_text().strip()
        except OSError as exc:
            raise UserError(f"--token-file {path}: cannot read it ({exc.strerror})") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UserError(
                f"--token-file {path} can be read by others (mode {stat.S_IMODE(mode):04o}); "
                f"it holds {what}: run `chmod 600 {path}`"
            )
        if not text:
            raise UserError(f"--token-file {path} is empty; it should hold {what}")
        return text
    value = os.environ.get(env, "").strip()
    return value or None


def client(controller: str | None, token_file: Path | None) -> Client:
    return Client(controller, read_secret(token_file, "MUSTER_API_TOKEN", "the API token"))
