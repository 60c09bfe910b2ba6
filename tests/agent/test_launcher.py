"""The launcher against real torchrun: a STOP during the spawn is not lost, and a stopped
member's exit status is its own (not 255 from a reaper that reaped it first)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from muster.agent.launcher import MemberRun
from muster.spec import parse_job
from muster.wire import Kind

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def assignment() -> dict[str, Any]:
    spec = parse_job(
        {
            "name": "sleepy",
            "entrypoint": "-m tests.agent.sleeper",
            "distributed": {"num_workers": 1, "procs_per_worker": 1, "backend": "gloo"},
        }
    )
    return {
        "job": "sleepy-1",
        "epoch": 1,
        "node_rank": 0,
        "spec": spec.model_dump(mode="json"),
        "path": "private",
        "addresses": ["127.0.0.1"],
        "interfaces": ["lo"],
        "master_port": 0,
        "bundle": None,
    }


def tree_of(run_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cwd"]):
        try:
            if (proc.info["cwd"] or "").startswith(str(run_dir)):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.parametrize("when", ["during the spawn", "after the start"])
def test_a_stop_always_ends_the_member(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    sent: list[tuple[Kind, dict[str, Any]]] = []

    async def send(kind: Kind, body: dict[str, Any]) -> None:
        sent.append((kind, body))

    async def main() -> None:
        member: MemberRun

        async def spawn_then_stop(*argv: str, **kwargs: Any) -> asyncio.subprocess.Process:
            proc = await asyncio.create_subprocess_exec(*argv, **kwargs)
            if when == "during the spawn":
                # The STOP lands while the spawn is under way: no process existed for
                # stop() to end, and the member must still not outlive it.
                await member.stop("cancelled by the user")
            return proc

        async with httpx.AsyncClient() as http:
            member = MemberRun(
                assignment(),
                work_dir=tmp_path,
                python=sys.executable,
                http=http,
                send=send,
                emit=lambda _lines: None,
                grace=20.0,  # torchrun's own SIGTERM handling, not the SIGKILL fallback
                spawn=spawn_then_stop,
            )
            task = asyncio.create_task(member.run())
            if when == "after the start":
                for _ in range(600):
                    if (
                        any(k is Kind.MEMBER_STARTED for k, _ in sent)
                        and len(tree_of(tmp_path)) >= 2
                    ):
                        break
                    await asyncio.sleep(0.1)
                await member.stop("cancelled by the user")
            await asyncio.wait_for(task, 60)

    asyncio.run(main())
    exits = [body for kind, body in sent if kind is Kind.MEMBER_EXITED]
    assert len(exits) == 1
    # Its own status: torchrun ended by SIGTERM, never 255 ("unknown child").
    assert exits[0]["exit_code"] != 255
    assert exits[0]["exit_code"] != 0
    assert exits[0]["signal"] == "SIGTERM"
    assert tree_of(tmp_path) == []
