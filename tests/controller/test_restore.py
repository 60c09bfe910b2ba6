"""After a restart the controller rebuilds runs from the store: deadlines in UTC."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from muster.controller.auth import Tickets
from muster.controller.gangs import Controller
from muster.controller.metrics import Metrics
from muster.spec import JobState, MemberState, NetworkCaps, WorkerInventory
from muster.store import Store, open_store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    st = open_store(str(tmp_path / "muster.db"))
    yield st
    st.db.dispose()


@pytest.fixture
def far_from_utc() -> Iterator[None]:
    """Run in a zone 9 hours from UTC: SQLite's naive datetimes must still be read as UTC."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Tokyo"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def test_a_restored_runs_timeout_counts_from_its_placement(
    store: Store, far_from_utc: None
) -> None:
    for wid in ("w0", "w1"):
        store.upsert_worker(
            WorkerInventory(
                id=wid,
                hostname=wid,
                advertise_address="127.0.0.1",
                torch_version="2.13.0",
                torchrun=True,
                backends=["gloo"],
                network=NetworkCaps(private_network_id="n", private_address="127.0.0.1"),
            )
        )
    spec = {
        "name": "timed",
        "entrypoint": "t.py",
        "timeout": 3600,
        "distributed": {"num_workers": 2, "procs_per_worker": 1, "backend": "gloo"},
    }
    job = store.submit_job(spec)
    store.reserve_placement(job.id, ["w0", "w1"], "private")
    store.set_job_state(job.id, JobState.RENDEZVOUS)
    placed_at = time.time()

    async def restore() -> float | None:
        controller = Controller(store, Metrics(), 15.0, Tickets())
        writer = asyncio.create_task(controller.writer.run())
        await controller.restore_runs()
        await controller.writer.drain()
        writer.cancel()
        return controller.runs[job.id].gang.deadline

    deadline = asyncio.run(restore())
    assert deadline is not None
    assert abs(deadline - (placed_at + 3600)) < 60, deadline - placed_at
    assert [m.state for m in store.members(job.id)] == [MemberState.PENDING.value] * 2
