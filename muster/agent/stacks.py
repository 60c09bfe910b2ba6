"""The Python stacks of this agent's ranks, read with py-spy without stopping the job.

``muster stacks JOB`` asks the controller, which asks each agent that runs a member of the job
(wire kind STACKS); the agent finds its ranks among torchrun's children (the topmost process
whose environment holds RANK: a rank's dataloader workers inherit it) and runs ``py-spy dump``
on each, at most STACKS_AT_ONCE at a time, each bounded by the request's timeout. py-spy comes
with the ``stacks`` extra (``pip install 'muster[stacks]'``); without it every rank answers
with the fix. It reads another process's memory, so it needs ptrace rights over the ranks:
the agent's own user (with kernel.yama.ptrace_scope 0 or 1 for a parent: py-spy runs as a
child of the agent, not of the rank, so scope 1 wants CAP_SYS_PTRACE), or root.

Where the job turns torch's flight recorder on, a rank that serves it (muster.train.flight)
answers on ``rank<N>.sock`` in the member's diagnosis directory, and each rank's answer also
says the collective it is parked in (muster.plan.stacks.parked).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

from muster.plan.stacks import parked

STACKS_AT_ONCE = 8  # py-spy processes at once on this agent, whatever the requests
RANK_TEXT_MAX = 64 * 1024  # of one rank's dump (the head: each thread's innermost frames first)
ANSWER_MAX = 2 * 1024 * 1024  # of one STACKS_DONE's texts together: well under any frame cap
FLIGHT_MAX = 16 * 1024 * 1024  # of one rank's flight recorder dump (2,000 entries are ~1.5 MB)
PYSPY_HINT = "py-spy is not installed next to the agent: pip install 'muster[stacks]'"


def py_spy() -> str | None:
    """The py-spy next to the agent's Python, else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


_gate: asyncio.Semaphore | None = None
_dumping: dict[tuple[int, float], asyncio.Future[str]] = {}  # one dump of a process at a time


def rank_processes(torchrun_pid: int) -> dict[int, tuple[int, float]]:
    """{global rank: (pid, start time)} of the ranks under torchrun (the topmost process with
    RANK; a rank's dataloader workers inherit it)."""
    found: dict[int, tuple[int, float]] = {}
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
            with contextlib.suppress(psutil.Error):
                found.setdefault(int(rank), (child.pid, child.create_time()))
    return found


def _same_process(pid: int, started: float) -> bool:
    """The pid is still the rank it was (not a new process given its number)."""
    try:
        return psutil.Process(pid).create_time() == started
    except psutil.Error:
        return False


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
    """{rank: stacks} for this member's ranks (only ``ranks`` when given): at most
    STACKS_AT_ONCE py-spy at once on this agent, one dump of a process at a time (a second
    request shares it: two py-spy cannot pause one process together), each text capped."""
    global _gate
    if _gate is None:
        _gate = asyncio.Semaphore(STACKS_AT_ONCE)
    gate = _gate
    found = await asyncio.to_thread(rank_processes, torchrun_pid)
    if ranks is not None:
        found = {r: p for r, p in found.items() if r in ranks}

    async def run(pid: int, started: float) -> str:
        async with gate:
            if not await asyncio.to_thread(_same_process, pid, started):
                return "error: the rank ended before its stack was read"
            return await dump(pid, native, timeout)

    async def one(pid: int, started: float) -> str:
        key = (pid, started)
        shared = _dumping.get(key)
        if shared is None:
            shared = asyncio.ensure_future(run(pid, started))
            _dumping[key] = shared
            shared.add_done_callback(lambda _f: _dumping.pop(key, None))
        return await asyncio.shield(shared)

    texts = await asyncio.gather(*(one(pid, started) for pid, started in found.values()))
    answer: dict[int, str] = {}
    room = ANSWER_MAX
    for rank, text in zip(found, texts, strict=True):
        if len(text) > RANK_TEXT_MAX:
            text = text[:RANK_TEXT_MAX] + "\n... (cut)"
        if len(text) > room:
            text = "error: the answer is full (ask for this rank with --rank)"
        room -= len(text)
        answer[rank] = text
    return answer


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def flight_dump(path: str, timeout: float) -> dict[str, Any] | None:
    """A rank's flight recorder as torch's worker server gives it, or None (not served, not
    answering in ``timeout``, or not what torch sends)."""
    conn = _UnixHTTP(path, timeout)
    try:
        conn.request("POST", "/handler/fr_trace_json", body=b"")
        response = conn.getresponse()
        body = response.read(FLIGHT_MAX + 1)
        if response.status != 200 or len(body) > FLIGHT_MAX:
            return None
        dump = json.loads(body)
        return dump if isinstance(dump, dict) else None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


async def flight_ranks(
    directory: str | None, ranks: Iterable[int], timeout: float
) -> dict[int, dict[str, Any]]:
    """{rank: where it is parked} for the ranks that serve their flight recorder."""
    if directory is None:
        return {}

    async def one(rank: int) -> dict[str, Any] | None:
        path = os.path.join(directory, f"rank{rank}.sock")
        if not os.path.exists(path):
            return None
        dump = await asyncio.to_thread(flight_dump, path, timeout)
        try:
            return parked(dump, time.time_ns()) if dump is not None else None
        except (TypeError, ValueError, KeyError, AttributeError):
            return None  # not the shape torch writes: that rank says nothing of it

    wanted = sorted(ranks)
    found = await asyncio.gather(*(one(r) for r in wanted))
    return {r: where for r, where in zip(wanted, found, strict=True) if where is not None}
