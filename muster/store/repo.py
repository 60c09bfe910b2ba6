"""Repositories: every method is one transaction over the tables in ``models``.

The rule that matters most: ``reserve_placement`` takes a gang's workers in one
transaction and only if every one of them is still idle, so two scheduler passes racing
never give one worker to two gangs.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from muster.errors import BadRequest, NotFound, PlacementConflict
from muster.spec.job import JobSpec
from muster.spec.loader import parse_job
from muster.spec.states import JobState, MemberState, WorkerState, check_job_transition
from muster.spec.worker import WorkerInventory, WorkerView
from muster.store.engine import Database
from muster.store.models import (
    Artifact,
    Condition,
    Event,
    GangEpoch,
    Job,
    LogLine,
    Member,
    ProbeResult,
    Worker,
)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class LogLineIn:
    """One captured line as an agent sends it."""

    origin: str  # "rank" (a global rank's stdout/stderr) or "node" (torchrun's own lines)
    rank: int  # the global rank, or the node rank for origin "node"
    seq: int  # per (origin, rank), increasing
    time: float  # seconds since the epoch, as time.time() gives
    stream: str  # stdout | stderr
    text: str


class Store:
    """muster's durable state, over SQLite or PostgreSQL."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # ---- workers -------------------------------------------------------------------------

    def upsert_worker(self, inv: WorkerInventory, now: datetime | None = None) -> Worker:
        """Record an agent's inventory; a new or returning worker becomes idle."""
        now = now or utcnow()
        with self.db.transaction() as s:
            row = s.get(Worker, inv.id)
            data = inv.model_dump(mode="json")
            if row is None:
                row = Worker(
                    id=inv.id,
                    hostname=inv.hostname,
                    advertise_address=inv.advertise_address,
                    inventory=data,
                    state=WorkerState.IDLE.value,
                    joined_at=now,
                    last_seen=now,
                )
                s.add(row)
                _event(s, "WorkerJoined", f"worker {inv.id} ({inv.hostname}) joined", worker=inv.id)
            else:
                row.hostname, row.advertise_address = inv.hostname, inv.advertise_address
                row.inventory, row.last_seen = data, now
                if row.state == WorkerState.OFFLINE.value:
                    row.state = WorkerState.IDLE.value
                    _event(s, "WorkerReturned", f"worker {inv.id} is back", worker=inv.id)
            return row

    def set_worker_state(self, worker_id: str, state: WorkerState) -> None:
        with self.db.transaction() as s:
            row = s.get(Worker, worker_id)
            if row is None:
                raise NotFound(f"worker {worker_id!r} does not exist; see `muster get workers`")
            row.state = state.value
            if state in (WorkerState.IDLE, WorkerState.OFFLINE):
                row.job_id = None

    def workers(self) -> list[WorkerView]:
        """The scheduler's snapshot: every worker's inventory and state."""
        with self.db.transaction() as s:
            rows = s.scalars(select(Worker).order_by(Worker.id)).all()
            return [
                WorkerView(
                    inventory=WorkerInventory.model_validate(r.inventory, strict=False),
                    state=WorkerState(r.state),
                )
                for r in rows
            ]

    def worker(self, worker_id: str) -> Worker:
        with self.db.transaction() as s:
            row = s.get(Worker, worker_id)
            if row is None:
                raise NotFound(f"worker {worker_id!r} does not exist; see `muster get workers`")
            return row

    # ---- jobs ----------------------------------------------------------------------------

    def submit_job(
        self, spec: JobSpec | dict[str, Any], *, bundle_sha256: str | None = None
    ) -> Job:
        """Validate and queue a job. An invalid spec raises SpecError and stores nothing."""
        checked = parse_job(spec)
        now = utcnow()
        with self.db.transaction() as s:
            job = Job(
                id=f"{checked.name}-{secrets.token_hex(3)}",
                name=checked.name,
                spec=checked.model_dump(mode="json"),
                state=JobState.QUEUED.value,
                priority=checked.priority,
                bundle_sha256=bundle_sha256,
                submitted_at=now,
            )
            s.add(job)
            s.flush()
            _event(s, "Submitted", f"job {job.id} queued", job=job.id)
            return job

    def job(self, job_id: str) -> Job:
        with self.db.transaction() as s:
            return _job(s, job_id)

    def jobs(self, states: Iterable[JobState] | None = None) -> list[Job]:
        """Jobs in submission order, optionally only those in ``states``."""
        with self.db.transaction() as s:
            query = select(Job).order_by(Job.seq)
            if states is not None:
                query = query.where(Job.state.in_([st.value for st in states]))
            return list(s.scalars(query).all())

    def job_spec(self, job: Job) -> JobSpec:
        return JobSpec.model_validate(job.spec, strict=False)

    def set_job_state(self, job_id: str, new: JobState, message: str = "") -> Job:
        """Move a job along its lifecycle; illegal moves raise IllegalTransition."""
        now = utcnow()
        with self.db.transaction() as s:
            job = _job(s, job_id, lock=True)
            check_job_transition(JobState(job.state), new)
            job.state = new.value
            if new is JobState.RUNNING:
                job.started_at = now
            if new.is_terminal:
                job.finished_at = now
                s.execute(
                    update(Worker)
                    .where(Worker.job_id == job_id)
                    .values(state=WorkerState.IDLE.value, job_id=None)
                )
            if new is JobState.FAILED and message:
                job.root_cause = message
            _event(s, f"Job{new.value.capitalize()}", message or f"job is {new.value}", job=job_id)
            return job

    def set_why_pending(self, job_id: str, reason: str | None) -> None:
        with self.db.transaction() as s:
            job = _job(s, job_id)
            if job.why_pending != reason:
                job.why_pending = reason
                if reason:
                    _event(s, "Unplaceable", reason, job=job_id)

    # ---- placement -----------------------------------------------------------------------

    def reserve_placement(
        self, job_id: str, worker_ids: Sequence[str], path_class: str
    ) -> GangEpoch:
        """Take the gang's workers and open a new epoch, all in one transaction.

        ``worker_ids[r]`` becomes node rank r. Raises PlacementConflict, changing nothing,
        when the job is no longer queued or any worker is no longer idle.
        """
        if len(set(worker_ids)) != len(worker_ids):
            raise BadRequest(f"a gang needs distinct workers, got {list(worker_ids)}")
        now = utcnow()
        with self.db.transaction() as s:
            job = _job(s, job_id, lock=True)
            if job.state != JobState.QUEUED.value:
                raise PlacementConflict(f"job {job_id} is {job.state}, not queued")
            # Lock the rows in one global order first, so racing reservations queue on
            # PostgreSQL instead of deadlocking (SQLite already serializes writers).
            s.execute(
                select(Worker.id)
                .where(Worker.id.in_(worker_ids))
                .order_by(Worker.id)
                .with_for_update()
            ).all()
            taken = s.execute(
                update(Worker)
                .where(Worker.id.in_(worker_ids), Worker.state == WorkerState.IDLE.value)
                .values(state=WorkerState.RESERVED.value, job_id=job_id)
                .execution_options(synchronize_session=False)
            )
            if taken.rowcount != len(worker_ids):  # type: ignore[attr-defined]
                raise PlacementConflict(
                    f"job {job_id}: only {taken.rowcount} of {len(worker_ids)} "  # type: ignore[attr-defined]
                    "workers were still idle; the scheduler will try again"
                )
            last = s.scalar(select(func.max(GangEpoch.number)).where(GangEpoch.job_id == job_id))
            epoch = GangEpoch(
                job_id=job_id, number=(last or 0) + 1, path_class=path_class, created_at=now
            )
            s.add(epoch)
            s.flush()
            workers = {w.id: w for w in s.scalars(select(Worker).where(Worker.id.in_(worker_ids)))}
            for rank, wid in enumerate(worker_ids):
                s.add(
                    Member(
                        epoch_id=epoch.id,
                        job_id=job_id,
                        node_rank=rank,
                        worker_id=wid,
                        state=MemberState.PENDING.value,
                        advertise_address=workers[wid].advertise_address,
                    )
                )
            job.state, job.path_class, job.why_pending = JobState.PLACING.value, path_class, None
            _event(
                s,
                "Placed",
                f"epoch {epoch.number}: {len(worker_ids)} workers on the {path_class} path: "
                + ", ".join(f"node{r}={w}" for r, w in enumerate(worker_ids)),
                job=job_id,
                data={"epoch": epoch.number, "workers": list(worker_ids), "path": path_class},
            )
            return epoch

    def members(self, job_id: str, epoch_number: int | None = None) -> list[Member]:
        """The members of the job's latest (or given) epoch, by node rank."""
        with self.db.transaction() as s:
            query = select(GangEpoch).where(GangEpoch.job_id == job_id)
            if epoch_number is not None:
                query = query.where(GangEpoch.number == epoch_number)
            epoch = s.scalars(query.order_by(GangEpoch.number.desc()).limit(1)).first()
            if epoch is None:
                return []
            return list(
                s.scalars(
                    select(Member).where(Member.epoch_id == epoch.id).order_by(Member.node_rank)
                )
            )

    # ---- events, conditions --------------------------------------------------------------

    def record_event(
        self,
        kind: str,
        message: str,
        *,
        job: str | None = None,
        worker: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        with self.db.transaction() as s:
            _event(s, kind, message, job=job, worker=worker, data=data)

    def events(self, job_id: str | None = None) -> list[Event]:
        with self.db.transaction() as s:
            query = select(Event).order_by(Event.id)
            if job_id is not None:
                query = query.where(Event.job_id == job_id)
            return list(s.scalars(query))

    def set_condition(
        self, job_id: str, type_: str, status: bool | None, reason: str, message: str
    ) -> None:
        text = "Unknown" if status is None else str(status)
        with self.db.transaction() as s:
            row = s.get(Condition, (job_id, type_))
            if row is None:
                s.add(
                    Condition(
                        job_id=job_id,
                        type=type_,
                        status=text,
                        reason=reason,
                        message=message,
                        last_transition=utcnow(),
                    )
                )
            else:
                if row.status != text:
                    row.last_transition = utcnow()
                row.status, row.reason, row.message = text, reason, message

    def conditions(self, job_id: str) -> list[Condition]:
        with self.db.transaction() as s:
            return list(
                s.scalars(
                    select(Condition).where(Condition.job_id == job_id).order_by(Condition.type)
                )
            )

    # ---- logs ----------------------------------------------------------------------------

    def append_logs(self, job_id: str, lines: Sequence[LogLineIn]) -> int:
        """Store a batch of lines in one transaction; returns how many were new.

        A line already stored (same job, origin, rank, seq) is skipped, so an agent may
        resend a batch it is unsure of. This is the hot path of log ingest, so it talks to
        the driver directly: executemany on SQLite, one unnest() statement on PostgreSQL.
        """
        if not lines:
            return 0
        with self.db.transaction() as s:
            conn = s.connection()
            if self.db.dialect == "postgresql":
                result = conn.exec_driver_sql(
                    _PG_INSERT_LINES,
                    (
                        job_id,
                        [ln.origin for ln in lines],
                        [ln.rank for ln in lines],
                        [ln.seq for ln in lines],
                        [int(ln.time * 1e6) for ln in lines],
                        [ln.stream for ln in lines],
                        [ln.text for ln in lines],
                    ),
                )
            else:
                result = conn.exec_driver_sql(
                    _SQLITE_INSERT_LINES,
                    [
                        (
                            job_id,
                            ln.origin,
                            ln.rank,
                            ln.seq,
                            int(ln.time * 1e6),
                            ln.stream,
                            ln.text,
                        )
                        for ln in lines
                    ],
                )
            return max(result.rowcount, 0)

    def logs(
        self,
        job_id: str,
        *,
        rank: int | None = None,
        origin: str = "rank",
        after: int = 0,
        limit: int | None = None,
    ) -> list[LogLine]:
        """Lines of one job in (rank, seq) order; ``after`` skips seq <= after."""
        with self.db.transaction() as s:
            query = select(LogLine).where(LogLine.job_id == job_id, LogLine.origin == origin)
            if rank is not None:
                query = query.where(LogLine.rank == rank)
            if after:
                query = query.where(LogLine.seq > after)
            query = query.order_by(LogLine.time_us, LogLine.rank, LogLine.seq)
            if limit is not None:
                query = query.limit(limit)
            return list(s.scalars(query))

    # ---- artifacts, probe ----------------------------------------------------------------

    def add_artifact(self, job_id: str, node_rank: int, path: str, size: int, sha256: str) -> None:
        with self.db.transaction() as s:
            s.merge(
                Artifact(
                    job_id=job_id,
                    node_rank=node_rank,
                    path=path,
                    size=size,
                    sha256=sha256,
                    stored_at=utcnow(),
                )
            )

    def artifacts(self, job_id: str) -> list[Artifact]:
        with self.db.transaction() as s:
            query = select(Artifact).where(Artifact.job_id == job_id)
            return list(s.scalars(query.order_by(Artifact.node_rank, Artifact.path)))

    def add_probe_result(self, result: ProbeResult) -> None:
        with self.db.transaction() as s:
            s.add(result)


_SQLITE_INSERT_LINES = (
    "INSERT INTO log_lines (job_id, origin, rank, seq, time_us, stream, text) "
    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
)
_PG_INSERT_LINES = (
    "INSERT INTO log_lines (job_id, origin, rank, seq, time_us, stream, text) "
    "SELECT %s, * FROM unnest(%s::varchar[], %s::int[], %s::bigint[], %s::bigint[], "
    "%s::varchar[], %s::text[]) ON CONFLICT DO NOTHING"
)


def _job(s: Session, job_id: str, lock: bool = False) -> Job:
    query = select(Job).where(Job.id == job_id)
    if lock:
        query = query.with_for_update()
    job = s.scalars(query).first()
    if job is None:
        raise NotFound(f"job {job_id!r} does not exist; see `muster get jobs`")
    return job


def _event(
    s: Session,
    kind: str,
    message: str,
    *,
    job: str | None = None,
    worker: str | None = None,
    data: dict[str, Any] | None = None,
) -> None:
    s.add(
        Event(
            job_id=job, worker_id=worker, time=utcnow(), kind=kind, message=message, data=data or {}
        )
    )
