"""The controller's side of a join window, at the seam: the rules a job's spec gives its
window, the door, and the why-pending line (the end-to-end test is tests/e2e/test_window.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from muster.controller.windows import WindowDesk
from muster.errors import BadRequest
from muster.membership.cohort import door, hello_of, open_entry, summary, window_rules
from muster.membership.window import Join, step
from muster.spec import JobState, NetworkCaps, PathClass, WorkerInventory, WorkerView, parse_job
from muster.spec.worker import WalkIn
from muster.wire import Kind


def spec(**window: Any) -> Any:
    return parse_job(
        {
            "name": "walk",
            "entrypoint": "train.py",
            "distributed": {
                "num_workers": 3,
                "procs_per_worker": 2,
                "backend": "gloo",
                "membership": "window",
                "window": window,
            },
        }
    )


def walk_in(host: str, ranks: int = 2, torch: str = "2.13.0") -> WorkerInventory:
    return WorkerInventory(
        id=f"walkin-{host}",
        hostname=host,
        torch_version=torch,
        torchrun=True,
        join=WalkIn(job="walk-1", host=host, ranks=ranks),
    )


def test_quorum_and_target_default_to_the_jobs_size_and_manual_has_no_target() -> None:
    auto = window_rules(spec())
    assert (auto.start, auto.quorum, auto.target) == ("auto", 6, 6)
    assert (auto.join_timeout, auto.max_join_timeout) == (300.0, 900.0)
    assert window_rules(spec(quorum=2)).target == 6
    assert window_rules(spec(quorum=8)).target == 8  # never below the quorum
    manual = window_rules(spec(start="manual", quorum=4))
    assert (manual.quorum, manual.target) == (4, None)


def test_the_door_names_the_cohorts_torch_and_a_gpu_job_wants_a_gpu_per_rank() -> None:
    entry = open_entry("walk-1", spec(), "ab" * 32, 0.0)
    assert door(entry, walk_in("a")) == ""
    assert door(entry, walk_in("b", ranks=3)) == ""  # a box brings its own rank count
    first = walk_in("a")
    entry.hellos[first.id] = hello_of(first, "walk-1", "ab" * 32)
    why = door(entry, walk_in("c", torch="2.12.0"))
    assert "c runs torch 2.12.0 but the cohort runs torch 2.13.0" in why


def test_the_why_pending_line_leads_with_the_phase_and_names_the_start() -> None:
    entry = open_entry("walk-1", spec(start="manual", quorum=2), None, 100.0)
    line = summary("walk-1", entry.window, 101.0)
    assert line.startswith("join window waiting: 0 rank(s) in, quorum 2")
    assert "hard cap in 899s" in line
    window, _ = step(entry.window, Join("w", "a", 2), 102.0)
    assert "startable: muster start walk-1" in summary("walk-1", window, 102.0)


def test_a_cuda_job_refuses_a_box_with_fewer_gpus_than_ranks() -> None:
    gpu = parse_job(
        {
            "name": "walk",
            "entrypoint": "train.py",
            "resources": {"gpus": 1},
            "distributed": {"num_workers": 2, "membership": "window"},
        }
    )
    entry = open_entry("walk-1", gpu, None, 0.0)
    why = door(entry, walk_in("cpu", ranks=2))
    assert "cpu offers 2 rank(s) but has 0 GPU(s)" in why
    assert "--devices" in why


# ---- the desk, at its seam with the controller -----------------------------------------


class FakeLink:
    def __init__(self, worker_id: str = "") -> None:
        self.worker_id = worker_id
        self.open_job: str | None = None  # (admitted with the join secret)
        self.sent: list[tuple[Kind, dict[str, Any]]] = []

    async def send(self, kind: Kind, body: dict[str, Any]) -> bool:
        self.sent.append((kind, body))
        return True


@dataclass
class FakeRecord:
    state: str
    spec: dict[str, Any]


class FakeController:
    """What WindowDesk uses of the controller: links, the writer, the store, start_placed."""

    def __init__(self, job_state: str = "queued") -> None:
        self.links: dict[str, FakeLink] = {}
        self.runs: dict[str, Any] = {}
        self.written: list[Any] = []
        self.started: list[tuple[str, Any]] = []
        self.supported_paths = frozenset({PathClass.PRIVATE, PathClass.DIRECT})
        self.record = FakeRecord(job_state, {"distributed": {"membership": "window"}})
        self.writer = self
        self.store = self

    def submit(self, writes: list[Any]) -> None:
        self.written += writes

    async def barrier(self) -> None:
        return None

    async def db(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def job(self, job_id: str) -> FakeRecord:
        return self.record

    def window_opened_at(self, job_id: str) -> float | None:  # from the events written
        opened = [w.data["opened_at"] for w in self.written if w.kind == "WindowOpened"]
        return opened[-1] if opened else None

    def set_job_spec(self, job_id: str, spec: dict[str, Any]) -> None:
        self.record.spec = spec

    def reserve_placements(self, placements: list[Any]) -> dict[str, Any]:
        return {job: SimpleNamespace(number=1) for job, _ids, _path in placements}

    def apart_of(self, job_id: str) -> None:
        return None

    async def start_placed(self, job: str, spec: Any, placement: Any, *_: Any) -> None:
        self.started.append((job, placement))


def box(host: str) -> WorkerInventory:
    """A walk-in on the rack's LAN (one private network: the gang can take the private path)."""
    inv = walk_in(host, ranks=1)
    lan = NetworkCaps(private_network_id="rack", private_address=f"10.0.0.{len(host)}")
    return inv.model_copy(
        update={"advertise_address": "10.0.0.1", "backends": ["gloo"], "network": lan}
    )


def desk_with(
    *hosts: str, **window: Any
) -> tuple[WindowDesk, FakeController, list[WorkerInventory]]:
    ctl = FakeController()
    desk = WindowDesk(ctl)  # type: ignore[arg-type]
    boxes = [box(h) for h in hosts]
    for b in boxes:
        ctl.links[b.id] = FakeLink()
    job_spec = spec(**window)
    views = [WorkerView(inventory=b) for b in boxes]
    asyncio.run(desk.run_pass({"walk-1": job_spec}, {"walk-1": None}, views))
    return desk, ctl, boxes


def replies(ctl: FakeController, worker: str) -> list[dict[str, Any]]:
    return [body for kind, body in ctl.links[worker].sent if kind is Kind.JOIN_REPLY]


def test_a_start_that_lands_after_the_timeout_still_forms_the_world() -> None:
    desk, ctl, _ = desk_with("a", "b", start="hybrid", quorum=2, join_timeout=1)
    entry = desk.entries["walk-1"]
    assert entry.window.phase.value == "staging"
    entry.window = dataclasses.replace(entry.window, opened_at=entry.window.opened_at - 5)
    view = asyncio.run(desk.start("walk-1"))  # the clock formed it first: no error
    assert view["phase"] == "forming"
    assert [job for job, _p in ctl.started] == ["walk-1"]
    assert "walk-1" not in desk.entries


def test_a_cancelled_window_tells_its_walk_ins_and_never_opens_again() -> None:
    desk, ctl, boxes = desk_with("a", start="manual", quorum=2)
    asyncio.run(desk.cancelled("walk-1"))
    assert "walk-1" not in desk.entries
    told = replies(ctl, boxes[0].id)[-1]
    assert not told["admitted"]
    assert "cancelled before its world formed" in told["reason"]
    views = [WorkerView(inventory=boxes[0])]
    asyncio.run(desk.run_pass({"walk-1": spec(start="manual")}, {"walk-1": None}, views))
    assert "walk-1" not in desk.entries  # the CANCELLED write may still be on its way


def test_a_walk_in_whose_link_closes_leaves_at_once_and_a_start_forms_without_it() -> None:
    desk, ctl, boxes = desk_with("a", "b", "c", start="manual", quorum=2)
    asyncio.run(desk.left(boxes[1].id))
    assert [m.host for m in desk.entries["walk-1"].window.roster] == ["a", "c"]
    del ctl.links[boxes[2].id]  # gone, its end not yet handled
    with pytest.raises(BadRequest, match="quorum not met: 1 of 2"):
        asyncio.run(desk.start("walk-1"))


def test_a_box_that_walks_in_after_the_world_formed_is_told_the_window_is_closed() -> None:
    desk, ctl, _ = desk_with("a", "b", quorum=2, target_ranks=2)
    assert ctl.started
    ctl.record.state = "running"
    late = box("late")
    ctl.links[late.id] = FakeLink()
    asyncio.run(desk.run_pass({}, {}, [WorkerView(inventory=late)]))
    told = replies(ctl, late.id)[-1]
    assert not told["admitted"]
    assert "its world formed without late" in told["reason"]


def test_a_box_that_could_not_share_a_path_with_the_others_is_refused_at_the_door() -> None:
    ctl = FakeController()
    desk = WindowDesk(ctl)  # type: ignore[arg-type]
    near, far = box("near"), box("far")
    far = far.model_copy(update={"network": NetworkCaps()})  # on no LAN, and makes no device
    for b in (near, far):
        ctl.links[b.id] = FakeLink()
    views = [WorkerView(inventory=b) for b in (near, far)]
    asyncio.run(desk.run_pass({"walk-1": spec(start="manual")}, {"walk-1": None}, views))
    assert [m.host for m in desk.entries["walk-1"].window.roster] == ["near"]
    told = replies(ctl, far.id)[-1]
    assert "with far the boxes in could not form one gang" in told["reason"]


def test_a_restarted_controller_keeps_the_windows_clock_and_hard_cap() -> None:
    rules = {"start": "manual", "quorum": 2, "join_timeout": 30, "max_join_timeout": 60}
    desk, ctl, boxes = desk_with("a", **rules)
    opened = desk.entries["walk-1"].window.opened_at
    assert [w.kind for w in ctl.written] == ["WindowOpened"]
    restarted = WindowDesk(ctl)  # type: ignore[arg-type]  # the same store, a new process
    views = [WorkerView(inventory=boxes[0])]
    asyncio.run(restarted.run_pass({"walk-1": spec(**rules)}, {}, views))
    entry = restarted.entries["walk-1"]
    assert entry.window.opened_at == opened  # not the restart's time
    assert [m.host for m in entry.window.roster] == ["a"]  # the box that dialled again
    assert [w.kind for w in ctl.written] == ["WindowOpened"]  # not opened twice
    # Past the hard cap counted from the first opening, the next pass fails it.
    ctl.written[0] = dataclasses.replace(ctl.written[0], data={"opened_at": opened - 61})
    late = WindowDesk(ctl)  # type: ignore[arg-type]
    asyncio.run(late.run_pass({"walk-1": spec(**rules)}, {}, views))
    assert "walk-1" not in late.entries
    failed = [w for w in ctl.written if getattr(w, "state", None) is JobState.FAILED]
    assert len(failed) == 1
