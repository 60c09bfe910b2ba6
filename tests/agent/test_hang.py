"""The member's hang clock: silent (no line read) and idle (no CPU) for the whole timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from muster.agent.hang import IDLE_CPU_SHARE, HangWatch, tree_cpu_seconds


def test_silent_and_idle_for_the_timeout_flips_once_and_back() -> None:
    watch = HangWatch(timeout=60, last_output=0)
    assert watch.observe(0, 0, 5.0) is None
    assert watch.observe(30, 0, 5.0) is None
    assert watch.observe(59, 0, 5.0) is None, "not the whole timeout yet"
    assert watch.observe(61, 0, 5.0) is True
    assert watch.observe(63, 0, 5.0) is None, "said once"
    assert watch.observe(65, 3, 5.0) is False, "a line: active again"


def test_a_rank_that_computes_without_printing_is_not_hung() -> None:
    watch = HangWatch(timeout=60, last_output=0)
    cpu = 0.0
    for now in range(0, 200, 2):
        cpu += 2 * 0.5  # half a core
        assert watch.observe(now, 0, cpu) is None
    assert not watch.hung
    # It stops computing: hung a whole timeout later, not before.
    flips = [(now, watch.observe(now, 0, cpu)) for now in range(200, 300, 2)]
    (when,) = [now for now, flip in flips if flip]
    assert 256 <= when <= 262, when


def test_lines_that_cannot_be_read_are_not_silence() -> None:
    watch = HangWatch(timeout=10, last_output=0)
    for now in range(0, 40, 2):
        assert watch.observe(now, -1, 0.0) is None
    assert IDLE_CPU_SHARE < 0.05


def test_tree_cpu_counts_the_children() -> None:
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'sum(range(10**9))'])"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20  # a busy machine gives it the CPU late
        while tree_cpu_seconds(proc.pid, with_root=False) < 0.3:
            assert time.monotonic() < deadline, "the grandchild's work counts"
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    assert tree_cpu_seconds(os.getpid()) > 0
    assert tree_cpu_seconds(2**22 + 12345) == 0.0


def test_before_the_command_the_interface_must_exist_and_hold_the_address() -> None:
    from muster.agent.inventory import bind_problem

    assert bind_problem("lo", "127.0.0.1") == (None, None)
    assert bind_problem(None, "10.0.0.1") == (None, None), "nothing pinned: nothing to check"
    gone, _ = bind_problem("nosuch0", "10.0.0.1")
    assert gone is not None
    assert "nosuch0" in gone
    assert "lo" in gone
    assert "--interface" in gone
    # An address the interface does not hold (a NAT's): a warning, not a failure.
    problem, warning = bind_problem("lo", "10.254.254.254")
    assert problem is None
    assert warning is not None
    assert "does not hold 10.254.254.254" in warning
    assert "127.0.0.1" in warning
    assert bind_problem("lo", "::1") == (None, None)


def test_the_kernels_oom_lines_since_the_member_started() -> None:
    from muster.agent.hang import kernel_oom_lines, oom_kills_since

    records = [
        "6,100,5000000,-;eth0: link up\n",
        "3,101,9000000,-;Out of memory: Killed process 7 (python) total-vm:1kB\n",  # before
        "4,102,12000000,-;python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE)\n",
        "6,103,12000100,-;oom-kill:constraint=CONSTRAINT_NONE,task=python,pid=48213,uid=0\n",
        "3,104,12000200,-;Out of memory: Killed process 48213 (python) total-vm:2kB\n",
        "garbage without fields",
    ]
    lines = kernel_oom_lines(records, since=10.0)
    assert lines == [
        "kernel: oom-kill:constraint=CONSTRAINT_NONE,task=python,pid=48213,uid=0",
        "kernel: Out of memory: Killed process 48213 (python) total-vm:2kB",
    ]
    assert oom_kills_since(0.0, path="/nonexistent/kmsg") == [], "unreadable: nothing"
