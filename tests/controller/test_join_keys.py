"""An epoch's join keys: single use, 15 minutes, refused by name otherwise."""

from __future__ import annotations

import asyncio
from pathlib import Path

from muster.controller.auth import Tickets
from muster.controller.gangs import Controller
from muster.controller.metrics import Metrics
from muster.controller.runs import JOIN_KEY_TTL_S, JoinKeys, RunEntry
from muster.gang import GangRun, Placed
from muster.spec import JobSpec, PathClass
from muster.wire import Kind
from tests.controller.helpers import store_with_workers
from tests.fakes.link import FakeLink


def test_a_key_joins_once_within_its_time_and_is_refused_by_name_after() -> None:
    keys = JoinKeys(epoch=2)
    key = keys.issue(1, now=1000.0)
    other = keys.issue(0, now=1000.0)
    assert key != other
    assert keys.redeem(1, key, now=1000.0 + JOIN_KEY_TTL_S - 1) is None
    assert keys.redeem(1, key, now=1001.0) == (
        "node1 presented its epoch 2 join key again (single use)"
    )
    assert keys.redeem(1, other, now=1001.0) == (
        "node1 presented a join key that is not its key for epoch 2"
    )
    assert keys.redeem(1, None, now=1001.0) == (
        "node1 presented a join key that is not its key for epoch 2"
    )
    assert keys.redeem(3, key, now=1001.0) == "no join key was issued to node3 in epoch 2"
    refused = keys.redeem(0, other, now=1000.0 + JOIN_KEY_TTL_S + 1)
    assert refused is not None
    assert refused.startswith("node0 presented an expired join key (epoch 2; expired ")
    assert refused.endswith("15 min after it was issued)")
    # An expired key stays unused: it is refused again, not taken.
    assert keys.redeem(0, other, now=1000.0 + JOIN_KEY_TTL_S + 2) is not None


def test_a_key_issued_again_replaces_the_old_one() -> None:
    keys = JoinKeys(epoch=1)
    old = keys.issue(0, now=0.0)
    new = keys.issue(0, now=10.0)
    assert keys.redeem(0, old, now=11.0) is not None
    assert keys.redeem(0, new, now=11.0) is None


def test_a_reused_or_forged_join_key_is_refused_by_name_and_changes_nothing(
    tmp_path: Path,
) -> None:
    store = store_with_workers(tmp_path, ("w0", "w1"))
    job = store.submit_job(
        {
            "name": "keys",
            "entrypoint": "t.py",
            "distributed": {"num_workers": 2, "procs_per_worker": 1, "backend": "gloo"},
        }
    )
    store.reserve_placement(job.id, ["w0", "w1"], "direct")

    async def scenario() -> tuple[RunEntry, list[str], dict[str, FakeLink]]:
        controller = Controller(store, Metrics(), 15.0, Tickets())
        writer = asyncio.create_task(controller.writer.run())
        links = {w: FakeLink(w) for w in ("w0", "w1")}
        controller.links.update(links)  # type: ignore[arg-type]
        spec = JobSpec.model_validate(store.job(job.id).spec, strict=False)
        views = {v.inventory.id: v.inventory for v in store.workers()}
        inventories = [views["w0"], views["w1"]]
        entry = RunEntry(GangRun(), spec, inventories, None)
        controller.runs[job.id] = entry
        await controller._step(entry, Placed(job.id, 1, ("w0", "w1"), PathClass.DIRECT))
        keys = {
            link.worker_id: body["join_key"]
            for link in links.values()
            for kind, body in link.sent
            if kind is Kind.NET_SETUP
        }
        assert len(set(keys.values())) == 2  # one fresh key per member
        ready = {"job": job.id, "epoch": 1, "public_key": "A" * 43 + "=", "port": 51820}
        w0, w1 = links["w0"], links["w1"]
        frames = [
            (w0, {**ready, "node_rank": 0, "join_key": keys["w0"]}),  # joins
            (w0, {**ready, "node_rank": 0, "join_key": keys["w0"]}),  # reused
            (w1, {**ready, "node_rank": 1, "join_key": keys["w0"]}),  # another's key
            (w1, {**ready, "node_rank": 1}),  # none
        ]
        for link, body in frames:
            await controller._member_frame(link, Kind.NET_READY, body)  # type: ignore[arg-type]
        await controller.writer.drain()
        writer.cancel()
        refused = [e.message for e in store.events(job.id) if e.kind == "JoinRefused"]
        return entry, refused, links

    entry, refused, links = asyncio.run(scenario())
    store.db.dispose()
    assert refused == [
        "node0 presented its epoch 1 join key again (single use) (worker w0); "
        "its NET_READY was refused",
        "node1 presented a join key that is not its key for epoch 1 (worker w1); "
        "its NET_READY was refused",
        "node1 presented a join key that is not its key for epoch 1 (worker w1); "
        "its NET_READY was refused",
    ]
    # node 0 joined; node 1 did not, so no peers went out and the epoch still waits.
    assert entry.gang.members[0].net_key is not None
    assert entry.gang.members[1].net_key is None
    assert not [k for link in links.values() for k, _b in link.sent if k is Kind.NET_PEERS]
