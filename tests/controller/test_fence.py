"""A fenced epoch at the controller's seam: the kept-apart pairs outlive the fence's own
commit, and a late answer of the fenced epoch never frees a worker the next epoch holds."""

from __future__ import annotations

import asyncio
from pathlib import Path

from muster.controller.auth import Tickets
from muster.controller.gangs import Controller
from muster.controller.metrics import Metrics
from muster.spec import PathClass
from muster.store import Store
from muster.wire import Kind
from tests.controller.helpers import store_with_workers
from tests.fakes.link import FakeLink

WORKERS = ("w0", "w1", "w2")


def _store(tmp_path: Path) -> Store:
    return store_with_workers(tmp_path, WORKERS)


def _states(store: Store) -> dict[str, str]:
    return {v.inventory.id: v.state.value for v in store.workers()}


def test_a_fence_keeps_its_pairs_apart_and_a_late_answer_frees_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    job = store.submit_job(
        {
            "name": "fence",
            "entrypoint": "t.py",
            "distributed": {"num_workers": 2, "procs_per_worker": 1, "backend": "gloo"},
        }
    )

    async def scenario() -> tuple[list[str], dict[str, str], dict[str, str]]:
        controller = Controller(store, Metrics(), 15.0, Tickets())
        links = {w: FakeLink(w) for w in WORKERS}
        controller.links.update(links)  # type: ignore[arg-type]
        writer = asyncio.create_task(controller.writer.run())
        await controller.scheduler_pass()  # epoch 1: w0 and w1, direct
        await controller.writer.drain()
        entry = controller.runs[job.id]
        assert entry.gang.workers == ("w0", "w1")
        assert entry.gang.path is PathClass.DIRECT
        writer.cancel()
        # w1 cannot make its device: the epoch is fenced, w1 kept apart from w0. A pass
        # runs before the fence's writes are committed (the job is not queued yet).
        failed = {"job": job.id, "epoch": 1, "node_rank": 1, "error": "no CAP_NET_ADMIN"}
        async with controller.lock:
            await controller._member_frame(links["w1"], Kind.NET_READY, failed)  # type: ignore[arg-type]
        await controller.scheduler_pass()
        assert controller._apart[job.id] == {PathClass.DIRECT: {frozenset({"w0", "w1"})}}
        writer = asyncio.create_task(controller.writer.run())
        await controller.writer.drain()
        await controller.scheduler_pass()  # epoch 2, without the pair
        await controller.writer.drain()
        second = controller.runs[job.id]
        before = _states(store)
        # w0's agent answers epoch 1's STOP late: nothing of that epoch ran there.
        absent = {
            "job": job.id,
            "epoch": 1,
            "node_rank": 0,
            "exit_code": 143,
            "signal": "SIGTERM",
            "absent": True,
        }
        async with controller.lock:
            written = await controller._member_frame(links["w0"], Kind.MEMBER_EXITED, absent)  # type: ignore[arg-type]
        await written
        await controller.writer.drain()
        writer.cancel()
        return list(second.gang.workers), before, _states(store)

    workers, before, after = asyncio.run(scenario())
    fenced = [e for e in store.events(job.id) if e.kind == "EpochFenced"]
    store.db.dispose()
    assert workers == ["w0", "w2"]
    assert before["w0"] == "reserved"
    assert after["w0"] == "reserved"  # still the next epoch's
    assert fenced[0].data["apart"] == [["w0", "w1"]]
