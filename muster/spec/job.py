"""The job spec: what a user writes in job.yaml or builds in Python.

The models check shape and types (unknown fields and wrong types are refused); the rules
that look at several fields at once live in ``muster.spec.rules``. Use ``parse_job`` (or
``load_job_file``) to get both: it raises ``SpecError`` listing every problem.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from muster.spec.network import NetworkClass, Transport

Device = Literal["cpu", "cuda", "mps"]
Backend = Literal["gloo", "nccl"]
Membership = Literal["pool", "window"]
StartMode = Literal["auto", "manual", "hybrid"]
OnHang = Literal["warn", "fail"]
DEFAULT_JOIN_TIMEOUT_S = 300
DEFAULT_MAX_JOIN_TIMEOUT_S = 900

# Bounds that keep a spec inside what the store's columns hold and what a rank plan can
# list: priority is a 32-bit column; a gang's plan has one entry per node.
INT32 = 2**31
MAX_WORKERS = 10_000
MAX_PROCS_PER_WORKER = 1_024
MAX_RANKS = MAX_WORKERS * MAX_PROCS_PER_WORKER

_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_duration(value: object) -> object:
    """Accept seconds (int) or '90s', '30m', '2h', '1h30m', '1d'; return seconds."""
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return int(text)
        match = _DURATION.match(text)
        if not text or match is None:
            raise ValueError(
                f"{value!r} is not a duration; write seconds or e.g. '90s', '30m', '2h'"
            )
        days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
        return ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    return value


def _duration_in_bounds(value: object) -> object:
    """parse_duration, and a duration past the bound refused in seconds and years (pydantic's
    own message would read "must be < 2147483648", no unit)."""
    seconds = parse_duration(value)
    if isinstance(seconds, int | float) and not isinstance(seconds, bool) and seconds >= INT32:
        given = "" if seconds == value else f" ({value!r})"
        raise ValueError(
            f"{seconds} s{given} is past the most a duration may be, {INT32 - 1} s (about 68 years)"
        )
    return seconds


Seconds = Annotated[int, BeforeValidator(_duration_in_bounds), Field(gt=0, lt=INT32)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Resources(_Model):
    """What each worker (node) of the job needs."""

    gpus: int = Field(default=0, ge=0, lt=INT32, description="GPUs per worker")
    device: Device | None = Field(
        default=None, description="cpu, cuda or mps; defaults to cuda when gpus > 0, else cpu"
    )

    @property
    def effective_device(self) -> Device:
        if self.device is not None:
            return self.device
        return "cuda" if self.gpus > 0 else "cpu"


class Rendezvous(_Model):
    port: int | None = Field(
        default=None, ge=1, le=65535, description="node 0's master port; a free one if unset"
    )


class JoinWindow(_Model):
    """A join window's settings (seed 003): ``distributed.window`` of a job whose membership
    is ``window``, or ``controller.join`` of a cluster file. Quorum and target count ranks."""

    quorum: int | None = Field(
        default=None,
        ge=1,
        le=MAX_RANKS,
        description="fewest ranks the run may start with [capacity]",
    )
    join_timeout: Seconds = Field(
        default=DEFAULT_JOIN_TIMEOUT_S,
        description="seconds after the window opens at which auto/hybrid form with quorum",
    )
    target_ranks: int | None = Field(
        default=None,
        ge=1,
        le=MAX_RANKS,
        description="ranks at which auto/hybrid form at once [capacity]",
    )
    max_join_timeout: Seconds = Field(
        default=DEFAULT_MAX_JOIN_TIMEOUT_S,
        description="hard cap: a window not formed by then fails",
    )
    open_admission: bool = Field(
        default=False,
        description="admit boxes without the join string (muster join --open-admission) to "
        "this window only: for a network you trust entirely",
    )
    start: StartMode = Field(
        default="auto", description="auto (the clock), manual (`muster start`), or hybrid"
    )
    named_only: bool = Field(
        default=False,
        description="admit only boxes that name this job (muster join --job), not a fleet "
        "waiting for any run (muster up sets it)",
    )


class Distributed(_Model):
    """How the job spreads over machines (seed 001)."""

    num_workers: int = Field(ge=1, le=MAX_WORKERS, description="nodes in the gang")
    procs_per_worker: int = Field(
        default=1, ge=1, le=MAX_PROCS_PER_WORKER, description="torchrun processes per node"
    )
    backend: Backend | None = Field(
        default=None, description="gloo or nccl; defaults to nccl on cuda, else gloo"
    )
    rendezvous: Rendezvous = Field(default_factory=Rendezvous, description="node 0's port")
    network: NetworkClass = Field(
        default="regional",
        description="where members may be: colocated (one provider region), regional (one "
        "region class, any provider), global (anywhere)",
    )
    transport: Transport = Field(
        default="direct",
        description="direct: private or WireGuard paths only; auto: relayed paths too",
    )
    relay_gbps: float | None = Field(
        default=None,
        gt=0,
        le=400,
        description="on the relayed path, the most the gang sends through the relays, in "
        "Gbit/s, split evenly across its members (default 1, and never more than the "
        "controller's --relay-max-gbps)",
    )
    membership: Membership = Field(
        default="pool",
        description="pool: the scheduler takes idle agents; window: whoever walks in "
        "(muster join) within the join window",
    )
    window: JoinWindow | None = Field(
        default=None, description="the join window of a window job (membership: window)"
    )
    node_procs: list[int] | None = Field(
        default=None,
        description="processes per node, in node order, where they differ: written by the "
        "controller for the world a join window formed (each box brings its own ranks)",
    )
    probe_seconds: float | None = Field(
        default=10.0,
        ge=0,
        le=60,
        description="the longest throughput sample per pair before the command starts; a "
        "sample ends sooner once its rate holds steady (0: readiness, RTT and a 16 KiB echo "
        "only; null: no probe)",
    )

    @property
    def world_size(self) -> int:
        if self.node_procs:
            return sum(self.node_procs)
        return self.num_workers * self.procs_per_worker


class JobSpec(_Model):
    """One training job. ``distributed`` absent means one worker, one process."""

    name: str = Field(description="a DNS label: lowercase letters, digits and '-', <= 63")
    entrypoint: str = Field(description="a script path (train.py) or a module (-m pkg.train)")
    args: list[str] = Field(
        default_factory=list, description="arguments after the entrypoint, as torchrun passes them"
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="environment of every rank; rank, address and NCCL interface variables are "
        "muster's own and refused here",
    )
    image: str | None = Field(default=None, description="container image (Kubernetes backend)")
    workdir: str = Field(default=".", description="directory packed as the source bundle")
    output_dir: str = Field(
        default="outputs",
        description="directory (relative to the run dir) exported as MUSTER_OUTPUT_DIR, uploaded",
    )
    timeout: Seconds | None = Field(default=None, description="seconds, or '30m', '2h'")
    hang_timeout: Seconds | None = Field(
        default=None,
        description="when every rank has printed nothing and used no CPU for this long "
        "(e.g. '10m'), the job gets the condition Hung and its ranks' stacks are captured "
        "into its events; off by default",
    )
    on_hang: OnHang = Field(
        default="warn", description="'warn': only the condition; 'fail': end the job, failed"
    )
    priority: int = Field(
        default=0, ge=-INT32, lt=INT32, description="higher is placed first; equal: first come"
    )
    labels: dict[str, str] = Field(
        default_factory=dict, description="free-form tags, shown and kept on Kubernetes objects"
    )
    retries: int = Field(
        default=0,
        ge=0,
        description="must be 0: a failed gang is never resubmitted (checkpoint to "
        "MUSTER_OUTPUT_DIR and submit again)",
    )
    resources: Resources = Field(default_factory=Resources, description="what each worker needs")
    distributed: Distributed | None = Field(
        default=None, description="the gang; absent: one worker, one process"
    )

    @property
    def gang(self) -> Distributed:
        """The distributed block in force: a job without one is a gang of one."""
        return self.distributed if self.distributed is not None else Distributed(num_workers=1)

    @property
    def backend(self) -> Backend:
        if self.gang.backend is not None:
            return self.gang.backend
        return "nccl" if self.resources.effective_device == "cuda" else "gloo"

    @property
    def module(self) -> str | None:
        """The module name when the entrypoint is ``-m module``, else None."""
        parts = self.entrypoint.split()
        if len(parts) == 2 and parts[0] in ("-m", "--module"):
            return parts[1]
        return None
