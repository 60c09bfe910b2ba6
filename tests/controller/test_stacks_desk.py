"""`muster stacks` on a job that just ended is refused with the job's state, even while its
members are still being stopped and before the store has the end on record (CI saw an
empty answer there, once the command line started fast enough to ask in that moment)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from muster.controller.auth import Tickets
from muster.controller.gangs import Controller
from muster.controller.metrics import Metrics
from muster.controller.runs import RunEntry
from muster.errors import BadRequest
from muster.gang import Cancel, GangRun, MemberStarted, Placed, PortPublished
from muster.spec import JobSpec, JobState, PathClass
from muster.wire import Kind
from tests.controller.helpers import store_with_workers
from tests.fakes.link import FakeLink


def test_a_cancelled_run_has_no_running_ranks_before_the_store_says_so(tmp_path: Path) -> None:
    store = store_with_workers(tmp_path, ("w0",))
    job = store.submit_job(
        {
            "name": "stacks",
            "entrypoint": "t.py",
            "distributed": {"num_workers": 1, "procs_per_worker": 1, "backend": "gloo"},
        }
    ).id
    store.reserve_placement(job, ["w0"], "private")

    async def scenario() -> None:
        controller = Controller(store, Metrics(), 15.0, Tickets())
        link = FakeLink("w0")
        controller.links["w0"] = link  # type: ignore[assignment]
        spec = JobSpec.model_validate(store.job(job).spec, strict=False)
        entry = RunEntry(GangRun(), spec, [store.workers()[0].inventory], None)
        controller.runs[job] = entry
        writer = asyncio.create_task(controller.writer.run())
        await controller._step(entry, Placed(job, 1, ("w0",), PathClass.PRIVATE))
        await controller._step(entry, PortPublished(0, "127.0.0.1", 29500))
        await controller._step(entry, MemberStarted(0))
        assert entry.gang.job_state is JobState.RUNNING

        asked = await controller.stacks.collect(job, None, False, budget=0.2)
        assert asked["missing"] == [0], "a running rank is asked (and this fake never answers)"
        assert any(kind is Kind.STACKS for kind, _ in link.sent)

        await controller.writer.barrier()
        assert store.job(job).state == "running"
        writer.cancel()  # the store lags from here on
        await asyncio.gather(writer, return_exceptions=True)
        await controller._step(entry, Cancel("by the user"))
        assert store.job(job).state == "running"
        with pytest.raises(BadRequest, match=r"has no running ranks \(it is cancelled\)"):
            await controller.stacks.collect(job, None, False, budget=0.2)

    asyncio.run(scenario())
