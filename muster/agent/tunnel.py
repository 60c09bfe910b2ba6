"""``muster join --ssh``: dial the controller through an OpenSSH local forward.

Each dial brings up a fresh ``ssh -N -L`` forward to the controller's port as the ssh host
sees it, on the same local port every time (a member's uploads in flight keep their address
across a re-dial). ``BatchMode=yes``: never a password prompt; ``ExitOnForwardFailure=yes``:
a forward that cannot be set up ends ssh at once, with its reason, instead of a session
without it. The agent then talks to ``http(s)://127.0.0.1:PORT`` for everything; the
addresses its ranks use are its own, not the controller's map of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import re
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path

from muster.errors import InfrastructureError, UserError

OPEN_TIMEOUT_S = 20.0
PR_SET_PDEATHSIG = 1
_TARGET = re.compile(r"^(?:(?P<user>[^@\s]+)@)?(?P<host>\[[^\]]+\]|[^:@\s]+)(?::(?P<port>\d+))?$")


@dataclass
class SshTunnel:
    target: str  # [user@]host[:port]
    remote_host: str  # the controller, as the ssh host sees it
    remote_port: int
    identity_file: str | None = None
    options: list[str] = field(default_factory=list)
    local_port: int = 0
    _proc: asyncio.subprocess.Process | None = None

    def __post_init__(self) -> None:
        found = _TARGET.match(self.target)
        if found is None:
            raise UserError(f"--ssh {self.target!r}: write [user@]host[:port]")
        self.user, self.host = found["user"], found["host"].strip("[]")
        self.port = int(found["port"] or 22)
        if not 0 < self.port < 65536:
            raise UserError(f"--ssh {self.target!r}: port {self.port} is out of range")
        if not self.local_port:
            self.local_port = _free_port()

    def argv(self) -> list[str]:
        argv = ["ssh", "-N", "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes"]
        argv += ["-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3"]
        if self.identity_file:
            argv += ["-i", str(Path(self.identity_file).expanduser())]
        for option in self.options:
            argv += ["-o", option]
        remote = f"[{self.remote_host}]" if ":" in self.remote_host else self.remote_host
        forward = f"127.0.0.1:{self.local_port}:{remote}:{self.remote_port}"
        argv += ["-p", str(self.port), "-L", forward]
        argv += ["--", f"{self.user}@{self.host}" if self.user else self.host]
        return argv

    def url(self, scheme: str) -> str:
        return f"{scheme}://127.0.0.1:{self.local_port}"

    async def open(self, timeout: float = OPEN_TIMEOUT_S) -> None:
        """A fresh forward; returns once ssh listens on the local port. Raises
        InfrastructureError with ssh's own words when it exits or does not listen in time.
        When another process holds the local port, a new one is taken (``url`` changes)."""
        said = ""
        for _attempt in range(3):
            await self.close()
            if not _free(self.local_port):
                self.local_port = _free_port()
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                preexec_fn=_die_with_parent,
            )
            if await self._listening(timeout):
                return
            said = await self._stderr()
            await self.close()
            if "Address already in use" not in said:
                break
            self.local_port = _free_port()  # taken between our look and ssh's bind
        raise InfrastructureError(
            f"ssh to {self.target} could not forward 127.0.0.1:{self.local_port} to "
            f"{self.remote_host}:{self.remote_port}: {said or 'no answer in time'}"
        )

    async def _listening(self, timeout: float) -> bool:
        """Whether this ssh (not some other process) listens on the local port: the port
        accepts, and ssh is still running a moment later (a failed bind ends it)."""
        assert self._proc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline and self._proc.returncode is None:
            with contextlib.suppress(OSError, TimeoutError):
                _reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", self.local_port), 2
                )
                writer.close()
                await asyncio.sleep(0.3)
                return self._proc.returncode is None
            await asyncio.sleep(0.1)
        return False

    async def _stderr(self) -> str:
        if self._proc is None or self._proc.stderr is None:
            return ""
        if self._proc.returncode is None:
            return ""
        data = await self._proc.stderr.read()
        return " ".join(data.decode(errors="replace").split())[-400:]

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _die_with_parent() -> None:
    """In ssh, before exec: SIGTERM when the agent dies, even by SIGKILL (Linux prctl)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
