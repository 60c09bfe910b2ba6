"""Submission rules that look across fields (seed 001, step 1; seed 000 for LD_PRELOAD).

Each rule returns FieldErrors naming the field and the fix; ``check_job`` runs them all so a
user sees every problem at once. Nothing here does I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from muster.errors import FieldError
from muster.spec.job import MAX_PROCS_PER_WORKER, JobSpec, JoinWindow

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

#: Variables torchrun or the gang's network path set; a job may not set them.
PLATFORM_ENV = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NCCL_NET",
        "NCCL_SOCKET_IFNAME",
        "NCCL_SOCKET_FAMILY",
        "NCCL_IB_DISABLE",
        "GLOO_SOCKET_IFNAME",
    }
)
PLATFORM_ENV_PREFIXES = ("PET_", "MUSTER_")
#: Which devices a rank sees: a box's to say when it walks in (muster join --devices).
VISIBILITY_MASKS = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "GPU_DEVICE_ORDINAL",
    }
)


def dns_label_problem(name: str) -> str | None:
    """Why ``name`` is not an RFC 1123 DNS label, or None when it is one."""
    if DNS_LABEL.fullmatch(name):
        return None
    suggestion = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:63].strip("-")
    hint = f"; try {suggestion!r}" if suggestion and DNS_LABEL.fullmatch(suggestion) else ""
    return (
        f"{name!r} is not a DNS label: use lowercase letters, digits and '-', "
        f"start and end with a letter or digit, at most 63 characters{hint}"
    )


def check_job(spec: JobSpec) -> list[FieldError]:
    """Every cross-field rule a job must pass before it is stored."""
    return [
        *_name(spec),
        *_entrypoint(spec),
        *_paths(spec),
        *_env(spec),
        *_labels(spec),
        *_hang(spec),
        *_resources(spec),
        *_distributed(spec),
    ]


MIN_HANG_TIMEOUT_S = 10  # under this, a rank that thinks quietly reads as hung


def _hang(spec: JobSpec) -> Iterator[FieldError]:
    if spec.on_hang == "fail" and spec.hang_timeout is None:
        yield FieldError("on_hang", "'fail' needs hang_timeout (e.g. hang_timeout: 10m)")
    if spec.hang_timeout is not None and spec.hang_timeout < MIN_HANG_TIMEOUT_S:
        yield FieldError(
            "hang_timeout",
            f"{spec.hang_timeout}s is under {MIN_HANG_TIMEOUT_S}s: a rank that computes "
            "without printing would read as hung; give at least a few minutes",
        )


def _name(spec: JobSpec) -> Iterator[FieldError]:
    problem = dns_label_problem(spec.name)
    if problem:
        yield FieldError("name", problem)


def _entrypoint(spec: JobSpec) -> Iterator[FieldError]:
    parts = spec.entrypoint.split()
    if not parts:
        yield FieldError("entrypoint", "is empty; give a script (train.py) or a module (-m pkg)")
    elif parts[0] in ("-m", "--module"):
        if len(parts) != 2 or not MODULE_NAME.match(parts[1]):
            yield FieldError(
                "entrypoint",
                f"{spec.entrypoint!r}: write '-m package.module' and put arguments in args",
            )
    elif len(parts) > 1:
        yield FieldError(
            "entrypoint",
            f"{spec.entrypoint!r} has arguments; set entrypoint: {parts[0]} and args: {parts[1:]}",
        )


def _paths(spec: JobSpec) -> Iterator[FieldError]:
    out = spec.output_dir
    if not out or out.startswith("/") or ".." in out.split("/"):
        yield FieldError(
            "output_dir",
            f"{out!r} must be a relative path inside the run directory, without '..' "
            "(e.g. outputs)",
        )
    if not spec.workdir:
        yield FieldError("workdir", "is empty; use '.' for the directory of the job file")


def env_key_problem(key: str, transport: str) -> str | None:
    """Why a job may not set ``key`` in env, or None when it may."""
    if not ENV_NAME.match(key):
        return "is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)"
    if key in PLATFORM_ENV or key.startswith(PLATFORM_ENV_PREFIXES):
        return (
            "is set by muster and torchrun for every rank; remove it "
            "(rank and address variables come from the rank plan and the gang's path)"
        )
    if key == "LD_PRELOAD" and transport == "auto":
        return (
            "cannot be set with distributed.transport: auto, because a relayed gang "
            "preloads muster's shim first; set it in the image (it is kept after the "
            "shim) or use transport: direct"
        )
    return None


def check_raw(data: Mapping[str, Any]) -> list[FieldError]:
    """The rules that can still be checked when the data failed type validation."""
    errors: list[FieldError] = []
    name = data.get("name")
    if isinstance(name, str) and (problem := dns_label_problem(name)):
        errors.append(FieldError("name", problem))
    dist = data.get("distributed")
    transport = dist.get("transport", "direct") if isinstance(dist, Mapping) else "direct"
    env = data.get("env")
    if isinstance(env, Mapping):
        for key in env:
            if isinstance(key, str) and (problem := env_key_problem(key, str(transport))):
                errors.append(FieldError(f"env.{key}", problem))
    return errors


def _env(spec: JobSpec) -> Iterator[FieldError]:
    for key in spec.env:
        problem = env_key_problem(key, spec.gang.transport)
        if problem:
            yield FieldError(f"env.{key}", problem)


def _labels(spec: JobSpec) -> Iterator[FieldError]:
    for key, value in spec.labels.items():
        if not re.match(r"^[A-Za-z0-9]([-A-Za-z0-9_./]{0,61}[A-Za-z0-9])?$", key):
            yield FieldError(f"labels.{key}", "keys are letters, digits, '-', '_', '.', '/'")
        if len(value) > 63:
            yield FieldError(f"labels.{key}", "values are at most 63 characters")


def _resources(spec: JobSpec) -> Iterator[FieldError]:
    res = spec.resources
    device = res.effective_device
    if device == "cuda" and res.gpus == 0:
        yield FieldError("resources.gpus", "is 0 with device: cuda; request gpus: 1 or more")
    if device == "cpu" and res.gpus > 0:
        yield FieldError(
            "resources.device",
            f"is cpu but resources.gpus={res.gpus}; set device: cuda or gpus: 0",
        )


def _distributed(spec: JobSpec) -> Iterator[FieldError]:
    dist = spec.distributed
    if dist is None:
        return
    res = spec.resources
    if res.effective_device == "mps":
        yield FieldError(
            "resources.device",
            "mps cannot run a distributed job (no collective backend); use cuda or cpu, "
            "or remove the distributed block",
        )
    if dist.backend == "nccl" and res.effective_device != "cuda":
        yield FieldError(
            "distributed.backend",
            f"nccl needs CUDA but the device is {res.effective_device}; "
            "use backend: gloo, or request GPUs (resources.gpus, device: cuda)",
        )
    if res.gpus > 0 and dist.procs_per_worker > res.gpus:
        yield FieldError(
            "distributed.procs_per_worker",
            f"procs_per_worker={dist.procs_per_worker} exceeds resources.gpus={res.gpus}; "
            "run at most one process per GPU",
        )
    if spec.retries > 0:
        yield FieldError(
            "retries",
            "must be 0: muster never retries a job (a partly run gang cannot be resumed); "
            "checkpoint to MUSTER_OUTPUT_DIR and resubmit",
        )
    if dist.window is not None and dist.membership != "window":
        yield FieldError(
            "distributed.window",
            "is set but membership is pool (the scheduler places the gang); set membership: "
            "window for walk-ins, or remove the window block",
        )
    if dist.membership == "window":
        yield from window_problems(dist.window or JoinWindow(), "distributed.window")
        for key in spec.env:
            if key in VISIBILITY_MASKS:
                yield FieldError(
                    f"env.{key}",
                    "is a device visibility mask: in a window job each box decides which of "
                    "its GPUs its ranks see (muster join --devices); remove it",
                )
    if dist.node_procs is not None:
        if dist.membership != "window":
            yield FieldError(
                "distributed.node_procs",
                "is for a world a join window formed (membership: window); a pool gang runs "
                "procs_per_worker on every node: remove it",
            )
        if len(dist.node_procs) != dist.num_workers or not all(
            1 <= n <= MAX_PROCS_PER_WORKER for n in dist.node_procs
        ):
            yield FieldError(
                "distributed.node_procs",
                f"must list num_workers ({dist.num_workers}) counts, each 1.."
                f"{MAX_PROCS_PER_WORKER}",
            )


def window_problems(join: JoinWindow, at: str) -> Iterator[FieldError]:
    """A join window's rules across its fields (a job's distributed.window, or a cluster
    file's controller.join); ``at`` is where it sits."""
    if join.start == "manual" and join.target_ranks is not None:
        yield FieldError(
            f"{at}.target_ranks",
            "a manual window never forms on its own, so it has no target; remove "
            "target_ranks, or use start: hybrid (forms on the target or when started)",
        )
    if join.max_join_timeout < join.join_timeout:
        yield FieldError(
            f"{at}.max_join_timeout",
            f"({join.max_join_timeout}s) is below join_timeout ({join.join_timeout}s); "
            "the hard cap must be at least the window's timeout",
        )
    quorum, target = join.quorum, join.target_ranks
    if quorum is not None and target is not None and target < quorum:
        yield FieldError(
            f"{at}.target_ranks",
            f"({target}) is below quorum ({quorum}); a window forms at its target, so raise "
            "it to the quorum or more",
        )
