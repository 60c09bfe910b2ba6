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

from sqlalchemy.exc import NoResultFound
from sqlalchemy.orm import Session

from muster.errors import IllegalTransition, NotFound
from muster.spec.states import JobState, MemberState, WorkerState
from muster.store.base import Repository, add_event
from muster.store.jobs import _release, job_state_in, member_state_in, rendezvous_in
from muster.store.models import Worker


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


def apply_write(s: Session, write: Write) -> None:
    if isinstance(write, JobStateWrite):
        job_state_in(s, write.job, write.state, write.reason)
    elif isinstance(write, MemberStateWrite):
        member_state_in(
            s,
            write.job,
            write.node,
            write.state,
            write.exit_code,
            write.signal,
            write.path_address,
        )
    elif isinstance(write, EventWrite):
        add_event(s, write.kind, write.message, job=write.job, worker=write.worker, data=write.data)
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


class WriteRepository(Repository):
    def apply_writes(self, writes: Sequence[Write]) -> list[str]:
        """Apply ``writes`` in order, in one transaction; returns why any were skipped."""
        skipped: list[str] = []
        with self.db.transaction() as s:
            for write in writes:
                try:
                    # Each write checks before it changes anything, so a refused one
                    # leaves nothing behind and the others stand.
                    apply_write(s, write)
                except (IllegalTransition, NotFound, NoResultFound) as exc:
                    skipped.append(f"{type(write).__name__}: {exc}")
        return skipped
