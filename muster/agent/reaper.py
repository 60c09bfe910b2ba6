"""A watchdog per member: if the agent dies (even by SIGKILL), end the member's processes.

PR_SET_PDEATHSIG already sends torchrun SIGTERM when the agent dies, but torchrun can then
wait minutes on a rendezvous store that is gone. The reaper runs in its own session,
remembers the member's whole process tree while it runs, and when the agent is gone it
sends SIGTERM to all of it, then SIGKILL after the grace period. It exits when the member
does.

    python -m muster.agent.reaper AGENT_PID MEMBER_PID GRACE_SECONDS
"""

from __future__ import annotations

import contextlib
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


def watch(agent_pid: int, member_pid: int, grace: float, poll: float = 0.5) -> None:
    try:
        agent = psutil.Process(agent_pid)
        member = psutil.Process(member_pid)
    except psutil.NoSuchProcess:
        return
    family: dict[int, psutil.Process] = {member.pid: member}
    while member.is_running():
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in member.children(recursive=True):
                family.setdefault(child.pid, child)
        if not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE:
            terminate([p for p in family.values() if p.is_running()], grace)
            return
        time.sleep(poll)


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
