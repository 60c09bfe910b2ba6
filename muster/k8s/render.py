"""Render a muster job spec as Kubeflow Trainer objects wired to the cluster fabric (seed 004).

One job spec, the one the controller runs, becomes:
- ``none``: a TrainJob against the ``torch-distributed`` ClusterTrainingRuntime;
- ``tcpxo``: a namespaced TrainingRuntime carrying all the GKE TCPXO wiring (the sidecar
  cannot live in a TrainJob) and a TrainJob that references it and carries no wiring;
- ``efa`` / ``ib``: a TrainJob against ``torch-distributed`` with the device request beside the
  GPUs in resourcesPerNode, the fabric's variables in spec.trainer.env, and IPC_LOCK (plus
  /dev/shm for ib) through a runtime patch on the node container.

The pod's code comes from the job's ``image`` (there is no bundle upload on Kubernetes): the
entrypoint runs from the image's working directory. Trainer sets the PET_* variables that
torchrun reads, so the command is ``torchrun <entrypoint>``. Every object passes
``muster.k8s.rules.check`` before it is returned.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from muster.errors import FieldError, SpecError
from muster.k8s import fabric as fab
from muster.k8s.fabric import FABRICS, Fabric
from muster.k8s.rules import TORCH_DISTRIBUTED, check
from muster.spec.job import JobSpec

TrainerVersion = Literal["2.2", "2.3"]
TRAINER_VERSIONS: tuple[TrainerVersion, ...] = ("2.2", "2.3")
API_VERSION = "trainer.kubeflow.org/v1alpha1"
GROUP = "trainer.kubeflow.org"
MANAGER = "muster.dev/fabric"  # our runtimePatches entry (managers are domain-prefixed)
ANCESTOR = {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
LABELS = {"app.kubernetes.io/managed-by": "muster"}


@dataclass(frozen=True)
class RenderOptions:
    fabric: Fabric = "none"
    trainer_version: TrainerVersion = "2.3"
    namespace: str = "default"
    runtime: str | None = None  # tcpxo: the TrainingRuntime to write; else the one to reference
    gpu_nic_networks: tuple[str, ...] = ()
    efa_count: int | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, str], ...] = ()
    # tcpxo: source the plugin's own profile at start (the seed's way), or values inline
    nccl_env: Literal["inline", "profile"] = "profile"
    nccl_debug: str | None = None  # e.g. INFO for a verify-fabric run
    tcpxo_daemon_image: str = fab.TCPXO_DAEMON_IMAGE
    # efa/ib: the pod's interface for NCCL's bootstrap sockets (what `ip route get` names in
    # a pod; eth0 under the default CNI, another under hostNetwork or a second CNI)
    socket_ifname: str = "eth0"


@dataclass
class Rendered:
    objects: list[dict[str, Any]]
    warnings: list[str]

    def to_yaml(self) -> str:
        return yaml.dump_all(self.objects, Dumper=_Dumper, sort_keys=False)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the device list, the daemon's script) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _env(items: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in items.items()]


def _command(spec: JobSpec) -> list[str]:
    module = spec.module
    return ["torchrun", "-m", module] if module else ["torchrun", spec.entrypoint]


def _wrapped(prelude: str, spec: JobSpec) -> list[str]:
    """``torchrun ENTRY ARGS`` started by bash after ``prelude``: the entrypoint quoted (a
    space or a shell character in it is a word, never code), the job's args passed as
    positional parameters ("$@": ``trainer.args`` follow the command untouched)."""
    entry = shlex.join(_command(spec))
    return ["/bin/bash", "-c", f'{prelude} && exec {entry} "$@"', "torchrun"]


# Fields the controller acts on that a Trainer job has no place for: named when a spec sets them.
DROPPED = {
    "workdir": "the pods run the image's code; nothing is packed or uploaded",
    "output_dir": "MUSTER_OUTPUT_DIR points at it in every pod, but nothing collects it at the "
    "end: mount a volume there or write to object storage",
    "priority": "Trainer has no job priority: use a PriorityClass or a Kueue queue",
    "retries": "Trainer does not resubmit a failed TrainJob",
    "distributed.rendezvous.port": "Trainer picks the rendezvous port (PET_MASTER_PORT)",
    "distributed.network": "the pods use the cluster's network and the chosen --fabric",
    "distributed.transport": "the pods use the cluster's network and the chosen --fabric",
    "distributed.probe_seconds": "no path probe runs before the pods start",
    "distributed.relay_gbps": "the pods never use muster's relays",
    "hang_timeout": "no agent watches the pods' ranks: use `muster stacks` only with agents, "
    "py-spy in the pod (kubectl exec) on Kubernetes",
    "on_hang": "no agent watches the pods' ranks for a hang",
}


def _set_fields(spec: JobSpec) -> set[str]:
    """The dotted names of the fields the spec's file set (not defaults)."""
    found = set(spec.model_fields_set)
    gang = spec.distributed
    if gang is not None:
        found |= {f"distributed.{name}" for name in gang.model_fields_set}
        found |= {f"distributed.rendezvous.{name}" for name in gang.rendezvous.model_fields_set}
    return found


def _dropped(spec: JobSpec) -> list[str]:
    """The fields set to something other than their default that a TrainJob drops."""
    given = _set_fields(spec)
    said = []
    for name, why in DROPPED.items():
        if name not in given:
            continue
        *parents, leaf = name.split(".")
        model: Any = spec
        for part in parents:
            model = getattr(model, part)
        if getattr(model, leaf) != type(model).model_fields[leaf].default:
            said.append(f"{name} is not carried to Kubernetes: {why}")
    return said


def _under_use(spec: JobSpec) -> str | None:
    """Why the pods would leave GPUs idle (fewer ranks per node than GPUs), or None."""
    gpus, procs = spec.resources.gpus, spec.gang.procs_per_worker
    if gpus <= procs:
        return None
    return (
        f"distributed.procs_per_worker is {procs}, so {procs} rank(s) drive {procs} of the "
        f"{gpus} GPUs of each node (resources.gpus): set procs_per_worker: {gpus}, one rank per GPU"
    )


def _refuse(errors: list[FieldError]) -> None:
    if errors:
        raise SpecError(errors, source="muster k8s render")


def _validate(spec: JobSpec, options: RenderOptions) -> None:
    errors: list[FieldError] = []
    if options.fabric not in FABRICS:
        errors.append(FieldError("--fabric", f"must be one of {', '.join(FABRICS)}"))
    if options.trainer_version not in TRAINER_VERSIONS:
        errors.append(
            FieldError("--trainer-version", f"must be one of {', '.join(TRAINER_VERSIONS)}")
        )
    if not spec.image:
        errors.append(
            FieldError("image", "Kubernetes runs the job from a container image: set image:")
        )
    if spec.gang.membership == "window":
        errors.append(
            FieldError(
                "distributed.membership",
                "window: boxes walk in to muster's controller (muster join); on Kubernetes the "
                "Trainer places a fixed gang of pods: use membership: pool",
            )
        )
    for name in spec.env:
        if name.startswith("PET_"):
            errors.append(
                FieldError(
                    f"env.{name}",
                    "PET_* variables are Trainer's (it sets them for torchrun); remove it",
                )
            )
    gpus = spec.resources.gpus
    under = _under_use(spec)
    if under is not None and options.fabric != "none":
        errors.append(FieldError("distributed.procs_per_worker", under))
    if options.fabric != "none" and gpus == 0:
        errors.append(
            FieldError("resources.gpus", f"the {options.fabric} fabric is for GPU nodes: set it")
        )
    if options.fabric == "tcpxo":
        if gpus not in (0, fab.TCPXO_GPUS):
            errors.append(
                FieldError("resources.gpus", f"TCPXO needs all {fab.TCPXO_GPUS} GPUs of a node")
            )
        errors += _check_networks(list(options.gpu_nic_networks))
    if options.fabric == "efa" and (options.efa_count is None or options.efa_count < 1):
        errors.append(
            FieldError(
                "--efa-count",
                "give the nodes' EFA count (4 on p4d, 32 on p5): read it with "
                "`muster k8s preflight --fabric efa`, or `kubectl get nodes -o custom-columns="
                "'NODE:.metadata.name,EFA:.status.allocatable.vpc\\.amazonaws\\.com/efa'`",
            )
        )
    _refuse(errors)


def _check_networks(networks: list[str]) -> list[FieldError]:
    where = "--gpu-nic-networks"
    hint = (
        "list them with `kubectl get networks.networking.gke.io -o jsonpath="
        "'{range .items[*]}{.metadata.name}{\"\\n\"}{end}' | grep gpu-nic`, or run "
        "`muster k8s preflight --fabric tcpxo`"
    )
    if not networks:
        return [FieldError(where, f"TCPXO needs the cluster's eight gpu-nic networks: {hint}")]
    errors = []
    if len(networks) != fab.TCPXO_NICS:
        errors.append(FieldError(where, f"expected {fab.TCPXO_NICS} names, got {len(networks)}"))
    for name in networks:
        if "/" in name:
            bare = name.rsplit("/", 1)[-1]
            errors.append(
                FieldError(where, f"{name!r} is a `-o name` form: give the bare name {bare!r}")
            )
        elif "gpu-nic" not in name:
            errors.append(FieldError(where, f"{name!r} is not a gpu-nic network ({hint})"))
        elif not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name):
            errors.append(FieldError(where, f"{name!r} is not a Kubernetes object name"))
    if len(set(networks)) != len(networks):
        errors.append(FieldError(where, "a network is named twice; each NIC needs its own"))
    return errors


def _job_env(spec: JobSpec) -> dict[str, str]:
    """What every rank gets under the controller too: the user's env, one OpenMP thread per
    rank unless the job says otherwise, and MUSTER_OUTPUT_DIR (relative to the image's
    working directory)."""
    env = dict(spec.env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MUSTER_OUTPUT_DIR"] = spec.output_dir
    return env


def _trainer_env(spec: JobSpec, options: RenderOptions, warnings: list[str]) -> dict[str, str]:
    """The job's env, then the fabric's: fixed variables win (with a warning), others are
    defaults the user may override. EFA's plugin directory is not here: it is prepended to
    the image's own LD_LIBRARY_PATH at start (a pod's value would hide the image's)."""
    fixed_by_fabric = {
        "none": {},
        "tcpxo": {},  # tcpxo wiring lives in the runtime
        "efa": {k: v for k, v in fab.EFA_ENV.items() if k != "LD_LIBRARY_PATH"},
        "ib": fab.IB_ENV,
    }[options.fabric]
    if "NCCL_SOCKET_IFNAME" in fixed_by_fabric:
        fixed_by_fabric = {**fixed_by_fabric, "NCCL_SOCKET_IFNAME": options.socket_ifname}
    env = _job_env(spec)
    fixed = fab.FIXED[options.fabric]
    for name, value in fixed_by_fabric.items():
        if name in env and env[name] != value and name in fixed:
            warnings.append(
                f"env.{name}={env[name]!r} replaced by {value!r}: the {options.fabric} fabric "
                "fixes it"
            )
            env[name] = value
        env.setdefault(name, value)
    if options.nccl_debug:
        env["NCCL_DEBUG"] = options.nccl_debug
    return env


def _resources(spec: JobSpec, options: RenderOptions) -> dict[str, Any] | None:
    gpus = spec.resources.gpus
    if gpus == 0:
        return None
    need: dict[str, Any] = {fab.GPU: gpus}
    if options.fabric == "efa":
        need[fab.EFA] = options.efa_count
    if options.fabric == "ib":
        need[fab.RDMA] = 1
    return {"limits": dict(need), "requests": dict(need)}


def _node_patch(options: RenderOptions) -> dict[str, Any] | None:
    """The runtimePatches entry for efa/ib/none: placement, IPC_LOCK, /dev/shm."""
    pod: dict[str, Any] = {}
    if options.node_selector:
        pod["nodeSelector"] = dict(options.node_selector)
    if options.tolerations:
        pod["tolerations"] = [dict(t) for t in options.tolerations]
    container: dict[str, Any] = {}
    if options.fabric in ("efa", "ib"):
        container["securityContext"] = fab.IPC_LOCK
    if options.fabric == "ib":
        container["volumeMounts"] = [fab.DSHM_MOUNT]
        pod["volumes"] = [fab.DSHM_VOLUME]
    if container:
        pod["containers"] = [{"name": "node", **container}]
    if not pod:
        return None
    return {
        "manager": MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": "node", "template": {"spec": {"template": {"spec": pod}}}}
                    ]
                }
            }
        },
    }


def _tcpxo_runtime(spec: JobSpec, options: RenderOptions, name: str) -> dict[str, Any]:
    env = dict(fab.TCPXO_BASE_ENV)
    if options.nccl_env == "inline":
        env.update(fab.TCPXO_NCCL_ENV)
    env.setdefault("NCCL_DEBUG", options.nccl_debug or "WARN")
    pod_spec: dict[str, Any] = {}
    if options.node_selector:
        pod_spec["nodeSelector"] = dict(options.node_selector)
    if options.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in options.tolerations]
    pod_spec["initContainers"] = [fab.tcpxo_daemon(options.tcpxo_daemon_image)]
    need = {fab.GPU: fab.TCPXO_GPUS}
    pod_spec["containers"] = [
        {
            "name": "node",
            "image": spec.image,
            "resources": {"limits": dict(need), "requests": dict(need)},
            "securityContext": fab.IPC_LOCK,
            "env": _env(env),
            "volumeMounts": [
                fab.DSHM_MOUNT,
                {"name": "nvtcpxo-libraries", "mountPath": "/usr/local/nvidia", "readOnly": True},
                {"name": "nvtcpxo-aperture-devices", "mountPath": "/dev/aperture_devices"},
            ],
        }
    ]
    pod_spec["volumes"] = [fab.DSHM_VOLUME] + [
        {"name": volume, "hostPath": {"path": path}}
        for volume, path in fab.TCPXO_HOST_PATHS.items()
    ]
    annotations = {
        "devices.gke.io/container.tcpxo-daemon": "".join(
            f"- path: {d}\n" for d in fab.TCPXO_DEVICES
        ),
        "networking.gke.io/default-interface": "eth0",
        "networking.gke.io/interfaces": fab.tcpxo_interfaces(list(options.gpu_nic_networks)),
    }
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainingRuntime",
        "metadata": {
            "name": name,
            "namespace": options.namespace,
            "labels": {"trainer.kubeflow.org/framework": "torch", **LABELS},
        },
        "spec": {
            "mlPolicy": {"numNodes": spec.gang.num_workers, "torch": {}},
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "template": {
                                "metadata": {"labels": dict(ANCESTOR)},
                                "spec": {
                                    "template": {
                                        "metadata": {"annotations": annotations},
                                        "spec": pod_spec,
                                    }
                                },
                            },
                        }
                    ]
                }
            },
        },
    }


def render(spec: JobSpec, options: RenderOptions) -> Rendered:
    """The objects to apply, in order, and what the user should know about them."""
    _validate(spec, options)
    warnings: list[str] = []
    objects: list[dict[str, Any]] = []
    gang = spec.gang
    trainer: dict[str, Any] = {
        "image": spec.image,
        "command": _command(spec),
        "numNodes": gang.num_workers,
        "numProcPerNode": gang.procs_per_worker,
    }
    if spec.args:
        trainer["args"] = list(spec.args)
    if options.fabric == "tcpxo":
        runtime_name = options.runtime or f"{spec.name}-tcpxo"
        runtime = _tcpxo_runtime(spec, options, runtime_name)
        objects.append(runtime)
        ref = {"name": runtime_name, "kind": "TrainingRuntime", "apiGroup": GROUP}
        if options.nccl_env == "profile":
            # NCCL_LIB_DIR: the profile's paths start there. --nccl-debug after it: the
            # profile may set its own NCCL_DEBUG.
            prelude = f"export NCCL_LIB_DIR={fab.TCPXO_LIB_DIR} && source {fab.TCPXO_PROFILE}"
            if options.nccl_debug:
                prelude += f" && export NCCL_DEBUG={shlex.quote(options.nccl_debug)}"
            trainer["command"] = _wrapped(prelude, spec)
        else:
            warnings.append(
                "--nccl-env inline: the NCCL values are muster's transcription of the profile "
                f"released with the TCPXO NCCL plugin {fab.TCPXO_PLUGIN}; a cluster on another "
                "plugin version needs its own (the default, profile, sources the plugin's)"
            )
        env = _job_env(spec)
        if options.nccl_debug:
            env["NCCL_DEBUG"] = options.nccl_debug
        patch = None
    else:
        runtime = TORCH_DISTRIBUTED
        ref = {
            "name": options.runtime or "torch-distributed",
            "kind": "ClusterTrainingRuntime",
            "apiGroup": GROUP,
        }
        env = _trainer_env(spec, options, warnings)
        resources = _resources(spec, options)
        if resources is not None:
            trainer["resourcesPerNode"] = resources
            if options.trainer_version == "2.2":
                warnings.append(
                    "Trainer 2.2 replaces the runtime's resources with resourcesPerNode: it "
                    f"repeats every resource the node needs ({', '.join(resources['limits'])})"
                )
        patch = _node_patch(options)
        if options.fabric == "efa":
            plugin = fab.EFA_ENV["LD_LIBRARY_PATH"]
            if "LD_LIBRARY_PATH" not in spec.env:  # (a user's own value stands as given)
                image_path = "${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # the image's, kept
                trainer["command"] = _wrapped(
                    f'export LD_LIBRARY_PATH="{plugin}{image_path}"', spec
                )
    if options.fabric in ("none", "efa", "ib"):
        under = _under_use(spec)
        if under is not None:  # (refused for the fabrics, which are for full nodes)
            warnings.append(under)
    if options.fabric == "tcpxo" and not (options.node_selector or options.tolerations):
        warnings.append(
            "no --node-selector or --toleration: the runtime inherits no placement, so the "
            "pods may stay Pending on tainted GPU nodes or land on a pool without TCPXO "
            "(e.g. --node-selector cloud.google.com/gke-accelerator=nvidia-h100-mega-80gb "
            "--toleration nvidia.com/gpu:NoSchedule)"
        )
    warnings += _dropped(spec)
    if env:
        trainer["env"] = _env(env)
    if options.fabric == "efa":
        warnings.append(
            "the image must carry the EFA stack (libfabric and aws-ofi-nccl, plugin under "
            f"{fab.EFA_ENV['LD_LIBRARY_PATH']}); an ordinary PyTorch image falls back to sockets"
        )
    if options.fabric == "ib":
        warnings.append(
            "the image must carry rdma-core (libibverbs); without it NCCL logs "
            "'NET/IB : No device found' and falls back to sockets"
        )
    job: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": {
            "name": spec.name,
            "namespace": options.namespace,
            "labels": {**spec.labels, **LABELS},
        },
        "spec": {"runtimeRef": ref, "trainer": trainer},
    }
    if patch is not None:
        job["spec"]["runtimePatches"] = [patch]
    if spec.timeout is not None:
        job["spec"]["activeDeadlineSeconds"] = int(spec.timeout)
    objects.append(job)
    check(objects, runtime=runtime, trainer_version=options.trainer_version)
    return Rendered(objects, warnings)


def interfaces_of(runtime: dict[str, Any]) -> list[str]:
    """The gpu-nic network names a rendered TCPXO runtime attaches (for status and tests)."""
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    value = pod["template"]["metadata"]["annotations"]["networking.gke.io/interfaces"]
    return [e["network"] for e in json.loads(value)[1:]]
