"""Node 0's rendezvous port before torchrun has it, and every member's check of it.

A gang across nodes must not start half-wired: a member that cannot reach node 0's port would
leave every rank waiting in the rendezvous until torchrun's own timeout, and a member on
another torch fails in ways that name nothing. So node 0's agent *holds* the port it
publishes (PREPARE_RENDEZVOUS): it binds and listens on it, on every address as torchrun's
store will, from then until its ASSIGN, when it lets go just before torchrun starts (which
also keeps another process from taking the port meanwhile). Before any ASSIGN, every member
dials it (MASTER_CHECK: a TCP connect, closed at once; the kernel completes it from the
listen backlog) and says the torch and NCCL versions of the job's Python, read from the
installed packages' metadata (no torch import: ~0.1 s). The controller compares them
(muster.gang.gating) and fails or fences the epoch, naming the member and the fix.

A held port is let go on ASSIGN, on STOP of the job, on a newer epoch's PREPARE, and after
HOLD_MAX_S whatever happens (a controller that never came back).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import socket
import time
from typing import Any

log = logging.getLogger("muster.agent")

HOLD_MAX_S = 300.0  # a held port goes after this, assigned or not
DIAL_S = 10.0  # one member's dial of node 0's port, all tries together
VERSIONS_S = 20.0  # reading the versions in the job's Python

_VERSIONS = """
import importlib.metadata as m, json
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
torch = version("torch")
nccl = None
for dist in m.distributions():
    if (dist.metadata["Name"] or "").lower().startswith("nvidia-nccl"):
        nccl = dist.version
        break
print(json.dumps({"torch": torch.split("+")[0] if torch else None, "nccl": nccl}))
"""


class Holds:
    """The rendezvous ports this agent holds for node 0 of a job, one per job."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[Any, int, asyncio.AbstractServer, asyncio.TimerHandle]] = {}

    async def hold(self, job: str, epoch: Any, addr: str, port: int | None) -> int:
        """Listen on ``port`` (a free one when None) for the job's epoch and return it; the
        same epoch asked again (a controller that restarted) gets the port it holds."""
        current = self._held.get(job)
        if current is not None and current[0] == epoch:
            return current[1]
        self.release(job)
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Every address, as torchrun's store binds: the advertised address may be a
            # NAT's or an elastic one that no local interface holds.
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port or 0))
            sock.listen(128)
            sock.setblocking(False)
            # Every dial is accepted and closed at once: a gang of any size finds room.
            server = await asyncio.start_server(_close_at_once, sock=sock)
        except OSError:
            sock.close()
            raise
        held = int(sock.getsockname()[1])
        timer = asyncio.get_running_loop().call_later(HOLD_MAX_S, self.release, job, epoch)
        self._held[job] = (epoch, held, server, timer)
        return held

    def release(self, job: str, epoch: Any = None) -> None:
        """Let the job's port go (only the given epoch's, when one is given)."""
        current = self._held.get(job)
        if current is None or (epoch is not None and current[0] != epoch):
            return
        del self._held[job]
        current[3].cancel()
        current[2].close()

    def held(self, job: str) -> int | None:
        current = self._held.get(job)
        return current[1] if current is not None else None

    def release_all(self) -> None:
        for job in list(self._held):
            self.release(job)


async def _close_at_once(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


async def _open(addr: str, port: int, via: str | None) -> asyncio.StreamWriter:
    """A TCP connection to addr:port: directly, or through the SOCKS5 endpoint ``via``
    (host:port; the relayed path's, muster.net.relayed), as the ranks' shim would."""
    if via is None:
        _reader, writer = await asyncio.open_connection(addr, port)
        return writer
    host, _, socks_port = via.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(socks_port))
    try:  # (closed on any way out but success, a cancellation included)
        writer.write(b"\x05\x01\x00")
        if await reader.readexactly(2) != b"\x05\x00":
            raise ConnectionRefusedError(111, "the relayed endpoint refused the handshake")
        packed = ipaddress.ip_address(addr).packed
        kind = b"\x01" if len(packed) == 4 else b"\x04"
        writer.write(b"\x05\x01\x00" + kind + packed + port.to_bytes(2, "big"))
        reply = await reader.readexactly(4)
        await reader.readexactly(6 if reply[3] == 1 else 18)
    except (asyncio.IncompleteReadError, ValueError) as exc:
        writer.close()
        raise ConnectionResetError(104, f"the relayed endpoint: {exc}") from exc
    except BaseException:
        writer.close()
        raise
    if reply[1] != 0:
        writer.close()
        raise ConnectionRefusedError(111, "Connection refused (through the relays)")
    return writer


async def dial(addr: str, port: int, within: float = DIAL_S, via: str | None = None) -> str | None:
    """None when a TCP connection to addr:port opens within ``within`` seconds (tried again
    after a refusal or a network error, until then); else why not. ``via``: through that
    SOCKS5 endpoint (the relayed path)."""
    deadline = time.monotonic() + within
    why = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return why
        try:
            writer = await asyncio.wait_for(_open(addr, port, via), left)
        except TimeoutError:
            return f"no answer within {within:.0f}s (a firewall drops it, or no route)"
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            continue
        writer.close()  # this side closes first: its TIME_WAIT stays here, not on node 0
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return None


async def versions(python: str, within: float = VERSIONS_S) -> dict[str, str | None]:
    """torch and NCCL (the nvidia-nccl wheel torch brings) in the job's Python, from the
    packages' metadata; None for each that is not known."""
    unknown: dict[str, str | None] = {"torch": None, "nccl": None}
    try:
        proc = await asyncio.create_subprocess_exec(
            python,
            "-c",
            _VERSIONS,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except OSError as exc:
        log.warning("reading the versions in %s failed: %s", python, exc)
        return unknown
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), within)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        log.warning("reading the versions in %s took over %.0fs", python, within)
        return unknown
    try:
        found = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return unknown
    return {k: str(found[k]) if found.get(k) else None for k in unknown}


async def check(python: str, addr: str | None, port: int, via: str | None = None) -> dict[str, Any]:
    """MASTER_CHECKED's body (without the ids): the dial's error (node 0 does not dial) and
    the versions, read at the same time. ``via``: the relayed path's SOCKS5 endpoint."""
    if addr is None:
        return {"error": None, **await versions(python)}
    error, found = await asyncio.gather(dial(addr, port, via=via), versions(python))
    return {"error": error, **found}
