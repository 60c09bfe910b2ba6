"""A controller and agents as local processes on loopback: `muster demo` and the tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from muster.client import Client
from muster.controller.credentials import credentials
from muster.controller.tls import controller_certificate, join_string
from muster.errors import InfrastructureError
from muster.store import open_store


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_torchrun(script: str | Path, *args: str, nproc: int = 2) -> list[str]:
    """The argv of a one-machine torchrun on loopback (a free port, no restarts)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts=0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        *args,
    ]


@dataclass
class LocalCluster:
    """``muster server`` plus N ``muster agent`` processes, all cleaned up on exit."""

    agents: int = 2
    data_dir: Path | None = None
    db: str | None = None
    heartbeat_timeout: float = 15.0
    heartbeat_interval: float = 3.0
    agent_args: list[str] = field(default_factory=list)
    server_args: list[str] = field(default_factory=list)
    tls: bool = False
    port: int = 0
    _tokens: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> LocalCluster:
        if self.data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="muster-")
            self.data_dir = Path(self._tmp.name)
        self.port = self.port or free_port()
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (timeout, kill) unwinds like Ctrl-C, so __exit__ still stops everything.
            signal.signal(signal.SIGTERM, _raise_exit)
        try:
            self.start_server()
            for i in range(self.agents):
                self.start_agent(f"agent-{i}")
            self.wait_for_workers(self.agents)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def client(self) -> Client:
        return Client(self.url, self.token())

    def _env(self) -> dict[str, str]:
        assert self.data_dir is not None
        env = dict(os.environ)
        env["MUSTER_DATA_DIR"] = str(self.data_dir)
        env.pop("MUSTER_CONTROLLER", None)
        env.pop("MUSTER_TOKEN", None)
        env.pop("MUSTER_API_TOKEN", None)
        return env

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        assert self.data_dir is not None
        log = open(self.data_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen(
            [sys.executable, "-m", "muster", *args],
            env={**self._env(), **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def start_server(self) -> None:
        args = [
            "server",
            "--port",
            str(self.port),
            "--heartbeat-timeout",
            str(self.heartbeat_timeout),
            "--heartbeat-interval",
            str(self.heartbeat_interval),
        ]
        if self.db:
            args += ["--db", self.db]
        if self.tls:
            args.append("--tls")
        self._spawn("server", [*args, *self.server_args])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                # Up is up: health needs no token, and the certificate is pinned later.
                httpx.get(f"{self.url}/v1/health", verify=False, timeout=5).raise_for_status()
                return
            if self.procs["server"].poll() is not None:
                break
            time.sleep(0.1)
        raise InfrastructureError(f"the controller did not start; see {self.log('server')}")

    def _muster_token(self, *flags: str) -> str:
        """What `muster token [flags]` prints, read here from the controller's database (the
        same code, without a second interpreter's start: ~1.4 s each)."""
        key = " ".join(flags)
        if key not in self._tokens:
            assert self.data_dir is not None
            store = open_store(self.db or str(self.data_dir / "muster.db"))
            try:
                creds = credentials(store)
                secret = creds.api_token if "--api" in flags else creds.join_secret
                self._tokens[key] = join_string(secret, controller_certificate(store)[0])
            finally:
                store.db.dispose()
        return self._tokens[key]

    def token(self) -> str:
        """The API token string (`muster token --api`): what users and the SDK send."""
        return self._muster_token("--api")

    def join_token(self) -> str:
        """The join string (`muster token`): what agents prove they hold."""
        return self._muster_token()

    def start_agent(
        self, name: str, extra: list[str] | None = None, join: str | None = None
    ) -> subprocess.Popen[bytes]:
        """Start an agent; it reads the join string from MUSTER_TOKEN, never from argv."""
        assert self.data_dir is not None
        return self._spawn(
            name,
            [
                "agent",
                "--controller",
                self.url,
                "--name",
                name,
                "--work-dir",
                str(self.data_dir / name),
                *self.agent_args,
                *(extra or []),
            ],
            env={"MUSTER_TOKEN": join if join is not None else self.join_token()},
        )

    def wait_for_workers(self, count: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        api = self.client()
        while time.monotonic() < deadline:
            connected = [w for w in api.workers() if w["connected"] and w["state"] == "idle"]
            if len(connected) >= count:
                return
            time.sleep(0.2)
        raise InfrastructureError(f"{count} agents did not connect within {timeout:.0f}s")

    def log(self, name: str) -> Path:
        assert self.data_dir is not None
        return self.data_dir / f"{name}.log"

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Agents first (they stop their jobs' process trees), then the controller.
        for name in [n for n in self.procs if n != "server"] + ["server"]:
            self.stop(name)
        if self._tmp is not None:
            self._tmp.cleanup()
