"""The value ``step`` reads and returns: one gang run (one epoch), and its phases.

Phases of a gang run (the job state, with the rendezvous split where gating needs it)::

    unplaced ─Placed─► rendezvous ─PortPublished(node 0)─► starting ─all started─► running
                           │                                  │                     │
                           └──────────────────────────────────┴─────────────────────┤
                                                     first failure, loss, timeout   │
                                                     ──► failed       Cancel ──► cancelled
                                 every member exited 0 and its outputs stored ──► succeeded
    rendezvous (networking included) or starting, while no member is assigned yet
                           ─network failed, or a member lost─► fenced (the job is queued
                           for its next epoch)

A terminal run still tracks its members until each worker is released (``settled``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, TypeVar

from muster.errors import BadRequest
from muster.spec import JobState, MemberState, PathClass


class GangPhase(str, Enum):
    UNPLACED = "unplaced"
    RENDEZVOUS = "rendezvous"  # waiting for node 0's port
    STARTING = "starting"  # port published: members assigned (node 0 first), starting
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    FENCED = "fenced"  # the epoch ended before any rank started; the job is queued again

    @property
    def is_terminal(self) -> bool:
        return self in GANG_TERMINAL


GANG_TERMINAL = frozenset(
    {GangPhase.SUCCEEDED, GangPhase.FAILED, GangPhase.CANCELLED, GangPhase.FENCED}
)

_P = GangPhase
GANG_TRANSITIONS: dict[GangPhase, frozenset[GangPhase]] = {
    _P.UNPLACED: frozenset({_P.RENDEZVOUS}),
    _P.RENDEZVOUS: frozenset({_P.STARTING, _P.FAILED, _P.CANCELLED, _P.FENCED}),
    _P.STARTING: frozenset({_P.RUNNING, _P.FAILED, _P.CANCELLED, _P.FENCED}),
    _P.RUNNING: frozenset({_P.SUCCEEDED, _P.FAILED, _P.CANCELLED}),
    _P.SUCCEEDED: frozenset(),
    _P.FAILED: frozenset(),
    _P.CANCELLED: frozenset(),
    _P.FENCED: frozenset(),
}

_PHASE_OF_TERMINAL = {
    JobState.SUCCEEDED: GangPhase.SUCCEEDED,
    JobState.FAILED: GangPhase.FAILED,
    JobState.CANCELLED: GangPhase.CANCELLED,
}


@dataclass(frozen=True)
class Member:
    """One node rank of the run, as far as the controller knows it."""

    node: int
    worker: str
    state: MemberState = MemberState.PENDING
    assigned: bool = False  # ASSIGN was sent: from now on processes may exist
    started: bool = False  # MEMBER_STARTED seen (or implied by an exit 0 or an alive report)
    exit_code: int | None = None
    gone: bool = False  # no process left: its exit was reported, or its agent holds nothing
    outputs: bool | None = None  # None: not reported; True: stored; False: upload failed
    released: bool = False  # ReleaseWorker was decided
    lost: bool = False  # its link is down and has not come back
    unconfirmed: bool = False  # after a controller restart, until its agent's LinkBack
    networked: bool = False  # NET_SETUP was sent: a device of this run may exist on its worker
    net_key: tuple[str, str] | None = None  # (public key, endpoint) from its NET_READY
    mtu: int | None = None  # the MTU its direct-path device took, from its NET_READY
    hung: bool = False  # its ranks are silent and idle (HUNG), until it says otherwise
    ranks: tuple[int, int] | None = None  # its first and last global rank (from HUNG)
    net_up: bool = False  # NET_UP: its device knows every peer
    probing: bool = False  # PROBE_LISTEN was sent: a probe endpoint may be open on its worker
    probe_port: int | None = None  # PROBE_READY: where it listens for its peers' probes
    probed: tuple[object, ...] | None = None  # the pairs it measured (ProbePair), so far
    lost_peers: tuple[int, ...] = ()  # NET_PATH: peers it hears nothing from (direct path)
    checked: tuple[str | None, str | None] | None = None  # MASTER_CHECKED: (torch, nccl)
    holding: bool = False  # PREPARE_RENDEZVOUS was sent: node 0's agent may hold the port

    @property
    def may_be_alive(self) -> bool:
        """A process of this member may still exist on its worker."""
        return self.assigned and not self.gone


@dataclass(frozen=True)
class MemberSnapshot:
    """One member as the store holds it, for ``GangRun.restore`` after a restart."""

    worker: str
    state: MemberState
    exit_code: int | None = None
    outputs: bool | None = None
    released: bool = False  # the worker no longer belongs to this job
    assigned: bool | None = None  # ASSIGN was sent (the store's assigned_at); None: from state


@dataclass(frozen=True)
class ProbeFailure:
    """A pair the probe found wanting: why, and what the next epoch does about it."""

    cause: str
    pair: tuple[int, int]  # (node, peer)
    reason: str  # the NetworkQualified reason: ProbeFailed or PathNotDirect
    smaller: bool = False  # stalled above 1280 on the direct path: try 1280, keep it together


@dataclass(frozen=True)
class GangRun:
    """One epoch of one job's gang. ``GangRun()`` is the run before ``Placed``."""

    job: str = ""
    epoch: int = 0
    path: PathClass | None = None
    members: tuple[Member, ...] = ()
    job_state: JobState = JobState.PLACING
    reason: str = ""  # the message of the last job move; a terminal run's STOP reason
    master_addr: str | None = None  # planned for node 0 (PREPARE_RENDEZVOUS)
    port: int | None = None  # the spec's rendezvous port
    published: tuple[str, int] | None = None  # node 0's addr:port
    checking: tuple[str, int] | None = None  # node 0's addr:port, while every member dials it
    check_sent: bool = False  # MASTER_CHECK went to every member
    timeout: int | None = None
    deadline: float | None = None  # job timeout, on step's clock
    grace_deadline: float | None = None  # set by ControllerRestarted
    rendezvous_deadline: float | None = None  # node 0 must publish its port by then
    probe_seconds: float | None = None  # None: this run does not probe
    probe_round: int = -1  # the round of disjoint pairs under way (network.probe_rounds)
    probe_pending: frozenset[int] = frozenset()  # nodes whose PROBE_DONE of it is awaited
    # The round's failed pairs so far: the epoch is fenced once the round's reports are in,
    # with every failed pair at once (not one pair an epoch).
    probe_failed: tuple[ProbeFailure, ...] = ()
    fenced: bool = False  # the epoch ended before any rank started; the job is queued again
    spare_epochs: int = 0  # Placed's: network epochs beyond MAX_NETWORK_EPOCHS
    # NetworkDegraded: some running pair lost its direct path (None: not known, after a
    # controller restart, until the agents say their paths again)
    degraded: bool | None = False
    fail_on_hang: bool = False  # spec.on_hang: "fail"
    hang_timeout: int | None = None  # spec.hang_timeout
    hung: bool = False  # the Hung condition is raised
    hang_episode: int = 0  # how many times it was raised (a late capture is told apart)
    hang_fail_at: float | None = None  # on_hang "fail": fail then, or once the stacks are in
    hang_message: str = ""  # what the Hung condition said

    @classmethod
    def placed(
        cls,
        job: str,
        epoch: int,
        workers: Sequence[str],
        path: PathClass,
    ) -> GangRun:
        """A run with fresh pending members; raises BadRequest on an empty or repeated gang."""
        if not workers or len(set(workers)) != len(workers):
            raise BadRequest(f"a gang needs one or more distinct workers, got {list(workers)}")
        members = tuple(Member(node, worker) for node, worker in enumerate(workers))
        return cls(job=job, epoch=epoch, path=path, members=members)

    @classmethod
    def restore(
        cls,
        job: str,
        epoch: int,
        path: PathClass,
        job_state: JobState,
        members: Sequence[MemberSnapshot],
        *,
        reason: str = "",
        master_addr: str | None = None,
        port: int | None = None,
        published: tuple[str, int] | None = None,
        timeout: int | None = None,
        deadline: float | None = None,
    ) -> GangRun:
        """Rebuild a run from the store; step ``ControllerRestarted`` on it next."""
        if not members or len({m.worker for m in members}) != len(members):
            raise BadRequest(f"job {job} epoch {epoch}: the store holds no distinct members")
        rebuilt = []
        for node, snap in enumerate(members):
            assigned = snap.state is not MemberState.PENDING
            if snap.assigned is not None:
                assigned = snap.assigned
            gone = snap.exit_code is not None or (snap.released and assigned)
            rebuilt.append(
                Member(
                    node=node,
                    worker=snap.worker,
                    state=snap.state,
                    assigned=assigned,
                    started=snap.state in (MemberState.STARTING, MemberState.RUNNING)
                    or snap.exit_code is not None,
                    exit_code=snap.exit_code,
                    gone=gone,
                    outputs=snap.outputs,
                    released=snap.released,
                )
            )
        return cls(
            job=job,
            epoch=epoch,
            path=path,
            members=tuple(rebuilt),
            job_state=job_state,
            reason=reason,
            master_addr=master_addr,
            port=port,
            published=published,
            timeout=timeout,
            deadline=deadline,
        )

    # ---- views -------------------------------------------------------------------------

    @property
    def phase(self) -> GangPhase:
        if not self.members:
            return GangPhase.UNPLACED
        if self.fenced:
            return GangPhase.FENCED
        if self.job_state in _PHASE_OF_TERMINAL:
            return _PHASE_OF_TERMINAL[self.job_state]
        if self.job_state is JobState.RUNNING:
            return GangPhase.RUNNING
        return GangPhase.STARTING if self.published is not None else GangPhase.RENDEZVOUS

    @property
    def is_over(self) -> bool:
        """The job is terminal, or this epoch was fenced; members may still be stopping."""
        return self.fenced or self.job_state.is_terminal

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(m.worker for m in self.members)

    def node_of(self, worker: str) -> int | None:
        for member in self.members:
            if member.worker == worker:
                return member.node
        return None

    def must_stop(self, worker: str) -> bool:
        """The worker holds a member of this ended job that may still run (HEARTBEAT_ACK)."""
        node = self.node_of(worker)
        return self.is_over and node is not None and self.members[node].may_be_alive

    @property
    def settled(self) -> bool:
        """The job is over and every worker was released: the controller may forget the run."""
        return self.is_over and all(m.released for m in self.members)


_FIELDS: dict[type, frozenset[str]] = {}

_Frozen = TypeVar("_Frozen", GangRun, Member)


def replace(obj: _Frozen, **changes: Any) -> _Frozen:
    """``dataclasses.replace`` for these frozen records, without re-running ``__init__``
    over every field: a step replaces the run several times, for every frame of a busy
    controller (it was a tenth of the event loop). Unknown names raise as replace does."""
    known = _FIELDS.get(type(obj))
    if known is None:
        known = _FIELDS[type(obj)] = frozenset(f.name for f in fields(obj))
    if not changes.keys() <= known:
        raise TypeError(f"{type(obj).__name__} has no field {sorted(changes.keys() - known)}")
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new
