"""Jobs and gang placement.

The rule that matters most: ``reserve_placement`` takes a gang's workers in one
transaction and only if every one of them is still idle, so two scheduler passes racing
never give one worker to two gangs.

A job's id is its name plus 40 random bits (``new_job_id``); ``submit_job`` draws again
when an id is taken, so a duplicate never reaches the user.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, defer

from muster.errors import BadRequest, PlacementConflict, SpecError, StoreUnavailable
from muster.spec.job import JobSpec
from muster.spec.loader import first_problems, load_stored_job, parse_job
from muster.spec.states import (
    JobState,
    MemberState,
    WorkerState,
    check_job_transition,
    check_member_transition,
)
from muster.store import hot
from muster.store.base import Repository, add_event, load_job, utcnow
from muster.store.hot import Reserved
from muster.store.models import (
    Event,
    GangEpoch,
    Job,
    Member,
    Worker,
)

JOB_ID_ATTEMPTS = 16  # ids drawn before giving up; at 40 bits a second draw is already rare
IDS_PER_READ = 500  # job ids per IN (...)


def new_job_id(name: str) -> str:
    """A fresh id for a job called ``name``: ``name-`` and 10 hex digits (<= 74 characters)."""
    return f"{name}-{secrets.token_hex(5)}"


class JobRepository(Repository):
    # ---- jobs ----------------------------------------------------------------------------

    def submit_job(
        self, spec: JobSpec | dict[str, Any], *, bundle_sha256: str | None = None
    ) -> Job:
        """Validate and queue a job. An invalid spec raises SpecError and stores nothing."""
        checked = parse_job(spec)
        now = utcnow()
        for _ in range(JOB_ID_ATTEMPTS):
            job_id = new_job_id(checked.name)
            try:
                with self.db.transaction() as s:
                    if s.scalar(select(Job.seq).where(Job.id == job_id)) is not None:
                        continue  # taken: draw again
                    job = Job(
                        id=job_id,
                        name=checked.name,
                        spec=checked.model_dump(mode="json"),
                        state=JobState.QUEUED.value,
                        priority=checked.priority,
                        bundle_sha256=bundle_sha256,
                        submitted_at=now,
                    )
                    s.add(job)
                    s.flush()
                    add_event(s, "Submitted", f"job {job.id} queued", job=job.id)
                    return job
            except IntegrityError:
                continue  # another submission took the id between our check and insert
        raise StoreUnavailable(
            f"could not find a free job id for {checked.name!r} in {JOB_ID_ATTEMPTS} draws; "
            "the job was not stored, submit it again"
        )

    def job(self, job_id: str) -> Job:
        with self.db.read() as s:
            return load_job(s, job_id)

    def jobs(self, states: Iterable[JobState] | None = None) -> list[Job]:
        """Jobs in submission order, optionally only those in ``states``; without their
        specs (``job`` has them), which a listing never shows."""
        with self.db.read() as s:
            query = select(Job).options(defer(Job.spec, raiseload=True)).order_by(Job.seq)
            if states is not None:
                query = query.where(Job.state.in_([st.value for st in states]))
            return list(s.scalars(query).all())

    def job_summaries(self) -> list[JobSummary]:
        """Every job's listing columns, in submission order: plain rows, no ORM objects
        (GET /v1/jobs, polled by users and dashboards, stays cheap with many jobs)."""
        with self.db.read() as s:
            rows = s.execute(select(*_SUMMARY).order_by(Job.seq)).all()
            return [JobSummary._make(row) for row in rows]

    def job_listing(self) -> bytes:
        """GET /v1/jobs's answer: every job's listing columns (``api.job_summary``'s
        fields), in submission order, as a JSON array built by the database in one
        statement. A dashboard polls this with thousands of jobs while the controller is
        placing: built row by row in Python it took ~20 ms of the controller's interpreter
        per call (1,000 jobs), and the fetch gave the interpreter up once per row."""
        with self.db.read() as s:
            sql = _LISTING_POSTGRESQL if self.db.dialect == "postgresql" else _LISTING_SQLITE
            found = s.connection().exec_driver_sql(sql).scalar()
        return str(found or "[]").encode()

    def queued(self) -> list[tuple[str, int, str | None]]:
        """The queued jobs' (id, seq, bundle), in submission order: what a scheduler pass
        reads each time (the specs are read once per job, with ``specs``)."""
        with self.db.read() as s:
            rows = s.execute(
                select(Job.id, Job.seq, Job.bundle_sha256)
                .where(Job.state == JobState.QUEUED.value)
                .order_by(Job.seq)
            ).all()
            return [(str(i), int(q), b) for i, q, b in rows]

    def specs(self, job_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The stored specs (JSON, not validated) of ``job_ids``."""
        found: dict[str, dict[str, Any]] = {}
        with self.db.read() as s:
            for chunk in _chunks(list(job_ids), IDS_PER_READ):
                for job_id, spec in s.execute(select(Job.id, Job.spec).where(Job.id.in_(chunk))):
                    found[str(job_id)] = spec
        return found

    def job_counts(self) -> dict[str, int]:
        """How many jobs are in each state."""
        with self.db.read() as s:
            rows = s.execute(select(Job.state, func.count()).group_by(Job.state)).all()
            return {str(state): int(n) for state, n in rows}

    def fenced_epochs(self) -> tuple[dict[str, list[tuple[str, str, str]]], dict[str, int]]:
        """What the fenced epochs of each job not yet over ask of its next gangs (their
        EpochFenced events), as a restarted controller places by: the (path, worker,
        worker) pairs kept apart, and the smallest MTU its direct gangs were cut to."""
        over = [state.value for state in JobState if state.is_terminal]
        with self.db.read() as s:
            rows = s.execute(
                select(Event.job_id, Event.data)
                .join(Job, Job.id == Event.job_id)
                .where(Event.kind == "EpochFenced", Job.state.not_in(over))
                .order_by(Event.id)
            ).all()
        apart: dict[str, list[tuple[str, str, str]]] = {}
        packets: dict[str, int] = {}
        for job_id, data in rows:
            if not isinstance(data, dict):
                continue
            path = str(data.get("path") or "")
            for pair in data.get("apart") or ():
                if isinstance(pair, list) and len(pair) == 2:
                    apart.setdefault(str(job_id), []).append((path, str(pair[0]), str(pair[1])))
            mtu = data.get("mtu")
            if isinstance(mtu, int) and not isinstance(mtu, bool) and mtu >= 1280:
                packets[str(job_id)] = min(mtu, packets.get(str(job_id), mtu))
        return apart, packets

    def job_spec(self, job: Job) -> JobSpec:
        """The job's stored spec, validated; BadRequest (409) naming the job and the first
        problem where this version no longer accepts what an older one stored."""
        try:
            return load_stored_job(job.spec, job.id)
        except SpecError as exc:
            raise BadRequest(
                f"job {job.id}: its stored spec no longer validates ({first_problems(exc)}); "
                "submit the job again"
            ) from None

    def set_job_state(self, job_id: str, new: JobState, message: str = "") -> Job:
        """Move a job along its lifecycle; illegal moves raise IllegalTransition."""
        with self.db.transaction() as s:
            return job_state_in(s, job_id, new, message)

    def set_job_spec(self, job_id: str, spec: dict[str, Any]) -> None:
        """Replace a queued job's spec: a join window's job takes the size of the world
        that formed (num_workers = the hosts that walked in) before it is reserved."""
        with self.db.transaction() as s:
            job = load_job(s, job_id)
            if job.state != JobState.QUEUED.value:
                raise BadRequest(f"job {job_id} is {job.state}, no longer queued")
            job.spec = spec

    def set_why_pending(self, job_id: str, reason: str | None) -> None:
        with self.db.transaction() as s:
            job = load_job(s, job_id)
            if job.why_pending != reason:
                job.why_pending = reason
                if reason:
                    add_event(s, "Unplaceable", reason, job=job_id)

    def set_why_pending_many(self, reasons: Mapping[str, str | None]) -> int:
        """Set many queued jobs' why_pending at once; returns how many changed.

        Reads the current values first (no write lock) and, only when some differ, writes
        those in one transaction (``hot.why_pending``: with an "Unplaceable" event when the
        kind of a reason changes). Jobs that do not exist or are not queued are skipped.
        """
        with self.db.read() as s:
            current = hot.read_why_pending(s.connection(), reasons)
        if not hot.why_pending_changes(current, reasons):
            return 0
        events: list[dict[str, Any]] = []
        with self.db.transaction() as s:
            conn = s.connection()
            changed = hot.why_pending(conn, reasons, events)
            hot.insert_events(conn, events)
            return changed

    # ---- placement -----------------------------------------------------------------------

    def reserve_placement(
        self, job_id: str, worker_ids: Sequence[str], path_class: str
    ) -> Reserved:
        """Take the gang's workers and open a new epoch, all in one transaction.

        ``worker_ids[r]`` becomes node rank r. Raises PlacementConflict, changing nothing,
        when the job is no longer queued or any worker is no longer idle.
        """
        events: list[dict[str, Any]] = []
        with self.db.transaction() as s:
            conn = s.connection()
            reserved = hot.reserve(conn, job_id, worker_ids, path_class, events)
            hot.insert_events(conn, events)
            return reserved

    def reserve_placements(
        self, placements: Sequence[tuple[str, Sequence[str], str]]
    ) -> dict[str, Reserved | PlacementConflict]:
        """Several (job, workers, path) reservations in one transaction: each one all or
        nothing, a conflict in one leaving the others standing."""
        results: dict[str, Reserved | PlacementConflict] = {}
        events: list[dict[str, Any]] = []
        with self.db.transaction() as s:
            conn = s.connection()
            for job_id, worker_ids, path_class in placements:
                try:
                    results[job_id] = hot.reserve(conn, job_id, worker_ids, path_class, events)
                except PlacementConflict as exc:
                    results[job_id] = exc
            hot.insert_events(conn, events)
        return results

    def members(self, job_id: str, epoch_number: int | None = None) -> list[Member]:
        """The members of the job's latest (or given) epoch, by node rank."""
        with self.db.read() as s:
            return members_in(s, job_id, epoch_number)

    def active_runs(self) -> list[RunRecord]:
        """Every job caught mid-run, as the store holds it: for rebuilding gang runs after
        a controller restart."""
        active = [JobState.PLACING, JobState.NETWORKING, JobState.RENDEZVOUS, JobState.RUNNING]
        records = []
        with self.db.read() as s:
            jobs = s.scalars(
                select(Job).where(Job.state.in_([a.value for a in active])).order_by(Job.seq)
            ).all()
            for job in jobs:
                epoch = s.scalars(
                    select(GangEpoch)
                    .where(GangEpoch.job_id == job.id)
                    .order_by(GangEpoch.number.desc())
                    .limit(1)
                ).first()
                if epoch is None:
                    continue
                members = list(
                    s.scalars(
                        select(Member).where(Member.epoch_id == epoch.id).order_by(Member.node_rank)
                    )
                )
                stored = {
                    int(e.data.get("node", -1))
                    for e in s.scalars(
                        select(Event).where(Event.job_id == job.id, Event.kind == "OutputsStored")
                    )
                    if isinstance(e.data, dict) and e.data.get("epoch") == epoch.number
                }
                records.append(RunRecord(job, epoch, members, stored))
        return records

    def set_epoch_rendezvous(self, job_id: str, epoch_number: int, addr: str, port: int) -> None:
        """Record node 0's published rendezvous address on the epoch."""
        with self.db.transaction() as s:
            rendezvous_in(s, job_id, epoch_number, addr, port)

    def set_member_state(
        self,
        job_id: str,
        node_rank: int,
        state: MemberState,
        *,
        exit_code: int | None = None,
        signal: str | None = None,
        path_address: str | None = None,
    ) -> Member:
        """Move the latest epoch's member ``node_rank`` (a terminal one stays as it is)."""
        with self.db.transaction() as s:
            return member_state_in(s, job_id, node_rank, state, exit_code, signal, path_address)

    def release_worker(self, worker_id: str, job_id: str) -> None:
        """The agent reported that nothing of ``job_id`` runs on the worker any more."""
        with self.db.transaction() as s:
            _release(s, worker_id, job_id)


# ---- the writes themselves, inside a caller's transaction (see also muster.store.writes) ---


def job_state_in(s: Session, job_id: str, new: JobState, message: str = "") -> Job:
    now = utcnow()
    job = load_job(s, job_id, lock=True)
    check_job_transition(JobState(job.state), new)
    job.state = new.value
    if new is JobState.RUNNING:
        job.started_at = now
    if new.is_terminal:
        # Members and workers are the gang lifecycle's to move (muster.gang): it cancels
        # the unstarted members and releases each worker when its member's processes are
        # known gone.
        job.finished_at = now
    if new is JobState.FAILED and message:
        job.root_cause = message
    add_event(s, f"Job{new.value.capitalize()}", message or f"job is {new.value}", job=job_id)
    return job


def rendezvous_in(s: Session, job_id: str, epoch_number: int, addr: str, port: int) -> None:
    epoch = s.scalars(
        select(GangEpoch).where(GangEpoch.job_id == job_id, GangEpoch.number == epoch_number)
    ).one()
    epoch.master_addr, epoch.master_port = addr, port


def member_state_in(
    s: Session,
    job_id: str,
    node_rank: int,
    state: MemberState,
    exit_code: int | None = None,
    signal: str | None = None,
    path_address: str | None = None,
) -> Member:
    now = utcnow()
    member = s.scalars(
        select(Member)
        .join(GangEpoch, Member.epoch_id == GangEpoch.id)
        .where(Member.job_id == job_id, Member.node_rank == node_rank)
        .order_by(GangEpoch.number.desc())
        .limit(1)
    ).one()
    current = MemberState(member.state)
    if current.is_terminal:
        return member
    check_member_transition(current, state)
    member.state = state.value
    if exit_code is not None:
        member.exit_code = exit_code
    if signal is not None:
        member.signal = signal
    if path_address is not None:
        member.path_address = path_address
    if state is MemberState.ASSIGNED:
        member.assigned_at = now
    elif state is MemberState.RUNNING:
        member.started_at = now
        s.execute(
            update(Worker)
            .where(Worker.id == member.worker_id, Worker.job_id == job_id)
            .values(state=WorkerState.BUSY.value)
        )
    if state.is_terminal:
        member.finished_at = now
    return member


def _chunks(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


_SUMMARY = (
    Job.id,
    Job.name,
    Job.state,
    Job.priority,
    Job.path_class,
    Job.why_pending,
    Job.root_cause,
    Job.submitted_at,
    Job.started_at,
    Job.finished_at,
)


class JobSummary(NamedTuple):
    """A job's listing columns (the same names as on ``Job``)."""

    id: str
    name: str
    state: str
    priority: int
    path_class: str | None
    why_pending: str | None
    root_cause: str | None
    submitted_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


def _listing_sql(iso: str, array: str) -> str:
    """The listing statement: ``iso`` formats a timestamp column ``{c}`` as the API does
    (controller.api.utc); ``array`` aggregates the rows' objects in ``seq`` order."""
    fields = ", ".join(
        f"'{name}', {iso.format(c=name) if name.endswith('_at') else name}"
        for name in JobSummary._fields
    )
    return array.format(fields=fields)


# SQLite stores a timestamp as 'YYYY-MM-DD HH:MM:SS.ffffff' (UTC, no zone, always six
# digits) and reads it back naive. FROM's rows come in seq order (the rowid).
_LISTING_SQLITE = _listing_sql(
    "CASE WHEN {c} IS NULL THEN NULL ELSE replace({c}, ' ', 'T') || '+00:00' END",
    "SELECT json_group_array(json(j)) FROM "
    "(SELECT json_object({fields}) AS j FROM jobs ORDER BY seq)",
)
# PostgreSQL: timestamptz, read aware; written here in UTC.
_LISTING_POSTGRESQL = _listing_sql(
    "CASE WHEN {c} IS NULL THEN NULL ELSE to_char({c} AT TIME ZONE 'UTC', "
    "'YYYY-MM-DD\"T\"HH24:MI:SS.US') || '+00:00' END",
    "SELECT coalesce(json_agg(json_build_object({fields}) ORDER BY seq), '[]')::text FROM jobs",
)


@dataclass(frozen=True)
class RunRecord:
    """One active job's latest epoch: its members, and the nodes whose outputs were stored."""

    job: Job
    epoch: GangEpoch
    members: list[Member]
    outputs_stored: set[int]


def _release(s: Session, worker_id: str, job_id: str) -> None:
    """Give a worker held for ``job_id`` back to the pool (unless it went offline)."""
    s.execute(
        update(Worker)
        .where(
            Worker.id == worker_id,
            Worker.job_id == job_id,
            Worker.state.in_([WorkerState.RESERVED.value, WorkerState.BUSY.value]),
        )
        .values(state=WorkerState.IDLE.value, job_id=None)
    )


def members_in(s: Session, job_id: str, epoch_number: int | None = None) -> list[Member]:
    """``JobRepository.members`` inside a transaction of the caller's."""
    query = select(GangEpoch).where(GangEpoch.job_id == job_id)
    if epoch_number is not None:
        query = query.where(GangEpoch.number == epoch_number)
    epoch = s.scalars(query.order_by(GangEpoch.number.desc()).limit(1)).first()
    if epoch is None:
        return []
    return list(
        s.scalars(select(Member).where(Member.epoch_id == epoch.id).order_by(Member.node_rank))
    )
