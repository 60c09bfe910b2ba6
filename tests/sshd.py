"""A throwaway OpenSSH server on a loopback port, with generated keys (tests of `muster join
--ssh` and the guarded join sshd recipe). The client key's authorized_keys line is the
README's guarded recipe: forwarding only to the controller's port, no shell, no pty."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SSHD_PATHS = ("/usr/sbin/sshd", "/usr/bin/sshd")


@dataclass
class Sshd:
    port: int
    key: Path  # the client's private key
    known_hosts: Path
    proc: subprocess.Popen[bytes]
    log: Path
    source_key: Path | None = None  # a key that may only read the served tree (rrsync -ro)

    @property
    def client_options(self) -> list[str]:
        """ssh -o options a test client needs (this server's own host key file)."""
        return [f"UserKnownHostsFile={self.known_hosts}", "StrictHostKeyChecking=yes"]

    def stop(self) -> None:
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()


def sshd_binary() -> str | None:
    found = shutil.which("sshd")
    return found or next((p for p in SSHD_PATHS if os.path.exists(p)), None)


def guarded_key_line(public_key: str, controller_port: int) -> str:
    """The guarded join sshd recipe (README): this key may forward to the controller's port
    on loopback and do nothing else."""
    return (
        f'restrict,port-forwarding,permitopen="127.0.0.1:{controller_port}",'
        f'command="/bin/false" {public_key}'
    )


def source_key_line(public_key: str, served: Path) -> str:
    """The recipe's key for a published source tree: rsync may read it (re-rooted at
    ``served``), nothing else."""
    return f'command="rrsync -ro {served}",restrict {public_key}'


def start_sshd(
    root: Path, controller_port: int, *, guarded: bool = True, served: Path | None = None
) -> tuple[Sshd | None, str]:
    """An sshd for the current user on a free loopback port; (None, why) when none can run.
    ``guarded``: the join recipe (local forwards to the controller's port only, no command);
    otherwise a plain key that may run commands and forward back (``muster up``'s fan-out)."""
    binary = sshd_binary()
    if binary is None:
        return None, "no sshd (Debian's openssh-server; .ci/run installs it)"
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    host_key, key = root / "host_ed25519", root / "client_ed25519"
    source_key = root / "source_ed25519" if served is not None else None
    for path in (host_key, key, *([source_key] if source_key else [])):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
            check=True,
            capture_output=True,
        )
    authorized = root / "authorized_keys"
    public = (key.with_suffix(".pub")).read_text().strip()
    line = guarded_key_line(public, controller_port) if guarded else public
    if source_key is not None and served is not None:
        source_public = source_key.with_suffix(".pub").read_text().strip()
        line += "\n" + source_key_line(source_public, served)
    authorized.write_text(line + "\n")
    os.chmod(authorized, 0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    known_hosts = root / "known_hosts"
    host_public = host_key.with_suffix(".pub").read_text().split()
    known_hosts.write_text(f"[127.0.0.1]:{port} {host_public[0]} {host_public[1]}\n")
    config = root / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {host_key}",
                f"AuthorizedKeysFile {authorized}",
                f"PidFile {root / 'sshd.pid'}",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "StrictModes no",
                "UsePAM no",
                f"AllowTcpForwarding {'local' if guarded else 'yes'}",
                "X11Forwarding no",
                "PrintMotd no",
                "Subsystem sftp internal-sftp",  # sshfs (a guarded key's forced command bars it)
                "LogLevel VERBOSE",
                "",
            ]
        )
    )
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege separation directory
    log = root / "sshd.log"
    proc = subprocess.Popen(
        [binary, "-D", "-e", "-f", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),  # noqa: SIM115 - owned by the process
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None, f"sshd exited {proc.returncode}: {log.read_text()[-400:]}"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return Sshd(port, key, known_hosts, proc, log, source_key), ""
        time.sleep(0.1)
    proc.kill()
    return None, "sshd did not listen within 15 s"


def sshd_or_skip(
    root: Path, controller_port: int, *, guarded: bool = True, served: Path | None = None
) -> Sshd:
    """start_sshd for a test: where none can run it skips, saying why, unless
    MUSTER_TEST_REQUIRE_SSH=1 (CI), where it fails."""
    server, why_not = start_sshd(root, controller_port, guarded=guarded, served=served)
    if server is None:
        if os.environ.get("MUSTER_TEST_REQUIRE_SSH") == "1":
            pytest.fail(
                f"an OpenSSH server is required here (MUSTER_TEST_REQUIRE_SSH=1): {why_not}"
            )
        pytest.skip(f"no OpenSSH server can run here: {why_not}")
    return server
