"""Many small writes in one transaction: the controller's group commit.

The gang lifecycle decides a handful of store writes per event (a member's state, an event,
a worker released). Applied one transaction each, a busy controller spends its time
committing; ``apply_writes`` takes whatever has queued up, from any number of runs, and
applies it in order in one transaction. A write the state tables refuse (the store moved
first, say a cancel) is skipped and reported; it never undoes the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from sqlalchemy import insert, select, update
from sqlalchemy.exc import NoResultFound
from sqlalchemy.orm import Session

from muster.errors import IllegalTransition, NotFound
from muster.spec.states import JobState, MemberState, WorkerState, check_member_transition
from muster.store.base import Repository, add_event, utcnow
from muster.store.jobs import _release, job_state_in, rendezvous_in
from muster.store.models import Event, GangEpoch, Member, Worker


@dataclass(frozen=True)
class JobStateWrite:
    job: str
    state: JobState
    reason: str = ""


@dataclass(frozen=True)
class MemberStateWrite:
    job: str
    node: int
    state: MemberState
    exit_code: int | None = None
    signal: str | None = None
    path_address: str | None = None


@dataclass(frozen=True)
class EventWrite:
    kind: str
    message: str
    job: str | None = None
    worker: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReleaseWrite:
    """The worker back to idle, if it is still held for ``job``."""

    worker: str
    job: str


@dataclass(frozen=True)
class RendezvousWrite:
    job: str
    epoch: int
    addr: str
    port: int


@dataclass(frozen=True)
class WorkerStateWrite:
    worker: str
    state: WorkerState


Write: TypeAlias = (
    JobStateWrite
    | MemberStateWrite
    | EventWrite
    | ReleaseWrite
    | RendezvousWrite
    | WorkerStateWrite
)


def apply_write(s: Session, write: Write, events: list[dict[str, Any]] | None = None) -> None:
    """One write; events go to ``events`` (inserted together by the caller) when given."""
    if isinstance(write, JobStateWrite):
        job_state_in(s, write.job, write.state, write.reason)
    elif isinstance(write, MemberStateWrite):
        _member_state(s, write)
    elif isinstance(write, EventWrite):
        if events is None:
            add_event(
                s, write.kind, write.message, job=write.job, worker=write.worker, data=write.data
            )
        else:
            events.append(
                {
                    "job_id": write.job,
                    "worker_id": write.worker,
                    "time": utcnow(),
                    "kind": write.kind,
                    "message": write.message,
                    "data": write.data,
                }
            )
    elif isinstance(write, ReleaseWrite):
        _release(s, write.worker, write.job)
    elif isinstance(write, RendezvousWrite):
        rendezvous_in(s, write.job, write.epoch, write.addr, write.port)
    else:
        row = s.get(Worker, write.worker)
        if row is not None:
            row.state = write.state.value
            if write.state in (WorkerState.IDLE, WorkerState.OFFLINE):
                row.job_id = None


def _member_state(s: Session, write: MemberStateWrite) -> None:
    """``member_state_in`` in plain SQL (no ORM object, no flush): the hot write of a busy
    controller. The same rules: a terminal member stays; the move must be in the table."""
    row = s.execute(
        select(Member.id, Member.state, Member.worker_id)
        .join(GangEpoch, Member.epoch_id == GangEpoch.id)
        .where(Member.job_id == write.job, Member.node_rank == write.node)
        .order_by(GangEpoch.number.desc())
        .limit(1)
    ).one()
    current = MemberState(row.state)
    if current.is_terminal:
        return
    check_member_transition(current, write.state)
    now = utcnow()
    values: dict[str, Any] = {"state": write.state.value}
    if write.exit_code is not None:
        values["exit_code"] = write.exit_code
    if write.signal is not None:
        values["signal"] = write.signal
    if write.path_address is not None:
        values["path_address"] = write.path_address
    if write.state is MemberState.ASSIGNED:
        values["assigned_at"] = now
    elif write.state is MemberState.RUNNING:
        values["started_at"] = now
        s.execute(
            update(Worker)
            .where(Worker.id == row.worker_id, Worker.job_id == write.job)
            .values(state=WorkerState.BUSY.value)
        )
    if write.state.is_terminal:
        values["finished_at"] = now
    s.execute(update(Member).where(Member.id == row.id).values(**values))


class WriteRepository(Repository):
    def apply_writes(self, writes: Sequence[Write]) -> list[str]:
        """Apply ``writes`` in order, in one transaction; returns why any were skipped."""
        skipped: list[str] = []
        events: list[dict[str, Any]] = []
        with self.db.transaction() as s:
            for write in writes:
                if isinstance(write, JobStateWrite) and events:
                    # job_state_in records its own event: the queued ones go first, in order.
                    s.execute(insert(Event), events)
                    events = []
                try:
                    # Each write checks before it changes anything, so a refused one
                    # leaves nothing behind and the others stand.
                    apply_write(s, write, events)
                except (IllegalTransition, NotFound, NoResultFound) as exc:
                    skipped.append(f"{type(write).__name__}: {exc}")
            if events:
                s.execute(insert(Event), events)
        return skipped
