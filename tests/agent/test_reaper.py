"""The member's watchdog (muster.agent.reaper): the tree it finds, and what it ends."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from muster.agent import reaper

# A process that starts a child from its main thread and another from a second thread (a
# task's children file lists only what that thread started); the first child starts a
# grandchild. Each writes its pid to OUT, then all sleep.
TREE = """
import os, subprocess, sys, threading, time
out = sys.argv[1]
sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
middle = [sys.executable, "-c",
          "import subprocess, sys, time; p = subprocess.Popen(sys.argv[1:]); "
          "print(p.pid, flush=True); time.sleep(120)", *sleeper]
a = subprocess.Popen(middle, stdout=subprocess.PIPE, text=True)
grandchild = int(a.stdout.readline())
b = []
t = threading.Thread(target=lambda: b.append(subprocess.Popen(sleeper)))
t.start(); t.join()
with open(out + ".tmp", "w") as fh:
    fh.write(f"{a.pid} {grandchild} {b[0].pid}")
os.rename(out + ".tmp", out)
time.sleep(120)
"""


def start_tree(tmp_path: Path) -> tuple[subprocess.Popen[bytes], set[int]]:
    out = tmp_path / "pids"
    root = subprocess.Popen([sys.executable, "-c", TREE, str(out)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not out.exists():
        assert time.monotonic() < deadline, "the tree did not start in 30 s"
        time.sleep(0.05)
    return root, {int(p) for p in out.read_text().split()}


def kill_tree(root: subprocess.Popen[bytes], pids: set[int]) -> None:
    for pid in [root.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    root.wait()


@pytest.mark.skipif(not reaper._children_files(), reason="this kernel has no /proc children files")
def test_descendants_reads_the_whole_tree_and_nothing_else(tmp_path: Path) -> None:
    root, pids = start_tree(tmp_path)
    try:
        found = reaper.descendants(root.pid)
        assert set(found) == pids  # the thread's child and the grandchild too
        assert set(found) == {c.pid for c in psutil.Process(root.pid).children(recursive=True)}
        assert reaper.descendants(2**22 + 1) == []  # no such process: nothing, no error
    finally:
        kill_tree(root, pids)


def test_a_gone_agent_ends_every_process_the_member_ever_had(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog remembers the tree: a grandchild whose parent died (and so left the tree)
    is still ended when the agent goes."""
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    root, pids = start_tree(tmp_path)
    seen: set[int] = set()
    walk = reaper.descendants

    def watched(pid: int) -> list[int]:
        found = walk(pid)
        seen.update(found)
        return found

    monkeypatch.setattr(reaper, "descendants", watched)
    watchdog = threading.Thread(target=reaper.watch, args=(agent.pid, root.pid, 2.0, "", 0.0, 0.05))
    watchdog.start()
    try:
        deadline = time.monotonic() + 30
        while not pids <= seen:  # the whole tree is known
            assert time.monotonic() < deadline, (pids, seen)
            time.sleep(0.05)
        middle = next(p for p in pids if psutil.Process(p).children())
        orphan = next(p for p in pids if psutil.Process(p).ppid() == middle)
        os.kill(middle, 9)  # the grandchild is reparented away from the member
        time.sleep(0.2)
        assert orphan not in walk(root.pid)
        agent.kill()
        agent.wait()
        watchdog.join(20)
        assert not watchdog.is_alive()
        alive = [p for p in [root.pid, *pids] if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]  # fmt: skip
        assert alive == []
    finally:
        agent.kill()
        kill_tree(root, pids)
        watchdog.join(20)
