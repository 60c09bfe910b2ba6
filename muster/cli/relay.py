"""``muster relay``: one relay of the relayed path (muster.net.relay)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import typer

from muster.cli.main import app, err, reports_errors
from muster.errors import UserError
from muster.net.relay import Relay

STATS_EVERY_S = 60.0


def host_port(text: str, flag: str) -> tuple[str, int]:
    """'HOST:PORT' or '[v6]:PORT' -> (host, port), or a UserError naming ``flag``."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{flag} {text!r}: give HOST:PORT (e.g. 10.0.0.5:7101)")
    return host, int(port)


def read_secret(path: Path | None, flag: str) -> bytes:
    """The relays' shared secret from a file (never a command line), at least 32 bytes."""
    if path is None:
        raise UserError(
            f"{flag} is required with relays: a file only you can read, holding at least 32 "
            "random bytes (`head -c 32 /dev/urandom | base64 > relay.secret`), the same one "
            "for the controller and every relay"
        )
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise UserError(f"{flag} {path}: {exc.strerror or exc}") from exc
    if len(secret) < 32:
        raise UserError(f"{flag} {path}: {len(secret)} bytes; give at least 32 random bytes")
    return secret


@app.command()
@reports_errors
def relay(
    listen: str = typer.Option("0.0.0.0:7101", help="HOST:PORT members and relays dial"),
    peer: list[str] = typer.Option([], "--peer", help="another relay (HOST:PORT); repeat"),
    name: str = typer.Option(None, help="this relay's name in the mesh [its listen address]"),
    secret_file: Path = typer.Option(None, help="the secret shared with the controller"),
) -> None:
    """Run a relay for relayed gangs: it admits members with the controller's tickets,
    forwards their (end-to-end encrypted) traffic, meshes with --peer relays, and counts the
    bytes each member sends."""
    where = host_port(listen, "--listen")
    peers = [host_port(p, "--peer") for p in peer]
    secret = read_secret(secret_file, "--secret-file")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    async def serve() -> None:
        r = Relay(name or listen, secret, where, peers)
        await r.start()
        err.print(f"muster relay {r.name} on {where[0]}:{r.port}", markup=False)
        while True:
            await asyncio.sleep(STATS_EVERY_S)
            logging.getLogger("muster.relay").info(
                "members %d, relays %d, bytes metered %d, dropped %d, refused %d",
                len(r.members),
                len(r.relays),
                sum(r.metered.values()),
                r.dropped,
                r.refused,
            )

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
