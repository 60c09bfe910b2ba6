"""The store on both engines: submission, placement reservation under races, logs."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import orjson
import pytest
from sqlalchemy import func, select

import muster.store.jobs
from muster.errors import IllegalTransition, NotFound, PlacementConflict, SpecError
from muster.spec import JobState, MemberState, WorkerState
from muster.store import LogLineIn, Store, open_store
from muster.store.models import Job, Member, Worker
from muster.store.writes import (
    ConditionWrite,
    EventWrite,
    InventoryWrite,
    JobStateWrite,
    MemberStateWrite,
    ReleaseWrite,
    WhyPendingWrite,
    WorkerStateWrite,
)
from tests.scheduler.workers import gang, worker
from tests.store.locks import held_write_lock


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = open_store(db_url)
    yield s
    s.db.dispose()


def add_workers(store: Store, n: int) -> list[str]:
    ids = [f"w{i:02d}" for i in range(n)]
    for wid in ids:
        store.upsert_worker(worker(wid))
    return ids


def test_invalid_spec_stores_nothing(store: Store) -> None:
    with pytest.raises(SpecError):
        store.submit_job(gang(2, retries=1))
    assert store.jobs() == []
    assert store.events() == []


def test_submit_and_read_back(store: Store) -> None:
    job = store.submit_job(gang(2, 2))
    again = store.job(job.id)
    assert again.state == "queued"
    spec = store.job_spec(again)
    assert spec.gang.world_size == 4
    assert [e.kind for e in store.events(job.id)] == ["Submitted"]
    assert store.job_counts() == {"queued": 1}
    with pytest.raises(NotFound):
        store.job("nope")


def test_reserve_placement_is_all_or_nothing(store: Store) -> None:
    ids = add_workers(store, 3)
    first = store.submit_job(gang(2))
    epoch = store.reserve_placement(first.id, ids[:2], "direct")
    assert epoch.number == 1
    members = store.members(first.id)
    assert [(m.node_rank, m.worker_id, m.state) for m in members] == [
        (0, "w00", "pending"),
        (1, "w01", "pending"),
    ]
    assert store.job(first.id).state == "placing"

    second = store.submit_job(gang(2))
    with pytest.raises(PlacementConflict):
        store.reserve_placement(second.id, [ids[1], ids[2]], "direct")
    states = {w.id: w.state for w in store.workers()}
    assert states == {
        "w00": WorkerState.RESERVED,
        "w01": WorkerState.RESERVED,
        "w02": WorkerState.IDLE,
    }, "the losing reservation changed nothing"
    assert store.job(second.id).state == "queued"
    assert store.members(second.id) == []


def test_workers_come_back_when_their_members_end(store: Store) -> None:
    ids = add_workers(store, 3)
    job = store.submit_job(gang(3))
    store.reserve_placement(job.id, ids, "direct")
    with pytest.raises(IllegalTransition):
        store.set_job_state(job.id, JobState.SUCCEEDED)
    store.set_job_state(job.id, JobState.RENDEZVOUS)
    store.set_member_state(job.id, 0, MemberState.ASSIGNED)
    store.set_member_state(job.id, 0, MemberState.STARTING)
    store.set_member_state(job.id, 0, MemberState.RUNNING)
    store.set_member_state(job.id, 1, MemberState.ASSIGNED)
    states = {w.id: w.state for w in store.workers()}
    assert states["w00"] is WorkerState.BUSY
    assert states["w01"] is WorkerState.RESERVED
    store.set_job_state(job.id, JobState.FAILED, "node0 rank 1 exited with code 1")
    assert store.job(job.id).root_cause == "node0 rank 1 exited with code 1"
    # The store moves no member and frees no worker on its own: the gang lifecycle
    # (muster.gang) decides when each member's processes are gone.
    states = {w.id: w.state for w in store.workers()}
    assert states == {
        "w00": WorkerState.BUSY,
        "w01": WorkerState.RESERVED,
        "w02": WorkerState.RESERVED,
    }
    store.set_member_state(job.id, 0, MemberState.FAILED, exit_code=-15, signal="SIGTERM")
    store.set_member_state(job.id, 1, MemberState.CANCELLED, exit_code=143, signal="SIGTERM")
    store.set_member_state(job.id, 2, MemberState.CANCELLED)
    assert {w.state for w in store.workers()} == {WorkerState.BUSY, WorkerState.RESERVED}
    for wid in ids:
        store.release_worker(wid, job.id)
    assert {w.state for w in store.workers()} == {WorkerState.IDLE}
    assert [m.state for m in store.members(job.id)] == ["failed", "cancelled", "cancelled"]
    assert store.members(job.id)[0].signal == "SIGTERM"
    # Releasing for another job changes nothing.
    job2 = store.submit_job(gang(1))
    store.reserve_placement(job2.id, ids[:1], "private")
    store.release_worker(ids[0], job.id)
    assert {w.id: w.state for w in store.workers()}["w00"] is WorkerState.RESERVED


def test_settings_are_created_once(store: Store) -> None:
    first = store.setting("token", lambda: "abc")
    assert store.setting("token", lambda: "other") == first == "abc"


def test_racing_reservations_never_share_a_worker(store: Store) -> None:
    """Threads reserve overlapping gangs at once; every worker ends in at most one gang."""
    ids = add_workers(store, 8)
    jobs = [store.submit_job(gang(3)).id for _ in range(12)]
    # Every job wants 3 of the 8 workers, chosen so the wishes overlap heavily.
    wishes = {job: [ids[(i + k) % 8] for k in range(3)] for i, job in enumerate(jobs)}
    barrier = threading.Barrier(len(jobs))
    won: list[str] = []
    errors: list[BaseException] = []

    def reserve(job: str) -> None:
        barrier.wait(timeout=30)
        try:
            store.reserve_placement(job, wishes[job], "direct")
            won.append(job)
        except PlacementConflict:
            pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reserve, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert won, "at least one reservation must succeed"
    with store.db.transaction() as s:
        members = s.scalars(select(Member)).all()
        per_worker = Counter(m.worker_id for m in members)
        assert max(per_worker.values()) == 1, f"a worker was given twice: {per_worker}"
        per_job = Counter(m.job_id for m in members)
        assert set(per_job) == set(won)
        assert set(per_job.values()) == {3}, "no partial gang"
        reserved = s.scalars(select(Worker).where(Worker.state == "reserved")).all()
        assert {w.id for w in reserved} == set(per_worker)
        assert all(w.job_id in won for w in reserved)
        placing = s.scalar(select(func.count()).select_from(Job).where(Job.state == "placing"))
        assert placing == len(won)


def test_log_ingest_is_idempotent(store: Store) -> None:
    job = store.submit_job(gang(2, 2))
    now = time.time()
    batch = [
        LogLineIn("rank", r, seq, now, "stdout", f"rank {r} line {seq}")
        for r in range(4)
        for seq in range(1, 6)
    ]
    assert store.append_logs(job.id, batch) == 20
    assert store.append_logs(job.id, batch[5:15]) == 0, "a resent batch never duplicates"
    store.append_logs(job.id, [LogLineIn("node", 1, 1, now, "stderr", "torchrun: starting")])
    rank2 = store.logs(job.id, rank=2)
    assert [ln.text for ln in rank2] == [f"rank 2 line {i}" for i in range(1, 6)]
    assert len(store.logs(job.id)) == 20
    assert [ln.text for ln in store.logs(job.id, origin="node")] == ["torchrun: starting"]


def test_returning_worker_becomes_idle(store: Store) -> None:
    add_workers(store, 1)
    store.set_worker_state("w00", WorkerState.OFFLINE)
    store.upsert_worker(worker("w00"))
    assert store.workers()[0].state is WorkerState.IDLE
    assert [e.kind for e in store.events()] == ["WorkerJoined", "WorkerReturned"]


def test_artifacts_and_conditions(store: Store) -> None:
    job = store.submit_job(gang(2))
    store.add_artifact(job.id, 1, "ckpt/model.pt", 1234, "ab" * 32)
    store.add_artifact(job.id, 0, "ckpt/model.pt", 1234, "ab" * 32)
    assert [(a.node_rank, a.path) for a in store.artifacts(job.id)] == [
        (0, "ckpt/model.pt"),
        (1, "ckpt/model.pt"),
    ]
    store.set_condition(job.id, "GangReady", False, "Waiting", "1 of 2 members")
    store.set_condition(job.id, "GangReady", True, "AllJoined", "2 of 2 members")
    (cond,) = store.conditions(job.id)
    assert (cond.status, cond.reason) == ("True", "AllJoined")


def test_a_job_view_is_the_job_its_latest_members_events_and_conditions(store: Store) -> None:
    ids = add_workers(store, 2)
    job = store.submit_job(gang(2))
    store.reserve_placement(job.id, ids, "private")
    store.set_condition(job.id, "GangReady", True, "AllJoined", "2 of 2 members")
    for i in range(5):
        store.record_event("Note", f"note {i}", job=job.id)
    view = store.job_view(job.id)
    assert (view.job.id, view.job.state) == (job.id, "placing")
    assert [(m.node_rank, m.worker_id) for m in view.members] == [(0, "w00"), (1, "w01")]
    assert [e.message for e in view.events] == [e.message for e in store.events(job.id)]
    assert [(c.type, c.reason) for c in view.conditions] == [("GangReady", "AllJoined")]
    assert view.events_total is None
    newest = store.job_view(job.id, events_last=2)
    assert [e.message for e in newest.events] == ["note 3", "note 4"]
    assert newest.events_total == len(view.events)
    with pytest.raises(NotFound):
        store.job_view("nope")


def test_job_ids_never_collide_even_when_the_generator_repeats(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    draws = iter(["train-aaaa", "train-aaaa", "train-aaaa", "train-bbbb"])
    monkeypatch.setattr(muster.store.jobs, "new_job_id", lambda name: next(draws))
    first = store.submit_job(gang(2))
    second = store.submit_job(gang(2))
    assert (first.id, second.id) == ("train-aaaa", "train-bbbb")
    assert [j.id for j in store.jobs()] == ["train-aaaa", "train-bbbb"]
    assert [e.message for e in store.events()] == [
        "job train-aaaa queued",
        "job train-bbbb queued",
    ]


def test_job_ids_of_the_longest_name_fit(store: Store) -> None:
    spec = gang(2)
    spec["name"] = "n" * 63
    ids = {store.submit_job(spec).id for _ in range(3)}
    assert len(ids) == 3
    assert all(len(i) <= 80 and i.startswith("n" * 63 + "-") for i in ids)


def test_set_why_pending_many_writes_only_changes(store: Store) -> None:
    a, b, c = (store.submit_job(gang(2)).id for _ in range(3))
    store.set_why_pending(a, "needs 2 workers, 0 idle")
    changed = store.set_why_pending_many(
        {a: "needs 2 workers, 0 idle", b: "needs 2 workers, 1 idle", c: None, "gone-1": "x"}
    )
    assert changed == 1, "a already had that reason, c had none, gone-1 does not exist"
    assert [store.job(j).why_pending for j in (a, b, c)] == [
        "needs 2 workers, 0 idle",
        "needs 2 workers, 1 idle",
        None,
    ]
    assert store.set_why_pending_many({a: None, b: "needs 2 workers, 1 idle"}) == 1
    assert store.job(a).why_pending is None
    unplaceable = [(e.job_id, e.message) for e in store.events() if e.kind == "Unplaceable"]
    assert unplaceable == [(a, "needs 2 workers, 0 idle"), (b, "needs 2 workers, 1 idle")]
    assert store.set_why_pending_many({}) == 0


def test_a_root_cause_quoting_a_nul_is_stored_on_both_engines(store: Store) -> None:
    """A rank's last lines can hold NUL (its output is anything), and the root cause quotes
    them: the job's FAILED, its event and its condition are on record, NUL shown as \\0."""
    ids = add_workers(store, 2)
    job = store.submit_job(gang(2)).id
    store.reserve_placement(job, ids, "direct")
    cause = "node0 (worker w00): global rank 1 exited with code 1\nlast lines:\n  a\x00b"
    skipped = store.apply_writes(
        [
            JobStateWrite(job, JobState.FAILED, cause),
            EventWrite("Note", "said \x00", job),
            ConditionWrite(job, "Failed", True, "RankFailed", cause),
        ]
    )
    assert skipped == []
    shown = cause.replace("\x00", "\\0")
    assert store.job(job).state == "failed"
    assert store.job(job).root_cause == shown
    assert [e.message for e in store.events(job) if e.kind in ("JobFailed", "Note")] == [
        shown,
        "said \\0",
    ]
    assert [c.message for c in store.conditions(job)] == [shown]
    assert orjson.loads(store.job_listing())[0]["root_cause"] == shown


def test_a_kind_of_reason_told_before_is_written_without_a_second_event(store: Store) -> None:
    """A busy queue flips a waiting job between two kinds of reason; the controller marks the
    kinds its events said already as quiet: the column always holds the latest words, the
    event log says each kind once."""
    job = store.submit_job(gang(2)).id
    flips = [
        ("held back by queue order; 3 ahead", frozenset()),
        ("needs 2 idle workers; 1 idle", frozenset()),
        ("held back by queue order; 1 ahead", frozenset({job})),
        ("needs 2 idle workers; 0 idle", frozenset({job})),
    ]
    for reason, quiet in flips:
        assert store.apply_writes([WhyPendingWrite({job: reason}, quiet)]) == []
        assert store.job(job).why_pending == reason
    said = [e.message for e in store.events() if e.kind == "Unplaceable"]
    assert said == ["held back by queue order; 3 ahead", "needs 2 idle workers; 1 idle"]


def test_a_reason_that_lands_after_the_job_was_placed_is_dropped(store: Store) -> None:
    """The pass that found a job waiting hands its reason to the group commit; the next
    pass may reserve the job first. A placed job shows no why_pending, and no Unplaceable
    event is written for it."""
    ids = add_workers(store, 2)
    waiting, placed = store.submit_job(gang(2)).id, store.submit_job(gang(2)).id
    store.reserve_placement(placed, ids, "direct")
    late = {placed: "held back by queue order", waiting: "needs 3 workers, 2 idle \x00"}
    assert store.apply_writes([WhyPendingWrite(late)]) == []
    assert store.job(placed).why_pending is None
    assert store.job(waiting).why_pending == "needs 3 workers, 2 idle \\0"  # NUL shown
    assert store.set_why_pending_many({placed: "held back by queue order"}) == 0
    assert store.job(placed).why_pending is None
    unplaceable = [e.job_id for e in store.events() if e.kind == "Unplaceable"]
    assert unplaceable == [waiting]


def test_a_job_reserved_while_the_group_commit_writes_its_reason_gets_none(
    store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL lets a reservation commit between the group commit's read of why_pending
    and its UPDATE (read committed; SQLite's write lock keeps them apart). The UPDATE then
    skips the job, and so must the Unplaceable event: a running job's history never says it
    could not be placed after it was."""
    if not db_url.startswith("postgresql"):
        pytest.skip("SQLite's write lock keeps a reservation out of the group commit")
    from muster.store import hot

    ids = add_workers(store, 2)
    job = store.submit_job(gang(2)).id
    read = hot.read_why_pending

    raced: list[threading.Thread] = []

    def read_then_reserved(conn: object, job_ids: object) -> dict[str, str | None]:
        current = read(conn, job_ids)  # type: ignore[arg-type]
        if not raced:  # the first read: another connection reserves before the UPDATE
            raced.append(
                threading.Thread(target=store.reserve_placement, args=(job, ids, "direct"))
            )
            raced[0].start()
            raced[0].join(30)
        return current

    monkeypatch.setattr(hot, "read_why_pending", read_then_reserved)
    waiting = {job: "needs 3 workers, 2 idle; \x00 and all"}
    assert store.apply_writes([WhyPendingWrite(waiting)]) == []
    assert store.job(job).state == JobState.PLACING
    assert store.job(job).why_pending is None
    assert "Unplaceable" not in [e.kind for e in store.events(job)]


def test_set_why_pending_many_takes_no_write_lock_when_nothing_changes(
    store: Store, db_url: str
) -> None:
    if store.db.dialect != "sqlite":
        pytest.skip("the write lock is SQLite's")
    jobs = {store.submit_job(gang(2)).id: None for _ in range(3)}
    with held_write_lock(db_url):
        t0 = time.monotonic()
        assert store.set_why_pending_many(jobs) == 0
        assert time.monotonic() - t0 < 4  # a wait for the lock would be the busy timeout


def test_a_pass_reserves_every_gang_in_one_go_and_a_conflict_spoils_only_its_own(
    store: Store,
) -> None:
    ids = add_workers(store, 5)
    jobs = [store.submit_job(gang(2)).id for _ in range(3)]
    got = store.reserve_placements(
        [
            (jobs[0], ids[0:2], "private"),
            (jobs[1], ids[1:3], "private"),  # w01 is taken by the first: a conflict
            (jobs[2], ids[3:5], "private"),
        ]
    )
    assert not isinstance(got[jobs[0]], PlacementConflict)
    assert isinstance(got[jobs[1]], PlacementConflict)
    assert not isinstance(got[jobs[2]], PlacementConflict)
    states = {w.id: w.state for w in store.workers()}
    assert states == {
        "w00": WorkerState.RESERVED,
        "w01": WorkerState.RESERVED,
        "w02": WorkerState.IDLE,  # nothing of the spoiled reservation is left
        "w03": WorkerState.RESERVED,
        "w04": WorkerState.RESERVED,
    }
    assert [store.job(j).state for j in jobs] == ["placing", "queued", "placing"]
    assert store.members(jobs[1]) == []


def test_group_commit_keeps_order_and_a_refused_write_spoils_nothing(store: Store) -> None:
    ids = add_workers(store, 2)
    job = store.submit_job(gang(2)).id
    store.reserve_placement(job, ids, "private")
    skipped = store.apply_writes(
        [
            JobStateWrite(job, JobState.RENDEZVOUS, "waiting for node0"),
            MemberStateWrite(job, 0, MemberState.ASSIGNED, path_address="10.0.0.1"),
            EventWrite("Assigned", "node0 assigned", job),
            MemberStateWrite(job, 1, MemberState.SUCCEEDED),  # pending -> succeeded: refused
            JobStateWrite(job, JobState.SUCCEEDED),  # rendezvous -> succeeded: refused
            MemberStateWrite(job, 1, MemberState.CANCELLED),
            ReleaseWrite(ids[1], job),
            EventWrite("Note", "last", job),
        ]
    )
    assert len(skipped) == 2
    assert all(problem.startswith(("MemberStateWrite", "JobStateWrite")) for problem in skipped)
    assert store.job(job).state == "rendezvous"
    members = store.members(job)
    assert [m.state for m in members] == ["assigned", "cancelled"]
    assert members[0].path_address == "10.0.0.1"
    assert members[0].assigned_at is not None
    assert {w.id: w.state for w in store.workers()}[ids[1]] is WorkerState.IDLE
    kinds = [e.kind for e in store.events(job)]
    assert kinds.index("JobRendezvous") < kinds.index("Assigned") < kinds.index("Note")


def test_one_batch_moves_a_worker_through_its_writes_in_order(store: Store) -> None:
    """The group commit reads the workers a batch touches once and writes them back at its
    end; what each write sees is still what the writes before it in the batch left."""
    ids = add_workers(store, 3)
    job, other = store.submit_job(gang(2)).id, store.submit_job(gang(1)).id
    store.reserve_placement(job, ids[:2], "private")
    store.reserve_placement(other, ids[2:], "private")
    fresh = worker("w-new").model_dump(mode="json")
    back = worker(ids[2]).model_dump(mode="json")
    up = (MemberState.ASSIGNED, MemberState.STARTING)
    started = [MemberStateWrite(job, n, state) for n in (0, 1) for state in up]
    skipped = store.apply_writes(
        [
            *started,
            MemberStateWrite(job, 0, MemberState.RUNNING),  # w00 busy: still this job's
            ReleaseWrite(ids[0], other),  # another job's release: w00 stays busy
            ReleaseWrite(ids[1], job),  # w01 idle ...
            MemberStateWrite(job, 1, MemberState.RUNNING),  # ... so its RUNNING busies nothing
            InventoryWrite(fresh),  # a worker joins, then goes away in the same batch
            WorkerStateWrite("w-new", WorkerState.OFFLINE),
            WorkerStateWrite(ids[2], WorkerState.OFFLINE),
            InventoryWrite(back),  # and w02 comes back: idle, no job
            WorkerStateWrite("w-nobody", WorkerState.IDLE),  # no such worker: nothing
        ]
    )
    assert skipped == []
    with store.db.transaction() as s:
        rows = {w.id: (w.state, w.job_id, w.hostname) for w in s.scalars(select(Worker))}
    assert rows[ids[0]] == ("busy", job, "w00.example")
    assert rows[ids[1]] == ("idle", None, "w01.example")
    assert rows["w-new"] == ("offline", None, "w-new.example")
    assert rows[ids[2]] == ("idle", None, "w02.example")
    assert "w-nobody" not in rows
    kinds = [(e.kind, e.worker_id) for e in store.events() if e.kind.startswith("Worker")]
    assert ("WorkerJoined", "w-new") in kinds
    assert ("WorkerReturned", ids[2]) in kinds


def test_a_reservation_made_while_a_batch_runs_is_not_written_over(
    store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch reads its workers at its start and writes them at its end; on PostgreSQL a
    reservation from another connection could commit in between and be written over (the
    workers idle again under a placed job). The batch's read locks them: the reservation
    waits for the commit, then holds."""
    if not db_url.startswith("postgresql"):
        pytest.skip("SQLite's write lock keeps a reservation out of the group commit")
    from muster.store import hot

    ids = add_workers(store, 2)
    other, job = store.submit_job(gang(1)).id, store.submit_job(gang(2)).id
    job_state = hot.job_state
    racer = threading.Thread(target=store.reserve_placement, args=(job, ids, "direct"))

    def reserved_meanwhile(*args: object, **kwargs: object) -> None:
        if not racer.is_alive() and racer.ident is None:
            racer.start()
            racer.join(2)  # blocked on the batch's locks (before the fix: committed)
        job_state(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hot, "job_state", reserved_meanwhile)
    inventories = [InventoryWrite(worker(w).model_dump(mode="json")) for w in ids]
    assert store.apply_writes([*inventories, JobStateWrite(other, JobState.FAILED, "x")]) == []
    racer.join(30)
    with store.db.transaction() as s:
        rows = {w.id: (w.state, w.job_id) for w in s.scalars(select(Worker))}
    assert rows == {w: ("reserved", job) for w in ids}
    assert store.job(job).state == JobState.PLACING


def test_a_window_keeps_its_opening_time_until_an_epoch_is_fenced(store: Store) -> None:
    job = store.submit_job(gang(2)).id
    assert store.window_opened_at(job) is None
    store.record_event("WindowOpened", "join window open", job=job, data={"opened_at": 1000.5})
    store.record_event("WalkedIn", "a box", job=job)  # other events do not hide it
    assert store.window_opened_at(job) == 1000.5
    store.record_event("EpochFenced", "placing the gang again", job=job)
    assert store.window_opened_at(job) is None  # the next window is a new one
    store.record_event("WindowOpened", "join window open", job=job, data={"opened_at": 2000.0})
    assert store.window_opened_at(job) == 2000.0


def test_the_job_listing_built_in_sql_is_what_python_would_build(store: Store) -> None:
    """GET /v1/jobs's answer comes from one SQL statement; it says exactly what the
    row-by-row Python summary said, in submission order, on both engines."""
    from muster.controller.api import job_summary

    assert orjson.loads(store.job_listing()) == []
    jobs = [store.submit_job(gang(2)) for _ in range(12)]
    odd = 'waiting: "quoted" \\ back\\slash, tab\t, newline\n, \u00e9\u4e2d\U0001f600, \x01'
    store.set_why_pending(jobs[3].id, odd)
    store.set_job_state(jobs[5].id, JobState.FAILED, "node0 rank 1 exited with code 1\nx")
    ids = add_workers(store, 2)
    store.reserve_placement(jobs[7].id, ids, "direct")
    store.set_job_state(jobs[7].id, JobState.RENDEZVOUS)
    store.set_job_state(jobs[7].id, JobState.RUNNING)
    with store.db.transaction() as s:  # a whole second: still six digits of fraction
        row = s.scalars(select(Job).where(Job.id == jobs[1].id)).one()
        row.submitted_at = row.submitted_at.replace(microsecond=0)
        row.priority = -3
        row.path_class = "direct"
    listed = orjson.loads(store.job_listing())
    expected = [job_summary(j) for j in store.job_summaries()]
    assert [j["id"] for j in listed] == [j.id for j in jobs]
    assert listed == orjson.loads(orjson.dumps(expected))
    assert listed[1]["submitted_at"].endswith(".000000+00:00"), listed[1]
    assert listed[0]["submitted_at"].endswith("+00:00"), listed[0]
    assert listed[3]["why_pending"] == odd


def test_times_read_the_same_in_the_listing_and_the_detail_whatever_the_server_time_zone(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PostgreSQL session in another time zone (PGTZ, or the server's TimeZone) must not
    change how a time reads: GET /v1/jobs and GET /v1/jobs/{id} both say it in UTC, with its
    offset, on either engine."""
    from muster.controller.api import job_summary

    monkeypatch.setenv("PGTZ", "America/New_York")  # libpq sets the session's TimeZone
    store = open_store(db_url)
    try:
        job = store.submit_job(gang(2))
        listed = orjson.loads(store.job_listing())[0]
        detail = orjson.loads(orjson.dumps(job_summary(store.job(job.id))))
        assert listed["submitted_at"] == detail["submitted_at"]
        assert detail["submitted_at"].endswith("+00:00"), detail["submitted_at"]
    finally:
        store.db.dispose()


def test_what_fenced_epochs_asked_of_a_job_is_read_back_until_it_ends(store: Store) -> None:
    """A restarted controller places by the EpochFenced events of the jobs not over: the
    pairs kept apart, and the smallest MTU their direct gangs were cut to."""
    shrunk, ended, plain = (store.submit_job(gang(2, 1)) for _ in range(3))
    fenced = {"epoch": 1, "path": "direct", "reason": "ProbeFailed"}
    store.record_event("EpochFenced", "m", job=shrunk.id, data={**fenced, "apart": [], "mtu": 1280})
    store.record_event("EpochFenced", "m", job=shrunk.id, data={**fenced, "apart": [["a", "b"]]})
    store.record_event("EpochFenced", "m", job=ended.id, data={**fenced, "apart": [], "mtu": 1280})
    store.record_event("EpochFenced", "m", job=plain.id, data={**fenced, "apart": [], "mtu": "x"})
    store.record_event("EpochFenced", "m", job=plain.id, data={**fenced, "apart": [], "mtu": 9})
    store.set_job_state(ended.id, JobState.CANCELLED, "by a test")
    assert store.fenced_epochs() == ({shrunk.id: [("direct", "a", "b")]}, {shrunk.id: 1280})
