"""A watchdog per member: if the agent dies or hangs, end the member's processes.

PR_SET_PDEATHSIG already sends torchrun SIGTERM when the agent dies, but torchrun can then
wait minutes on a rendezvous store that is gone. The reaper runs in its own session,
remembers the member's whole process tree while it runs, and when the agent is gone, or
alive but silent (it touches ALIVE_FILE every second; a stopped or wedged agent does not)
for TIMEOUT seconds, it sends SIGTERM to all of it, then SIGKILL after the grace period.
The controller fails the job of a silent agent after its heartbeat timeout, so with
TIMEOUT near that, no process of a job reported failed outlives it by much. The reaper
exits when the member does.

    python -m muster.agent.reaper AGENT_PID MEMBER_PID GRACE_SECONDS [ALIVE_FILE TIMEOUT]
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import psutil


def terminate(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM every process; SIGKILL those still alive after ``grace`` seconds."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGTERM)
    _gone, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace)


def _children_files() -> bool:
    """Whether this kernel lists a task's children in /proc (CONFIG_PROC_CHILDREN)."""
    me = os.getpid()
    return os.path.exists(f"/proc/{me}/task/{me}/children")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, read from its tasks' ``children`` files: a walk of the
    tree alone. (psutil's ``children(recursive=True)`` reads every process on the host to
    build a parent map: on a busy host that is most of what a watchdog costs.)"""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue  # gone since its parent listed it
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as fh:
                    kids = [int(k) for k in fh.read().split()]
            except OSError:
                continue  # the thread ended meanwhile
            found += kids
            todo += kids
    return found


def _silent_for(alive_file: str) -> float:
    try:
        return time.time() - os.stat(alive_file).st_mtime
    except OSError:
        return 0.0  # no file to judge by: only the agent's death counts


def _agent_gone(agent: psutil.Process) -> bool:
    try:
        return not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def watch(
    agent_pid: int,
    member_pid: int,
    grace: float,
    alive_file: str = "",
    timeout: float = 0.0,
    poll: float = 0.5,
) -> None:
    try:
        agent = psutil.Process(agent_pid)
        member = psutil.Process(member_pid)
    except psutil.NoSuchProcess:
        return
    family: dict[int, psutil.Process] = {member.pid: member}
    by_tree = _children_files()
    while member.is_running() and member.status() != psutil.STATUS_ZOMBIE:
        if by_tree:
            for pid in descendants(member.pid):
                known = family.get(pid)
                if known is None or not known.is_running():  # new, or a reused pid
                    with contextlib.suppress(psutil.NoSuchProcess):
                        found = psutil.Process(pid)
                        # A parent is listed before its children. A pid that ended and was
                        # taken by another process since its children file was read has a
                        # parent outside the tree: not the member's.
                        if found.ppid() in family:
                            family[pid] = found
        else:
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in member.children(recursive=True):
                    family.setdefault(child.pid, child)
        hung = bool(alive_file) and timeout > 0 and _silent_for(alive_file) > timeout
        if _agent_gone(agent) or hung:
            terminate([p for p in family.values() if p.is_running()], grace)
            return
        time.sleep(poll)


if __name__ == "__main__":
    args = sys.argv[1:]
    watch(
        int(args[0]),
        int(args[1]),
        float(args[2]),
        args[3] if len(args) > 3 else "",
        float(args[4]) if len(args) > 4 else 0.0,
    )
