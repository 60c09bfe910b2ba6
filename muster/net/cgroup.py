"""A cgroup (v2) per member, so nftables can tell a gang's ranks' sockets from the host's.

gloo and NCCL listen on ephemeral ports that nobody can name in advance. When torchrun
starts inside a cgroup of its own, every socket its ranks open carries that cgroup, and a rule
``socket cgroupv2 level N "path"`` matches exactly them, whatever the port. The group also
gives the agent a sure way to end the member: ``cgroup.kill`` reaches a rank that left
torchrun's process group.

The group is made beside the agent: ``<the agent's own cgroup>/muster-<digest of the worker
id>-<gang>``. It needs the v2 hierarchy mounted at or under ``/sys/fs/cgroup`` (where nft looks
its paths up), whole (not a cgroup namespace's part), and the right to make a group there.
Anything less: :func:`locate` says why, and the ranks run without the rule.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

NFT_BASE = Path("/sys/fs/cgroup")  # nft resolves `socket cgroupv2` paths under this
REMOVE_PATIENCE_S = 5.0


@dataclass(frozen=True)
class Hierarchy:
    mount: Path  # where the v2 hierarchy is mounted
    own: PurePosixPath  # the agent's cgroup in it ("/" at the root)


@dataclass(frozen=True)
class RankGroup:
    path: Path  # its directory
    nft_path: str  # relative to /sys/fs/cgroup, as nft names it
    level: int  # its depth in the hierarchy (the root is 0)

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"


def _is_root(mount: Path) -> bool:
    """Whether the mounted group is the hierarchy's root: only other groups have a type."""
    return not (mount / "cgroup.type").exists()


def _hierarchy(
    mountinfo: str, cgroup: str, is_root: Callable[[Path], bool] = _is_root
) -> Hierarchy | str:
    """From /proc/self/mountinfo and /proc/self/cgroup: the v2 hierarchy, or why not."""
    own = next((line[3:] for line in cgroup.splitlines() if line.startswith("0::")), None)
    if own is None:
        return "this process is in no cgroup v2 hierarchy"
    mounts: list[tuple[str, Path]] = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype = line.split(" - ", 1)[1].split()[0]
        if fstype == "cgroup2":
            mounts.append((fields[3], Path(fields[4].replace("\\040", " "))))
    if not mounts:
        return "no cgroup v2 hierarchy is mounted"
    whole = [point for root, point in mounts if root == "/"]
    if not whole or own.startswith("/.."):
        return "only part of the cgroup v2 hierarchy is visible here (a cgroup namespace)"
    under = [p for p in whole if p == NFT_BASE or NFT_BASE in p.parents]
    if not under:
        return f"the cgroup v2 hierarchy is mounted at {whole[0]}, not under {NFT_BASE}"
    mount = min(under, key=lambda p: len(p.parts))
    if not is_root(mount):  # a cgroup namespace's root, shown as "/"
        return "only part of the cgroup v2 hierarchy is visible here (a cgroup namespace)"
    return Hierarchy(mount=mount, own=PurePosixPath(own))


def locate() -> Hierarchy | str:
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
        cgroup = Path("/proc/self/cgroup").read_text()
    except OSError as exc:
        return f"cannot read this process's cgroups: {exc}"
    return _hierarchy(mountinfo, cgroup)


class RankGroups:
    """The groups of one agent's members."""

    def __init__(self, hierarchy: Hierarchy, key: str) -> None:
        """``key``: the agent's (``firewall.agent_key``); it prefixes every group's name."""
        self.hierarchy = hierarchy
        self.prefix = "muster-" + hashlib.sha256(key.encode()).hexdigest()[:12] + "-"
        self.parent = hierarchy.mount / str(hierarchy.own).lstrip("/")

    def group(self, gang: str) -> RankGroup:
        path = self.parent / (self.prefix + gang)
        nft_path = str(path.relative_to(NFT_BASE))
        # The agent's own group is at depth len(parts) - 1 ("/" is one part, level 0).
        return RankGroup(path=path, nft_path=nft_path, level=len(self.hierarchy.own.parts))

    def make(self, gang: str) -> RankGroup:
        group = self.group(gang)
        if group.path.exists():  # an earlier epoch of the same gang, or a crashed run
            self.remove(group)
        group.path.mkdir()
        return group

    def remove(self, group: RankGroup, patience: float = REMOVE_PATIENCE_S) -> int:
        """Remove the group; a process still in it (a rank that left torchrun's process
        group) is killed first. Returns how many were killed. Raises OSError past patience."""
        killed = 0
        deadline = time.monotonic() + patience
        while True:
            try:
                group.path.rmdir()
                return killed
            except FileNotFoundError:
                return killed
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
            pids = []
            with contextlib.suppress(OSError):
                pids = [int(p) for p in group.procs.read_text().split()]
            killed = max(killed, len(pids))
            try:  # Linux 5.14 and later: the whole group at once
                (group.path / "cgroup.kill").write_text("1")
            except OSError:
                for pid in pids:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def sweep(self) -> tuple[list[str], list[str]]:
        """Remove every group of this agent (a crashed run's): the names removed, and
        those that could not be (each with why)."""
        removed: list[str] = []
        failed: list[str] = []
        try:
            paths = [p for p in self.parent.iterdir() if p.name.startswith(self.prefix)]
        except OSError as exc:
            return removed, [f"{self.parent}: {exc}"]
        for path in paths:
            if not path.is_dir():
                continue
            try:
                self.remove(RankGroup(path, "", 0))
                removed.append(path.name)
            except OSError as exc:
                failed.append(f"{path.name}: {exc}")
        return removed, failed


def join(procs: Path) -> None:
    """In the child before exec: move this process into the group (its children follow).
    Errors are left to the caller's check: the child must not die of them."""
    with contextlib.suppress(OSError):
        procs.write_text("0")


def member_of(pid: int, group: RankGroup) -> bool:
    """Whether the process is in ``group`` (read from /proc, as the hierarchy names it)."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    own = next((line[3:] for line in text.splitlines() if line.startswith("0::")), "")
    return own.rstrip("/").endswith("/" + group.path.name)
