"""The direct path's MTU as the controller offers it: the gang's size, then 1280 once a pair
above it stalled, also after a restart; an agent's report is believed only within the offer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from muster.controller.auth import Tickets
from muster.controller.gangs import Controller
from muster.controller.metrics import Metrics
from muster.controller.runs import RunEntry
from muster.gang import GangRun, Placed
from muster.spec import JobSpec, JobState, PathClass
from muster.store import Store
from muster.wire import Kind
from tests.controller.helpers import store_with_workers
from tests.fakes.link import FakeLink

WORKERS = ("w0", "w1")


def a_region(tmp_path: Path) -> tuple[Store, str]:
    """Two workers that declared one provider region (their gangs are offered 1420), and a
    2-node job reserved on them."""
    store = store_with_workers(tmp_path, WORKERS, provider="aws", region="us-east-1")
    job = store.submit_job(
        {
            "name": "mtu",
            "entrypoint": "t.py",
            "distributed": {"num_workers": 2, "procs_per_worker": 1, "backend": "gloo"},
        }
    )
    store.reserve_placement(job.id, list(WORKERS), "direct")
    return store, job.id


async def placed(
    controller: Controller, store: Store, job: str, epoch: int
) -> tuple[RunEntry, dict[str, FakeLink]]:
    links = {w: FakeLink(w) for w in WORKERS}
    controller.links.update(links)  # type: ignore[arg-type]
    spec = JobSpec.model_validate(store.job(job).spec, strict=False)
    views = {v.inventory.id: v.inventory for v in store.workers()}
    entry = RunEntry(GangRun(), spec, [views[w] for w in WORKERS], None)
    controller.runs[job] = entry
    await controller._step(entry, Placed(job, epoch, WORKERS, PathClass.DIRECT, probe_seconds=1.0))
    return entry, links


def offered(links: dict[str, FakeLink]) -> list[Any]:
    return [body["mtu"] for link in links.values() for k, body in link.sent if k is Kind.NET_SETUP]


def test_a_stalled_pair_makes_the_jobs_next_gangs_offer_1280_also_after_a_restart(
    tmp_path: Path,
) -> None:
    store, job = a_region(tmp_path)

    async def first_epochs() -> list[Any]:
        controller = Controller(store, Metrics(), 15.0, Tickets())
        writer = asyncio.create_task(controller.writer.run())
        entry, links = await placed(controller, store, job, 1)
        assert offered(links) == [1420, 1420]
        keys = {w: b["join_key"] for w, link in links.items() for k, b in link.sent
                if k is Kind.NET_SETUP}  # fmt: skip
        ids = {"job": job, "epoch": 1}
        key = {"public_key": "A" * 43 + "=", "port": 51820}
        # w0 claims a device larger than it was offered: not believed (no MTU at all)
        for n, (wid, mtu) in enumerate((("w0", 9000), ("w1", 1420))):
            body = {**ids, **key, "node_rank": n, "join_key": keys[wid], "mtu": mtu}
            await controller._member_frame(links[wid], Kind.NET_READY, body)  # type: ignore[arg-type]
        assert [m.mtu for m in entry.gang.members] == [None, 1420]
        for n, wid in enumerate(WORKERS):
            await controller._member_frame(links[wid], Kind.NET_UP, {**ids, "node_rank": n})  # type: ignore[arg-type]
        for n, wid in enumerate(WORKERS):
            ready = {**ids, "node_rank": n, "port": 40000 + n}
            await controller._member_frame(links[wid], Kind.PROBE_READY, ready)  # type: ignore[arg-type]
        stalled = {"node": 1, "connects": 3, "error": "measuring: TimeoutError('16 KiB ...')"}
        done = {**ids, "node_rank": 0, "pairs": [stalled], "device": "muster0"}
        await controller._member_frame(links["w0"], Kind.PROBE_DONE, done)  # type: ignore[arg-type]
        await controller.writer.drain()
        assert entry.gang.fenced
        fenced = next(e for e in store.events(job) if e.kind == "EpochFenced")
        assert fenced.data["mtu"] == 1280, fenced.data
        assert fenced.data["apart"] == []  # (not kept apart: tried again, smaller)
        assert store.job(job).state == JobState.QUEUED
        store.reserve_placement(job, list(WORKERS), "direct")
        _entry, links = await placed(controller, store, job, 2)
        await controller.writer.drain()
        writer.cancel()
        return offered(links)

    assert asyncio.run(first_epochs()) == [1280, 1280]

    async def restarted() -> dict[str, int]:
        controller = Controller(store, Metrics(), 15.0, Tickets())
        writer = asyncio.create_task(controller.writer.run())
        await controller.restore_runs()  # what a restarted controller places by
        await controller.writer.drain()
        writer.cancel()
        return controller._packets

    assert asyncio.run(restarted()) == {job: 1280}
    # The restart fenced epoch 2 (mid-network). Epoch 3, the last counted one, is caught
    # mid-network by another restart: it is rebuilt with the spare epoch its placement
    # had, and placed again rather than failed.
    assert store.job(job).state == JobState.QUEUED
    store.reserve_placement(job, list(WORKERS), "direct")
    store.set_job_state(job, JobState.NETWORKING, "epoch 3: by the test")
    packets = asyncio.run(restarted())
    assert store.job(job).state == JobState.QUEUED, store.job(job).root_cause
    fences = [e.data["epoch"] for e in store.events(job) if e.kind == "EpochFenced"]
    assert fences == [1, 2, 3]
    assert packets == {job: 1280}
    store.set_job_state(job, JobState.CANCELLED, "by the test")
    assert asyncio.run(restarted()) == {}  # (a job over asks nothing of its next gangs)
    store.db.dispose()


def test_a_job_whose_epoch_was_fenced_for_its_packets_gets_that_epoch_back(
    tmp_path: Path,
) -> None:
    """The MTU fence is the path's doing, not the job's: a job with one is placed with a
    spare network epoch, so a later failure still gets MAX_NETWORK_EPOCHS of its own."""
    store, job = a_region(tmp_path)

    async def spare(packets: dict[str, int]) -> int:
        controller = Controller(store, Metrics(), 15.0, Tickets())
        controller.links.update({w: FakeLink(w) for w in WORKERS})  # type: ignore[arg-type]
        controller._packets.update(packets)
        writer = asyncio.create_task(controller.writer.run())
        try:
            await controller.scheduler_pass()
            await controller.writer.drain()
            return controller.runs[job].gang.spare_epochs
        finally:
            writer.cancel()

    def queued_again() -> None:
        for w in WORKERS:
            store.release_worker(w, job)
        store.set_job_state(job, JobState.QUEUED, "placed again by the test")

    queued_again()
    assert asyncio.run(spare({})) == 0
    queued_again()
    assert asyncio.run(spare({job: 1280})) == 1
    store.db.dispose()
