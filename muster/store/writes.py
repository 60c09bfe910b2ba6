"""Many small writes in one transaction: the controller's group commit.

The gang lifecycle decides a handful of store writes per event (a member's state, an event,
a worker released). Applied one transaction each, a busy controller spends its time
committing; ``apply_writes`` takes whatever has queued up, from any number of runs, and
applies it in order in one transaction. A write the state tables refuse (the store moved
first, say a cancel) is skipped and reported; it never undoes the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from sqlalchemy import Connection

from muster.errors import IllegalTransition, NotFound
from muster.spec.states import JobState, MemberState, WorkerState
from muster.store import hot
from muster.store.base import Repository


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


@dataclass(frozen=True)
class InventoryWrite:
    """An agent's inventory (WorkerInventory as JSON) and what its worker is free for;
    see ``WorkerRepository.upsert_worker``."""

    inventory: dict[str, Any]
    held_by: str | None = None
    draining: bool = False


@dataclass(frozen=True)
class ConditionWrite:
    job: str
    type: str
    status: bool | None
    reason: str
    message: str


@dataclass(frozen=True)
class WhyPendingWrite:
    """Queued jobs' why_pending, written where it changed (``hot.why_pending``); ``quiet``:
    jobs whose reason's kind was announced before (no second Unplaceable event for it)."""

    reasons: Mapping[str, str | None]
    quiet: frozenset[str] = frozenset()


Write: TypeAlias = (
    JobStateWrite
    | MemberStateWrite
    | EventWrite
    | ReleaseWrite
    | RendezvousWrite
    | WorkerStateWrite
    | InventoryWrite
    | ConditionWrite
    | WhyPendingWrite
)


class WriteRepository(Repository):
    def apply_writes(self, writes: Sequence[Write]) -> list[str]:
        """Apply ``writes`` in order, in one transaction; returns why any were skipped.

        Each write checks before it changes anything, so a refused one leaves nothing
        behind and the others stand. Statements go through ``store.hot`` (Core, no ORM):
        this is the busiest transaction of a busy controller.
        """
        skipped: list[str] = []
        events: list[dict[str, Any]] = []
        with self.db.transaction() as s:
            conn = s.connection()
            members = hot.MemberStates(
                conn, {w.job for w in writes if isinstance(w, MemberStateWrite)}
            )
            busy = {  # the workers a member's RUNNING makes busy
                members.now[(w.job, w.node)].worker_id
                for w in writes
                if isinstance(w, MemberStateWrite)
                and w.state is MemberState.RUNNING
                and (w.job, w.node) in members.now
            }
            # Every worker row of the batch read (and on PostgreSQL locked) in one statement,
            # in id order as reservations lock theirs: two reads could deadlock with one.
            workers = hot.WorkerStates(conn, _workers_of(writes) | busy)
            members.workers = workers
            for write in writes:
                try:
                    _apply(conn, members, workers, write, events)
                except (IllegalTransition, NotFound) as exc:
                    skipped.append(f"{type(write).__name__}: {exc}")
            members.write()
            workers.write()
            hot.insert_events(conn, events)  # in the order the writes made them
        return skipped


def _workers_of(writes: Sequence[Write]) -> set[str]:
    """The workers a batch's worker writes name (its RUNNING members' are added after)."""
    ids: set[str] = set()
    for write in writes:
        if isinstance(write, (ReleaseWrite, WorkerStateWrite)):
            ids.add(write.worker)
        elif isinstance(write, InventoryWrite):
            ids.add(str(write.inventory["id"]))
    return ids


def _apply(
    conn: Connection,
    members: hot.MemberStates,
    workers: hot.WorkerStates,
    write: Write,
    events: list[dict[str, Any]],
) -> None:
    if isinstance(write, MemberStateWrite):
        members.move(
            write.job,
            write.node,
            write.state,
            exit_code=write.exit_code,
            signal=write.signal,
            path_address=write.path_address,
        )
    elif isinstance(write, EventWrite):
        events.append(
            hot.event_row(
                write.kind, write.message, job=write.job, worker=write.worker, data=write.data
            )
        )
    elif isinstance(write, JobStateWrite):
        hot.job_state(conn, write.job, write.state, write.reason, events)
    elif isinstance(write, ReleaseWrite):
        workers.release(write.worker, write.job)
    elif isinstance(write, RendezvousWrite):
        hot.rendezvous(conn, write.job, write.epoch, write.addr, write.port)
    elif isinstance(write, ConditionWrite):
        hot.set_condition(conn, write.job, write.type, write.status, write.reason, write.message)
    elif isinstance(write, WhyPendingWrite):
        hot.why_pending(conn, write.reasons, events, write.quiet)
    elif isinstance(write, InventoryWrite):
        workers.upsert(write.inventory, write.held_by, write.draining, events)
    else:
        workers.set_state(write.worker, write.state)
