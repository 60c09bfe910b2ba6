"""The member's hang clock: silent (no line read) and idle (no CPU) for the whole timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

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


def test_the_kernels_oom_lines_about_the_members_pids() -> None:
    from muster.agent.hang import kernel_oom_lines

    texts = [
        "eth0: link up",
        "python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE), order=0",
        "oom-kill:constraint=CONSTRAINT_NONE,task=python,pid=48213,uid=0",
        "Out of memory: Killed process 48213 (python) total-vm:2kB, anon-rss:1kB",
        "Out of memory: Killed process 777 (chrome) total-vm:2kB",  # somebody else's
    ]
    assert kernel_oom_lines(texts, {48213}) == [
        "kernel: oom-kill:constraint=CONSTRAINT_NONE,task=python,pid=48213,uid=0",
        "kernel: Out of memory: Killed process 48213 (python) total-vm:2kB, anon-rss:1kB",
    ]
    assert kernel_oom_lines(texts, {5}) == [], "another process's kill is not this job's"


def test_the_kernel_log_is_read_from_the_members_start_on() -> None:
    """Positioned at the end when opened: only what the kernel logs later comes back."""
    from muster.agent.hang import KernelLog, kernel_oom_lines

    assert KernelLog("/nonexistent/kmsg").read_new() == []
    log = KernelLog()
    if log.fd is None:
        pytest.skip("the kernel log is not readable here (/dev/kmsg: root or dmesg_restrict=0)")
    try:
        assert not [t for t in log.read_new() if "muster-test" in t], "nothing older"
        try:
            with open("/dev/kmsg", "w") as kmsg:
                kmsg.write("muster-test: Killed process 4242 (python) total-vm:1kB\n")
        except OSError:
            pytest.skip("the kernel log cannot be written here (needs root) to test it")
        texts = log.read_new()
        assert kernel_oom_lines(texts, {4242}) == [
            "kernel: muster-test: Killed process 4242 (python) total-vm:1kB"
        ]
    finally:
        log.close()
