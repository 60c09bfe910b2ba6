"""The Python stacks of this agent's ranks, read with py-spy without stopping the job.

``muster stacks JOB`` asks the controller, which asks each agent that runs a member of the job
(wire kind STACKS); the agent finds its ranks among torchrun's children (the topmost process
whose environment holds RANK: a rank's dataloader workers inherit it) and runs ``py-spy dump``
on each, at most STACKS_AT_ONCE at a time, each bounded by the request's timeout. py-spy comes
with the ``stacks`` extra (``pip install 'muster[stacks]'``); without it every rank answers
with the fix. It reads another process's memory, so it needs ptrace rights over the ranks:
the agent's own user (with kernel.yama.ptrace_scope 0 or 1 for a parent: py-spy runs as a
child of the agent, not of the rank, so scope 1 wants CAP_SYS_PTRACE), or root.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
from pathlib import Path

import psutil

STACKS_AT_ONCE = 8
PYSPY_HINT = "py-spy is not installed next to the agent: pip install 'muster[stacks]'"


def py_spy() -> str | None:
    """The py-spy next to the agent's Python, else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def rank_processes(torchrun_pid: int) -> dict[int, int]:
    """{global rank: pid} of the ranks under torchrun (the topmost process with RANK)."""
    found: dict[int, int] = {}
    try:
        children = psutil.Process(torchrun_pid).children(recursive=True)
    except psutil.Error:
        return found
    for child in children:
        try:
            rank = child.environ().get("RANK")
            parent = child.parent()
            parent_rank = parent.environ().get("RANK") if parent is not None else None
        except psutil.Error:
            continue
        if rank is not None and rank.isdigit() and parent_rank != rank:
            found.setdefault(int(rank), child.pid)
    return found


async def dump(pid: int, native: bool, timeout: float) -> str:
    """One process's stacks as py-spy prints them, or a line saying why there are none."""
    binary = py_spy()
    if binary is None:
        return f"error: {PYSPY_HINT}"
    argv = [binary, "dump", "--pid", str(pid), *(["--native"] if native else [])]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return f"error: py-spy did not answer within {timeout:.0f}s"
    text = out.decode(errors="replace").strip()
    if proc.returncode != 0:
        return f"error: py-spy failed ({proc.returncode}): {text[-500:]}"
    return text


async def dump_ranks(
    torchrun_pid: int, ranks: list[int] | None, native: bool, timeout: float
) -> dict[int, str]:
    """{rank: stacks} for this member's ranks (only ``ranks`` when given)."""
    pids = await asyncio.to_thread(rank_processes, torchrun_pid)
    if ranks is not None:
        pids = {r: p for r, p in pids.items() if r in ranks}
    gate = asyncio.Semaphore(STACKS_AT_ONCE)

    async def one(pid: int) -> str:
        async with gate:
            return await dump(pid, native, timeout)

    texts = await asyncio.gather(*(one(pid) for pid in pids.values()))
    return dict(zip(pids, texts, strict=True))
