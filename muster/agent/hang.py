"""Is this member hung? Its ranks printed nothing and its process tree used no CPU for the
job's ``hang_timeout``. The agent checks every CHECK_EVERY_S and says HUNG to the controller
when the answer changes; the controller raises the job's ``Hung`` condition once every running
member says so (muster.gang.hang).

"No CPU" is at most IDLE_CPU_SHARE of one core per rank over the window: a rank parked in a
gloo collective or a sleep uses none, a rank that computes without printing uses plenty. Any
byte a rank writes (a progress bar's \r included) is output. A rank whose output cannot be
read (the controller's link is down, so the agent leaves it in the files) is never silent.

Limit: a rank waiting in an NCCL collective usually spins (cudaStreamSynchronize, NCCL's
proxy thread), so NCCL jobs may never read as idle; `muster stacks` still shows where they
wait. torch's NCCL watchdog (TORCH_NCCL timeout) ends such a rank on its own, and the failure
catalogue names it.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from dataclasses import dataclass, field

import psutil

CHECK_EVERY_S = 2.0
IDLE_CPU_SHARE = 0.02


def tree_cpu_seconds(pid: int, with_root: bool = True) -> float:
    """User + system CPU seconds of ``pid`` (unless not ``with_root``) and every process
    under it, with what their reaped children used (0 once gone). The agent leaves torchrun
    itself out: its monitor loop polls the ranks several times a second, hung or not."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [*([root] if with_root else []), *root.children(recursive=True)]
    except psutil.Error:
        return total
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


@dataclass
class HangWatch:
    """The silence-and-idleness clock of one member; ``observe`` says when it flips."""

    timeout: float
    last_output: float
    hung: bool = False
    samples: deque[tuple[float, float]] = field(default_factory=deque)  # (time, cpu seconds)

    def observe(self, now: float, output: int, cpu: float, ranks: int = 1) -> bool | None:
        """One check: ``output`` bytes the ranks wrote since the last one (-1: they could not
        be read), ``cpu`` the ranks' CPU seconds so far, ``ranks`` how many there are.
        Returns True when the member has just become hung, False when it has just stopped,
        else None."""
        if output != 0:
            self.last_output = now
        if self.samples:  # a process that ended took its seconds along: never backwards
            cpu = max(cpu, self.samples[-1][1])
        self.samples.append((now, cpu))
        # Keep the newest sample at least ``timeout`` old: the base of the CPU window.
        while len(self.samples) > 1 and self.samples[1][0] <= now - self.timeout:
            self.samples.popleft()
        base_time, base_cpu = self.samples[0]
        silent = now - self.last_output >= self.timeout
        idle = now - base_time >= self.timeout and cpu - base_cpu <= (
            IDLE_CPU_SHARE * max(1, ranks) * (now - base_time)
        )
        hung = silent and idle
        if hung == self.hung:
            return None
        self.hung = hung
        return hung

    def silent_for(self, now: float) -> float:
        return now - self.last_output


OOM_MARKS = ("Killed process", "Kill process", "oom-kill:")


def kernel_oom_lines(texts: list[str], pids: set[int]) -> list[str]:
    """The OOM killer's lines about ``pids`` among kernel log messages."""
    found = []
    for text in texts:
        if not any(mark in text for mark in OOM_MARKS):
            continue
        if any(f"process {pid} " in text or f"pid={pid}," in text for pid in pids):
            found.append(f"kernel: {text.strip()}")
    return found[-5:]


class KernelLog:
    """The kernel's log from now on (``/dev/kmsg``, positioned at its end), where the agent
    may read it (root, or kernel.dmesg_restrict 0): at a rank's SIGKILL, what came since
    says whether the OOM killer did it. No clock is compared, and nothing older is read."""

    MAX_RECORDS = 100_000

    def __init__(self, path: str = "/dev/kmsg") -> None:
        try:
            self.fd: int | None = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self.fd, 0, os.SEEK_END)
        except OSError:
            self.close()
            self.fd = None

    def read_new(self) -> list[str]:
        """The messages logged since the last read (one record per read(2))."""
        texts: list[str] = []
        if self.fd is None:
            return texts
        for _ in range(self.MAX_RECORDS):
            try:
                record = os.read(self.fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:  # EPIPE: records overwritten while reading; go on
                continue
            # "prio,seq,usec,flags;text" then " KEY=VALUE" continuation lines
            texts.append(record.partition(";")[2].split("\n", 1)[0])
        return texts

    def close(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fd = None
