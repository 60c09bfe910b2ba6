"""``muster join --data-source sshfs://[user@]host[:port]:/abs/dir``: mount a box's data root
read-only before it dials, when its ``--data-path`` is not there yet (seed 003).

Read-only is the invariant, not a precaution: a rank reads the data root and never writes
it. The mount authenticates with the same ssh key and options as ``--ssh`` (BatchMode: never
a password prompt). It is made again before each dial when it went away, and taken down when
the agent stops.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from muster.errors import InfrastructureError, UserError

MOUNT_TIMEOUT_S = 60
_SSHFS = re.compile(
    r"^sshfs://(?:(?P<user>[^-@/\s][^@/\s]*)@)?(?P<host>[^-:/\s][^:/\s]*)(?::(?P<port>\d+))?"
    r":(?P<path>/\S*)$"
)


@dataclass
class SshfsSource:
    url: str
    mountpoint: Path
    identity_file: str | None = None
    options: list[str] = field(default_factory=list)
    mounted_here: bool = False

    def __post_init__(self) -> None:
        found = _SSHFS.match(self.url)
        if found is None:
            raise UserError(
                f"--data-source {self.url!r}: write sshfs://[user@]host[:port]:/absolute/path"
            )
        self.user, self.host, self.path = found["user"], found["host"], found["path"]
        self.port = int(found["port"] or 22)

    def argv(self) -> list[str]:
        options = ["ro", "BatchMode=yes", f"port={self.port}", "reconnect"]
        if self.identity_file:
            options.append(f"IdentityFile={Path(self.identity_file).expanduser()}")
        options += self.options
        remote = f"{self.user}@{self.host}" if self.user else self.host
        return ["sshfs", "-o", ",".join(options), f"{remote}:{self.path}", str(self.mountpoint)]

    def ensure(self) -> None:
        """Mounted (read-only) before a dial: made now when it is not there."""
        if os.path.ismount(self.mountpoint) and _readable(self.mountpoint):
            return
        if shutil.which("sshfs") is None:
            raise UserError("--data-source sshfs://... needs sshfs (Debian's sshfs package)")
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        if os.path.ismount(self.mountpoint):  # a stale mount (the server went away)
            self.unmount()
        elif any(self.mountpoint.iterdir()):
            raise UserError(
                f"--data-path {self.mountpoint} holds files and is not a mount: name an empty "
                "directory for --data-source to mount on, or drop --data-source"
            )
        try:
            done = subprocess.run(
                self.argv(), capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise InfrastructureError(f"sshfs {self.url} could not run: {exc}") from exc
        if done.returncode != 0:
            said = " ".join(done.stderr.split())[-400:]
            raise InfrastructureError(f"sshfs {self.url} on {self.mountpoint} failed: {said}")
        self.mounted_here = True

    def unmount(self) -> None:
        for tool in ("fusermount3", "fusermount"):
            if shutil.which(tool):
                subprocess.run(
                    [tool, "-u", "-z", str(self.mountpoint)], capture_output=True, check=False
                )
                return


def _readable(path: Path) -> bool:
    try:
        next(iter(os.scandir(path)), None)
    except OSError:
        return False
    return True
