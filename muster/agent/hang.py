"""Is this member hung? Its ranks printed nothing and its process tree used no CPU for the
job's ``hang_timeout``. The agent checks every CHECK_EVERY_S and says HUNG to the controller
when the answer changes; the controller raises the job's ``Hung`` condition once every running
member says so (muster.gang.lifecycle).

"No CPU" is at most IDLE_CPU_SHARE of one core over the window: a rank parked in a gloo
collective or a sleep uses none, a rank that computes without printing uses plenty. A rank
whose lines cannot be read (the controller's link is down, so the agent leaves them in the
files) is never silent.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import psutil

CHECK_EVERY_S = 2.0
IDLE_CPU_SHARE = 0.02


def tree_cpu_seconds(pid: int, with_root: bool = True) -> float:
    """User + system CPU seconds of ``pid`` (unless not ``with_root``) and every process
    under it (0 once gone). The agent leaves torchrun itself out: its monitor loop polls
    the ranks several times a second, hung or not."""
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
        total += times.user + times.system
    return total


@dataclass
class HangWatch:
    """The silence-and-idleness clock of one member; ``observe`` says when it flips."""

    timeout: float
    last_output: float
    hung: bool = False
    samples: deque[tuple[float, float]] = field(default_factory=deque)  # (time, cpu seconds)

    def observe(self, now: float, lines: int, cpu: float) -> bool | None:
        """One check: ``lines`` read since the last one (-1: could not read them). Returns
        True when the member has just become hung, False when it has just stopped, else
        None."""
        if lines != 0:
            self.last_output = now
        self.samples.append((now, cpu))
        # Keep the newest sample at least ``timeout`` old: the base of the CPU window.
        while len(self.samples) > 1 and self.samples[1][0] <= now - self.timeout:
            self.samples.popleft()
        base_time, base_cpu = self.samples[0]
        silent = now - self.last_output >= self.timeout
        idle = now - base_time >= self.timeout and cpu - base_cpu <= IDLE_CPU_SHARE * (
            now - base_time
        )
        hung = silent and idle
        if hung == self.hung:
            return None
        self.hung = hung
        return hung

    def silent_for(self, now: float) -> float:
        return now - self.last_output
