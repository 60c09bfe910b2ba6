"""What ``step`` decides; the controller applies the actions in order and decides nothing.

A ``Send*`` to a worker without a link is dropped by the controller, which then steps
``LinkLost`` for that worker (after applying the rest of the batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from muster.spec import JobState, MemberState, PathClass


@dataclass(frozen=True)
class SendPrepareRendezvous:
    """PREPARE_RENDEZVOUS to node 0: pick (or take) a port on ``addr`` and publish it."""

    worker: str
    addr: str | None
    port: int | None


@dataclass(frozen=True)
class SendMasterCheck:
    """MASTER_CHECK: dial node 0's rendezvous at ``addr:port`` (held open by node 0's agent
    until its ASSIGN; None for node 0 itself) and say the member's torch and NCCL versions."""

    node: int
    worker: str
    addr: str | None
    port: int


@dataclass(frozen=True)
class SendNetSetup:
    """NET_SETUP to a member of a direct gang: make a fresh key and device ``muster0`` with
    the member's mesh address (the controller fills it in)."""

    node: int
    worker: str


@dataclass(frozen=True)
class SendNetPeers:
    """NET_PEERS: every other member's (node, public key, endpoint), for the device."""

    node: int
    worker: str
    peers: tuple[tuple[int, str, str], ...]


@dataclass(frozen=True)
class SendProbeListen:
    """PROBE_LISTEN: open the member's probe endpoint on its path address."""

    node: int
    worker: str


@dataclass(frozen=True)
class SendProbeRun:
    """PROBE_RUN: measure each (peer node, its probe port) for ``seconds`` of throughput."""

    node: int
    worker: str
    peers: tuple[tuple[int, int], ...]
    seconds: float


@dataclass(frozen=True)
class SetCondition:
    """A Kubernetes-style condition on the job (``status`` True, False or None: Unknown)."""

    type: str
    status: bool | None
    reason: str
    message: str


@dataclass(frozen=True)
class SetRendezvous:
    """Record node 0's published ``addr:port`` on the epoch (and plan the gang's addresses)."""

    addr: str
    port: int


@dataclass(frozen=True)
class SendAssign:
    """ASSIGN to the member's worker; the controller builds the body (spec, addresses, ...)."""

    node: int
    worker: str


@dataclass(frozen=True)
class SendStop:
    """STOP: kill the member's whole process tree (or never start it)."""

    worker: str
    reason: str


@dataclass(frozen=True)
class SetJobState:
    """Move the job (always a move ``check_job_transition`` allows); ``reason`` is the message."""

    state: JobState
    reason: str


@dataclass(frozen=True)
class SetMemberState:
    """Move one member (always a move ``check_member_transition`` allows)."""

    node: int
    state: MemberState
    exit_code: int | None = None
    signal: str | None = None


@dataclass(frozen=True)
class CaptureStacks:
    """Read every running rank's stack (py-spy on the agents) into the job's events, then
    step StacksCaptured(episode)."""

    reason: str
    episode: int = 0


@dataclass(frozen=True)
class RecordEvent:
    """Append to the job's event log."""

    kind: str
    message: str
    data: dict[str, object] = field(default_factory=dict)
    worker: str | None = None


@dataclass(frozen=True)
class ReleaseWorker:
    """The worker goes back to the pool: no process of this run is left on it."""

    worker: str


@dataclass(frozen=True)
class KeepApart:
    """The job's next gangs on ``path`` must not hold both workers of any of ``pairs``
    (their network failed in this epoch)."""

    path: PathClass
    pairs: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class SmallerPackets:
    """The job's next direct gangs take the MTU that crosses any network (``mtu``): a pair
    above it connected, then stalled (a path that carries less than its links say)."""

    mtu: int


Action: TypeAlias = (
    KeepApart
    | SmallerPackets
    | CaptureStacks
    | SendProbeListen
    | SendMasterCheck
    | SendProbeRun
    | SetCondition
    | SendNetSetup
    | SendNetPeers
    | SendPrepareRendezvous
    | SetRendezvous
    | SendAssign
    | SendStop
    | SetJobState
    | SetMemberState
    | RecordEvent
    | ReleaseWorker
)
