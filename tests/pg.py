"""A throwaway PostgreSQL server from Debian's package, on loopback, for the store tests.

It runs as the ``postgres`` system user when the tests run as root (initdb refuses root),
keeps its data in a fresh directory, and is stopped at the end of the session.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass


@dataclass
class PostgresServer:
    bindir: str
    datadir: str
    port: int
    user: str

    @property
    def admin_url(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/postgres"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        _run(self, [f"{self.bindir}/pg_ctl", "-D", self.datadir, "-m", "immediate", "-w", "stop"])
        shutil.rmtree(self.datadir, ignore_errors=True)


def _bindir() -> str | None:
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(os.path.realpath(found))
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(dirs[-1]) if dirs else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(server: PostgresServer, argv: list[str]) -> subprocess.CompletedProcess[str]:
    if os.geteuid() == 0:
        argv = ["runuser", "-u", "postgres", "--", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def start_postgres() -> tuple[PostgresServer | None, str]:
    """Start a server, or return (None, why not)."""
    url = os.environ.get("MUSTER_TEST_POSTGRES_URL")
    if url:
        return _External(url), ""
    bindir = _bindir()
    if bindir is None:
        return None, "initdb not found; install Debian's postgresql package (.ci/run does)"
    datadir = tempfile.mkdtemp(prefix="muster-pg-")
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            return None, "running as root and there is no postgres user to run initdb as"
        os.chown(datadir, pw.pw_uid, pw.pw_gid)
    server = PostgresServer(bindir, datadir, _free_port(), "muster")
    init = _run(
        server,
        [
            f"{bindir}/initdb",
            "-D",
            datadir,
            "-A",
            "trust",
            "-U",
            "muster",
            "--no-sync",
            "-E",
            "UTF8",
        ],
    )
    if init.returncode != 0:
        return None, f"initdb failed: {init.stderr.strip()[-500:]}"

    def pg_ctl_start(port: int) -> subprocess.CompletedProcess[str]:
        options = f"-p {port} -k {datadir} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = f"{datadir}/server.log"
        argv = [f"{bindir}/pg_ctl", "-D", datadir, "-o", options, "-l", log, "-w", "-t", "60"]
        return _run(server, [*argv, "start"])

    start = pg_ctl_start(server.port)
    if start.returncode != 0 and "already in use" in _log_of(datadir):
        # The port was picked free before initdb; something took it since: once more.
        server = PostgresServer(bindir, datadir, _free_port(), "muster")
        start = pg_ctl_start(server.port)
    if start.returncode != 0:
        return None, f"pg_ctl start failed: {start.stdout.strip()[-500:]}"
    return server, ""


def _log_of(datadir: str) -> str:
    try:
        with open(f"{datadir}/server.log") as log:
            return log.read()
    except OSError:
        return ""


class _External(PostgresServer):
    """A server someone else runs (MUSTER_TEST_POSTGRES_URL): create databases, never stop it."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        super().__init__("", "", 0, "")

    @property
    def admin_url(self) -> str:
        return self.url

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def stop(self) -> None:
        pass
