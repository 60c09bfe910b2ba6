"""Lifecycles as explicit enums with terminal sets and transition tables.

Job (seed 001, DESIGN.md)::

    queued ─► placing ─► networking ─► rendezvous ─► running ─► succeeded
      │  ▲       │            │             │           │
      │  └───────┴────────────┘ (epoch fenced: placed again)
      └──────────┴────────────┴─────────────┴───────────┴──► failed | cancelled

Member (one node rank of one gang epoch)::

    pending ─► assigned ─► starting ─► running ─► succeeded
       └──────────┴───────────┴───────────┴──► failed | lost | cancelled

Worker (one agent's machine)::

    idle ◄─► reserved ─► busy ─► idle
      └──────────┴─────────┴──► offline ─► idle (the agent dials in again)
"""

from __future__ import annotations

from enum import Enum

from muster.errors import IllegalTransition


class JobState(str, Enum):
    QUEUED = "queued"
    PLACING = "placing"
    NETWORKING = "networking"
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in JOB_TERMINAL


class MemberState(str, Enum):
    PENDING = "pending"
    ASSIGNED = "assigned"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LOST = "lost"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in MEMBER_TERMINAL


class WorkerState(str, Enum):
    IDLE = "idle"
    RESERVED = "reserved"
    BUSY = "busy"
    OFFLINE = "offline"


JOB_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
MEMBER_TERMINAL = frozenset(
    {MemberState.SUCCEEDED, MemberState.FAILED, MemberState.LOST, MemberState.CANCELLED}
)

_J = JobState
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _J.QUEUED: frozenset({_J.PLACING, _J.FAILED, _J.CANCELLED}),
    _J.PLACING: frozenset({_J.NETWORKING, _J.RENDEZVOUS, _J.QUEUED, _J.FAILED, _J.CANCELLED}),
    _J.NETWORKING: frozenset({_J.RENDEZVOUS, _J.QUEUED, _J.FAILED, _J.CANCELLED}),
    _J.RENDEZVOUS: frozenset({_J.RUNNING, _J.QUEUED, _J.FAILED, _J.CANCELLED}),
    _J.RUNNING: frozenset({_J.SUCCEEDED, _J.FAILED, _J.CANCELLED}),
    _J.SUCCEEDED: frozenset(),
    _J.FAILED: frozenset(),
    _J.CANCELLED: frozenset(),
}

_M = MemberState
_M_END = frozenset({_M.FAILED, _M.LOST, _M.CANCELLED})
MEMBER_TRANSITIONS: dict[MemberState, frozenset[MemberState]] = {
    _M.PENDING: frozenset({_M.ASSIGNED}) | _M_END,
    _M.ASSIGNED: frozenset({_M.STARTING}) | _M_END,
    _M.STARTING: frozenset({_M.RUNNING}) | _M_END,
    _M.RUNNING: frozenset({_M.SUCCEEDED}) | _M_END,
    _M.SUCCEEDED: frozenset(),
    _M.FAILED: frozenset(),
    _M.LOST: frozenset(),
    _M.CANCELLED: frozenset(),
}

_W = WorkerState
WORKER_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    _W.IDLE: frozenset({_W.RESERVED, _W.OFFLINE}),
    _W.RESERVED: frozenset({_W.BUSY, _W.IDLE, _W.OFFLINE}),
    _W.BUSY: frozenset({_W.IDLE, _W.OFFLINE}),
    _W.OFFLINE: frozenset({_W.IDLE, _W.BUSY}),  # busy: back with a leftover member
}


def check_job_transition(current: JobState, new: JobState) -> None:
    """Raise IllegalTransition unless the job table allows current -> new."""
    if new not in JOB_TRANSITIONS[current]:
        raise IllegalTransition(f"job cannot move from {current.value} to {new.value}")


def check_member_transition(current: MemberState, new: MemberState) -> None:
    """Raise IllegalTransition unless the member table allows current -> new."""
    if new not in MEMBER_TRANSITIONS[current]:
        raise IllegalTransition(f"member cannot move from {current.value} to {new.value}")
