"""The cluster file ``muster.cluster.yml`` (seed 003): a controller, the workers it fans out
to over SSH, and the join window that admits them (and any walk-in).

Shape and types are checked by the models; the rules across fields by ``check_cluster``;
``load_cluster_file`` / ``parse_cluster`` run both and raise ``SpecError`` naming every key
and its fix. The file may wrap everything in a top-level ``cluster:`` key, as seed 003 writes
it. Nothing here does I/O but the YAML read in the loader.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from muster.errors import FieldError
from muster.spec.job import JoinWindow, StartMode, _Model
from muster.spec.rules import (
    ENV_NAME,
    PLATFORM_ENV,
    PLATFORM_ENV_PREFIXES,
    VISIBILITY_MASKS,
    window_problems,
)
from muster.spec.worker import LOCATION

DEFAULT_PORT = 7070  # muster server's default


def _devices(value: object) -> object:
    if value is None or value == "all":
        return value
    if isinstance(value, list) and all(
        isinstance(d, int) and not isinstance(d, bool) for d in value
    ):
        return value
    raise ValueError(f"must be a list of GPU indices (e.g. [0, 1]) or all, got {value!r}")


Devices = Annotated[list[int] | Literal["all"] | None, BeforeValidator(_devices)]


class Controller(_Model):
    host: str = Field(default="127.0.0.1", min_length=1, description="controller bind address")
    port: int = Field(default=DEFAULT_PORT, ge=1, le=65535, description="the one port")
    path: str | None = Field(default=None, description="the project root on the controller")
    join: JoinWindow = Field(default_factory=JoinWindow, description="the join window")


class Ssh(_Model):
    """How ``muster up`` reaches a worker (the OpenSSH client; never a password prompt)."""

    target: str | None = Field(default=None, description="ssh destination [the worker's host]")
    port: int = Field(default=22, ge=1, le=65535, description="ssh port")
    user: str | None = Field(default=None, description="ssh user [ssh's own default]")
    identity_file: str | None = Field(default=None, description="private key file (ssh -i)")
    options: list[str] = Field(default_factory=list, description="-o options, as Key=Value")


class Worker(_Model):
    """One host that carries ranks: one rank per device it offers (or ``procs`` CPU ranks)."""

    host: str = Field(min_length=1, description="the worker's name, and its default ssh target")
    ssh: Ssh = Field(default_factory=Ssh, description="how `muster up` reaches it")
    devices: Devices = Field(default=None, description="GPU indices, or all (probed at dispatch)")
    procs: int | None = Field(default=None, ge=1, le=1024, description="CPU ranks (no GPUs)")
    interface: str | None = Field(
        default=None, description="the interface ranks bind; required when workers span hosts"
    )
    path: str | None = Field(default=None, description="the project root on this host")
    data_path: str | None = Field(default=None, description="the data root ranks read here")
    env: dict[str, str] = Field(default_factory=dict, description="this host's ranks' env")
    gpu_ram_share: float | None = Field(
        default=None,
        gt=0,
        le=4,
        description="an APU's GPU share of RAM (MUSTER_GPU_RAM_SHARE for its ranks)",
    )
    python: str = Field(
        default="python3", min_length=1, description="the Python muster runs with on this host"
    )
    work_dir: str | None = Field(
        default=None, description="where its agent unpacks and runs jobs [the agent's data dir]"
    )
    provider: str | None = Field(
        default=None, pattern=LOCATION, description="its provider (aws, gcp, onprem) [local]"
    )
    region: str | None = Field(
        default=None,
        pattern=LOCATION,
        description="its provider's region (us-east-1); with provider, hosts in one declared "
        "provider region take the direct path's larger packets [local]",
    )
    region_class: str | None = Field(
        default=None, pattern=LOCATION, description="its region class (us, eu) [local]"
    )

    @property
    def ranks(self) -> int | None:
        """Ranks this worker carries, or None until its devices are probed (``all``)."""
        if self.procs is not None:
            return self.procs
        if isinstance(self.devices, list):
            return len(self.devices)
        return None


class ClusterFile(_Model):
    controller: Controller = Field(default_factory=Controller, description="where it listens")
    workers: list[Worker] = Field(default_factory=list, description="the hosts that carry ranks")
    env: dict[str, str] = Field(default_factory=dict, description="every rank's env")
    gpu_ram_share: float | None = Field(
        default=None,
        gt=0,
        le=4,
        description="an APU's GPU share of RAM (MUSTER_GPU_RAM_SHARE for its ranks)",
    )

    @property
    def capacity(self) -> int | None:
        """Ranks the configured workers carry, or None while some say ``devices: all``."""
        counts = [w.ranks for w in self.workers]
        if any(c is None for c in counts):
            return None
        return sum(c for c in counts if c is not None)

    def quorum(self, capacity: int | None = None) -> int | None:
        """The quorum in force: the file's, else the (probed) capacity, so fan-out never
        starts below full strength."""
        return self.controller.join.quorum or capacity or self.capacity or None

    def target(self, capacity: int | None = None) -> int | None:
        """The early-close target in force (never below the quorum): the file's, else the
        capacity, so fan-out closes the instant every configured rank is in. A manual
        window has none."""
        join = self.controller.join
        if join.start == "manual":
            return None
        target = join.target_ranks or capacity or self.capacity or None
        quorum = self.quorum(capacity)
        return max(target, quorum) if target is not None and quorum is not None else target

    def gpu_ram_share_of(self, worker: Worker) -> float | None:
        """A host entry's own value beats the cluster default."""
        return worker.gpu_ram_share if worker.gpu_ram_share is not None else self.gpu_ram_share


#: ssh options that run a command on the machine running ssh: a cluster file (or a --ssh-option)
#: must not turn `muster up` into a way to run one.
SSH_COMMAND_OPTIONS = frozenset(
    {"proxycommand", "localcommand", "permitlocalcommand", "knownhostscommand", "match", "include"}
)


def ssh_option_problem(option: str) -> str | None:
    """Why ``option`` may not be handed to ssh as ``-o option``, or None."""
    key, sep, _value = option.partition("=")
    if not sep or not key or option.startswith("-") or any(c.isspace() for c in key):
        return f"{option!r} is not an ssh option; write Key=Value (e.g. ProxyJump=bastion)"
    if key.lower() in SSH_COMMAND_OPTIONS:
        return (
            f"{key} runs a command on this machine; muster refuses it (ProxyJump reaches a "
            "host through a bastion without one)"
        )
    return None


def cluster_env_problem(key: str) -> str | None:
    """Why a cluster file's env may not set ``key``, or None when it may."""
    if not ENV_NAME.match(key):
        return "is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)"
    if key in VISIBILITY_MASKS:
        return "is a device visibility mask: muster sets it per rank from the worker's devices"
    if key in PLATFORM_ENV or key.startswith(PLATFORM_ENV_PREFIXES):
        return "is set by muster and torchrun for every rank; remove it"
    return None


def check_cluster(cluster: ClusterFile) -> list[FieldError]:
    """Every rule across the cluster file's fields, each naming its key and the fix."""
    return [*_join(cluster), *_workers(cluster), *_envs(cluster)]


def _join(cluster: ClusterFile) -> Iterator[FieldError]:
    yield from window_problems(cluster.controller.join, "controller.join")


def _workers(cluster: ClusterFile) -> Iterator[FieldError]:
    seen: dict[str, int] = {}
    spans = len({w.host for w in cluster.workers}) > 1
    for i, worker in enumerate(cluster.workers):
        at = f"workers[{i}]"
        if worker.host in seen:
            yield FieldError(
                f"{at}.host",
                f"{worker.host!r} is also workers[{seen[worker.host]}]; a host is listed once "
                "(give it more devices instead)",
            )
        seen.setdefault(worker.host, i)
        if worker.devices is not None and worker.procs is not None:
            yield FieldError(
                f"{at}.procs", "is set with devices; a worker offers GPUs or CPU ranks, not both"
            )
        if isinstance(worker.devices, list):
            if not worker.devices:
                yield FieldError(f"{at}.devices", "is empty; list GPU indices, or write all")
            if any(d < 0 for d in worker.devices) or len(set(worker.devices)) != len(
                worker.devices
            ):
                yield FieldError(
                    f"{at}.devices", "must be distinct GPU indices (0, 1, ...) as nvidia-smi"
                )
        if spans and not worker.interface:
            yield FieldError(
                f"{at}.interface",
                "is required on every worker when the workers span hosts: name the interface "
                "its ranks bind (e.g. eth0), the one that reaches the other hosts",
            )
        for name in ("path", "data_path", "work_dir"):
            value = getattr(worker, name)
            if value is not None and not value.startswith("/"):
                yield FieldError(f"{at}.{name}", f"{value!r} is not an absolute path")
        for name, value in (
            ("host", worker.host),
            ("ssh.target", worker.ssh.target),
            ("ssh.user", worker.ssh.user),
        ):
            if value is not None and (value.startswith("-") or any(c.isspace() for c in value)):
                yield FieldError(
                    f"{at}.{name}",
                    f"{value!r} would reach ssh as an option; write a host or user name",
                )
        for j, option in enumerate(worker.ssh.options):
            problem = ssh_option_problem(option)
            if problem:
                yield FieldError(f"{at}.ssh.options[{j}]", problem)


def _envs(cluster: ClusterFile) -> Iterator[FieldError]:
    scopes: list[tuple[str, Mapping[str, str]]] = [("env", cluster.env)]
    scopes += [(f"workers[{i}].env", w.env) for i, w in enumerate(cluster.workers)]
    for at, env in scopes:
        for key in env:
            problem = cluster_env_problem(key)
            if problem:
                yield FieldError(f"{at}.{key}", problem)


__all__ = [
    "ClusterFile",
    "Controller",
    "JoinWindow",
    "Ssh",
    "StartMode",
    "Worker",
    "check_cluster",
    "cluster_env_problem",
]
