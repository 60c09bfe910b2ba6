"""What ``step`` is told: frames from the agents' links, the clock, the API, a restart.

Every event names members by node rank (the frame's ``node_rank``) or links by worker id;
the controller has already checked that the frame is for this job and epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from muster.spec import MESH_INTERFACE, PathClass


@dataclass(frozen=True)
class Placed:
    """The scheduler reserved the gang (``workers[r]`` is node rank r) and opened ``epoch``."""

    job: str
    epoch: int
    workers: tuple[str, ...]
    path: PathClass
    port: int | None = None  # the spec's rendezvous port; None: node 0 picks a free one
    timeout: int | None = None  # spec.timeout in seconds; None: no limit
    master_addr: str | None = None  # the address planned for node 0, passed on in PREPARE
    probe_seconds: float | None = None  # the probe's throughput sample; None: no probe
    fail_on_hang: bool = False  # spec.on_hang == "fail"
    hang_timeout: int | None = None  # spec.hang_timeout (for the Hung condition's message)
    # Network epochs the job may take beyond MAX_NETWORK_EPOCHS: 1 once an epoch was fenced
    # for its packets' size alone (that fence is the path's, not a failure of the job's).
    spare_epochs: int = 0


@dataclass(frozen=True)
class PortPublished:
    """RENDEZVOUS_READY: node 0 listens on ``addr:port``. From any other node it is ignored."""

    node: int
    addr: str
    port: int


@dataclass(frozen=True)
class MasterChecked:
    """MASTER_CHECKED: before any rank starts, the member reached node 0's rendezvous port
    (or ``error`` says why not; node 0 itself does not dial), and runs these versions
    (None: not known, e.g. NCCL on a CPU build)."""

    node: int
    error: str | None = None
    torch: str | None = None
    nccl: str | None = None


@dataclass(frozen=True)
class NetReady:
    """NET_READY: the member's WireGuard device is up with ``public_key``, listening on
    ``endpoint`` (host:port); or ``error`` says why it could not be made."""

    node: int
    public_key: str = ""
    endpoint: str = ""
    error: str | None = None
    silent: tuple[int, ...] = ()  # with ``error``: the peers it got no handshake from
    shim_not_loaded: bool = False  # relayed: the job's launcher ignores the preloaded shim
    mtu: int | None = None  # direct: the MTU its device took (the gang's, or its uplink's less)


@dataclass(frozen=True)
class NetUp:
    """NET_UP: the member's device knows every peer of the gang."""

    node: int


@dataclass(frozen=True)
class ProbePair:
    """One pair as its lower node measured it (``node`` is the peer)."""

    node: int
    connects: int
    rtt_ms: float | None = None
    gbps: float | None = None
    error: str | None = None
    via: str | None = None  # the interface its traffic left by (None: not known)
    endpoint: str | None = None  # on the direct path, the peer's WireGuard endpoint


@dataclass(frozen=True)
class ProbeReady:
    """PROBE_READY: the member listens for its peers' probes on ``port`` (or ``error``)."""

    node: int
    port: int = 0
    error: str | None = None


@dataclass(frozen=True)
class ProbeDone:
    """PROBE_DONE: what the member measured to each peer after it."""

    node: int
    pairs: tuple[ProbePair, ...] = ()
    device: str = MESH_INTERFACE  # the member's own WireGuard device (direct path)


@dataclass(frozen=True)
class NetPath:
    """NET_PATH: while the member runs on the direct path, the peers (nodes) it has heard
    nothing from for a while; empty once every peer is heard again."""

    node: int
    lost: tuple[int, ...] = ()


@dataclass(frozen=True)
class MemberHung:
    """HUNG: the member's ranks printed nothing and used no CPU for the job's hang_timeout
    (``hung``), or are active again."""

    node: int
    hung: bool
    ranks: tuple[int, int] = (0, 0)  # the member's first and last global rank
    silent_s: int = 0


@dataclass(frozen=True)
class StacksCaptured:
    """The stacks CaptureStacks asked for (in hang ``episode``) are in the job's events, or
    could not be read."""

    episode: int = 0


@dataclass(frozen=True)
class MemberStarted:
    """MEMBER_STARTED: the member's torchrun is running."""

    node: int


@dataclass(frozen=True)
class MemberExited:
    """MEMBER_EXITED: every process of the member is gone; the root-cause details come along."""

    node: int
    exit_code: int
    signal: str | None = None
    failed_rank: int | None = None  # the global rank torchrun blamed first
    failed_exit: int | None = None  # that rank's exit code
    tail: tuple[str, ...] = ()  # its last lines (or torchrun's)


@dataclass(frozen=True)
class OutputsStored:
    """ARTIFACTS_DONE: the member's output dir was uploaded (``ok``), or these files failed."""

    node: int
    ok: bool
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class LinkLost:
    """The worker's control link closed or went silent: its members are lost."""

    worker: str
    why: str


@dataclass(frozen=True)
class MemberReport:
    """What a re-dialled agent says of one member it holds: alive, or the exit it saw."""

    job: str
    epoch: int
    node: int
    exit_code: int | None = None  # None: its processes are still alive
    signal: str | None = None
    last_log_seq: int | None = None  # for the controller's log ingest; step does not use it


@dataclass(frozen=True)
class LinkBack:
    """The worker dialled in again; ``members`` is every member it still holds (any job).

    A member of this run missing from ``members`` has no process left on that machine.
    """

    worker: str
    members: tuple[MemberReport, ...] = ()


@dataclass(frozen=True)
class Tick:
    """The supervision loop's clock tick: checks the job timeout and the restart grace.

    The time is ``step``'s ``now``.
    """


@dataclass(frozen=True)
class Cancel:
    """The user (or the API) cancelled the job."""

    reason: str


@dataclass(frozen=True)
class ControllerRestarted:
    """The run was rebuilt from the store after a restart (see ``GangRun.restore``).

    Every member that may still run is unconfirmed until its agent's ``LinkBack``; one still
    unconfirmed at ``grace_deadline`` (``step``'s clock) fails the job.
    """

    grace_deadline: float


Event: TypeAlias = (
    Placed
    | NetReady
    | NetUp
    | ProbeReady
    | MasterChecked
    | ProbeDone
    | NetPath
    | MemberHung
    | StacksCaptured
    | PortPublished
    | MemberStarted
    | MemberExited
    | OutputsStored
    | LinkLost
    | LinkBack
    | Tick
    | Cancel
    | ControllerRestarted
)
