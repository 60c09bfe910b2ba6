"""What muster asks of a live cluster, through the ``kubernetes`` client (``muster[k8s]``).

``Cluster`` wraps two of the client's API objects, ``CoreV1Api`` and ``CustomObjectsApi``;
``Cluster.connect`` builds them from the kubeconfig (or the pod's service account) and is the
only place that imports ``kubernetes``. Tests hand in fakes with the same methods.

- ``preflight``: the eligible nodes agree on their EFA count, the gpu-nic networks exist, the
  runtime exists (and a patch's targets exist in it);
- ``apply``: server-side apply with field manager ``muster``; a TrainJob's trainer (and
  runtimeRef) are immutable, so a change there deletes the TrainJob and creates it anew;
- ``status`` and ``logs`` of a TrainJob's node pods (whole logs, each line tagged by pod, as
  ``kubectl logs --prefix`` does).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from muster.errors import InfrastructureError, UserError
from muster.k8s import fabric as fab
from muster.k8s.render import GROUP, RenderOptions
from muster.k8s.rules import check

VERSION = "v1alpha1"
FIELD_MANAGER = "muster"
PLURALS = {
    "TrainJob": "trainjobs",
    "TrainingRuntime": "trainingruntimes",
    "ClusterTrainingRuntime": "clustertrainingruntimes",
}
IMMUTABLE = ("trainer", "runtimeRef", "initializer", "managedBy", "activeDeadlineSeconds")
NODE_PODS = "jobset.sigs.k8s.io/jobset-name={name},jobset.sigs.k8s.io/replicatedjob-name=node"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Preflight:
    checks: list[Check] = field(default_factory=list)
    efa_count: int | None = None
    networks: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def _status(exc: Exception) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _natural(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


class Cluster:
    """One namespace of one cluster, through the client's API objects."""

    def __init__(self, core: Any, custom: Any, namespace: str = "default") -> None:
        self.core = core
        self.custom = custom
        self.namespace = namespace
        self.delete_timeout = 180.0
        self.sleep: Callable[[float], None] = time.sleep

    @classmethod
    def connect(cls, namespace: str = "default", context: str | None = None) -> Cluster:
        try:
            from kubernetes import client, config
        except ImportError:
            raise UserError(
                "the cluster commands need the kubernetes client: pip install 'muster[k8s]'"
            ) from None
        try:
            config.load_kube_config(context=context)  # type: ignore[no-untyped-call]
        except Exception:
            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
            except Exception as exc:
                raise InfrastructureError(
                    f"no kubeconfig (KUBECONFIG or ~/.kube/config) and not in a pod: {exc}"
                ) from None
        return cls(client.CoreV1Api(), client.CustomObjectsApi(), namespace)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if _status(exc) in (401, 403):
                raise UserError(f"{what}: the cluster refused ({_status(exc)}): {exc}") from None
            if _status(exc) is not None:
                raise
            raise InfrastructureError(f"{what}: {exc}") from None

    # --- reading --------------------------------------------------------------------------

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        plural = PLURALS[kind]
        try:
            if kind == "ClusterTrainingRuntime":
                found = self._call(
                    f"get {kind} {name}",
                    self.custom.get_cluster_custom_object,
                    GROUP,
                    VERSION,
                    plural,
                    name,
                )
            else:
                found = self._call(
                    f"get {kind} {name}",
                    self.custom.get_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    self.namespace,
                    plural,
                    name,
                )
        except Exception as exc:
            if _status(exc) == 404:
                return None
            raise
        return dict(found)

    def nodes(self, selector: dict[str, str]) -> list[Any]:
        label_selector = ",".join(f"{k}={v}" for k, v in selector.items())
        found = self._call("list nodes", self.core.list_node, label_selector=label_selector)
        return list(found.items)

    def networks(self) -> list[str]:
        try:
            found = self._call(
                "list networks.networking.gke.io",
                self.custom.list_cluster_custom_object,
                "networking.gke.io",
                "v1",
                "networks",
            )
        except Exception as exc:
            if _status(exc) == 404:
                return []  # no such resource: not a GKE multi-network cluster
            raise
        return sorted((i["metadata"]["name"] for i in found.get("items", [])), key=_natural)

    def pods(self, trainjob: str) -> list[Any]:
        found = self._call(
            f"list pods of {trainjob}",
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=NODE_PODS.format(name=trainjob),
        )
        return sorted(found.items, key=lambda p: _natural(p.metadata.name))

    # --- preflight ------------------------------------------------------------------------

    def preflight(self, options: RenderOptions, runtime_name: str | None = None) -> Preflight:
        report = Preflight()
        if options.fabric == "efa":
            self._efa(options, report)
        if options.fabric == "tcpxo":
            self._tcpxo(options, report)
        if options.fabric == "ib":
            self._devices(options, fab.RDMA, report)
        if options.fabric != "tcpxo":
            name = runtime_name or options.runtime or "torch-distributed"
            runtime = self.get("ClusterTrainingRuntime", name)
            if runtime is None:
                report.checks.append(
                    Check(
                        "runtime",
                        False,
                        f"ClusterTrainingRuntime {name} not found: install Trainer's runtimes "
                        "or name yours with --runtime",
                    )
                )
            else:
                report.checks.append(Check("runtime", True, f"ClusterTrainingRuntime {name}"))
        return report

    def _eligible(self, options: RenderOptions) -> list[Any]:
        nodes = self.nodes(options.node_selector)
        return [n for n in nodes if int(_alloc(n, fab.GPU) or 0) > 0]

    def _efa(self, options: RenderOptions, report: Preflight) -> None:
        nodes = self._eligible(options)
        if not nodes:
            report.checks.append(Check("efa", False, _no_nodes(options)))
            return
        counts = {n.metadata.name: int(_alloc(n, fab.EFA) or 0) for n in nodes}
        distinct = sorted(set(counts.values()))
        if len(distinct) > 1 or distinct == [0]:
            listing = ", ".join(f"{name}={count}" for name, count in sorted(counts.items()))
            report.checks.append(
                Check(
                    "efa",
                    False,
                    f"eligible nodes disagree on {fab.EFA} ({listing}): narrow them with "
                    "--node-selector to one instance type"
                    if len(distinct) > 1
                    else f"no eligible node has {fab.EFA} ({listing})",
                )
            )
            return
        report.efa_count = distinct[0]
        report.checks.append(
            Check("efa", True, f"{len(nodes)} node(s), {distinct[0]} EFA devices each")
        )

    def _devices(self, options: RenderOptions, resource: str, report: Preflight) -> None:
        nodes = self._eligible(options)
        missing = [n.metadata.name for n in nodes if int(_alloc(n, resource) or 0) < 1]
        if not nodes or missing:
            detail = _no_nodes(options) if not nodes else f"no {resource} on {', '.join(missing)}"
            report.checks.append(Check(resource, False, detail))
        else:
            report.checks.append(Check(resource, True, f"{len(nodes)} node(s)"))

    def _tcpxo(self, options: RenderOptions, report: Preflight) -> None:
        nics = [n for n in self.networks() if "gpu-nic" in n]
        given = list(options.gpu_nic_networks)
        if given:
            absent = [n for n in given if n not in nics]
            ok = not absent
            detail = f"not on the cluster: {', '.join(absent)}" if absent else "all 8 exist"
            report.networks = given
        else:
            ok = len(nics) == fab.TCPXO_NICS
            detail = (
                f"found {', '.join(nics)}"
                if ok
                else f"found {len(nics)} gpu-nic networks ({', '.join(nics) or 'none'}); "
                f"TCPXO needs {fab.TCPXO_NICS}: give them with --gpu-nic-networks"
            )
            report.networks = nics if ok else []
        report.checks.append(Check("gpu-nic networks", ok, detail))

    # --- writing --------------------------------------------------------------------------

    def apply(self, objects: list[dict[str, Any]], trainer_version: str) -> list[str]:
        """Apply in order; returns what was done, one line per object."""
        done = []
        runtime = None
        for obj in objects:
            if obj["kind"] in ("TrainingRuntime", "ClusterTrainingRuntime"):
                runtime = obj
        for obj in objects:
            kind, name = obj["kind"], obj["metadata"]["name"]
            if kind == "TrainJob":
                ref = obj["spec"]["runtimeRef"]
                target = runtime or self.get(ref["kind"], ref["name"])
                if target is None:
                    raise UserError(
                        f"TrainJob {name} references {ref['kind']} {ref['name']}, which the "
                        "cluster does not have (`muster k8s preflight` checks it)"
                    )
                check([obj], runtime=target, trainer_version=trainer_version)
                existing = self.get(kind, name)
                if existing is not None:
                    changed = [
                        f
                        for f in IMMUTABLE
                        if _canon(existing.get("spec", {}).get(f)) != _canon(obj["spec"].get(f))
                        and obj["spec"].get(f) is not None
                    ]
                    if changed:
                        self._delete(kind, name)
                        self._wait_gone(kind, name)
                        self._ssa(obj)
                        done.append(
                            f"{kind} {name} recreated: {', '.join(changed)} cannot change in "
                            "place, so the old TrainJob (and its pods) was deleted"
                        )
                        continue
            self._ssa(obj)
            done.append(f"{kind} {name} applied (server-side, field manager {FIELD_MANAGER})")
        return done

    def _ssa(self, obj: dict[str, Any]) -> None:
        kind, name = obj["kind"], obj["metadata"]["name"]
        body = json.loads(json.dumps(obj))
        kwargs = {
            "field_manager": FIELD_MANAGER,
            "force": True,
            "_content_type": "application/apply-patch+yaml",
        }
        if kind == "ClusterTrainingRuntime":
            self._call(
                f"apply {kind} {name}",
                self.custom.patch_cluster_custom_object,
                GROUP,
                VERSION,
                PLURALS[kind],
                name,
                body,
                **kwargs,
            )
        else:
            self._call(
                f"apply {kind} {name}",
                self.custom.patch_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                PLURALS[kind],
                name,
                body,
                **kwargs,
            )

    def _delete(self, kind: str, name: str) -> None:
        self._call(
            f"delete {kind} {name}",
            self.custom.delete_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            PLURALS[kind],
            name,
            propagation_policy="Foreground",
        )

    def _wait_gone(self, kind: str, name: str) -> None:
        """A foreground delete returns at once; the object stays (terminating) until its
        JobSet and pods are gone. Applying over it then would be deleted with it."""
        deadline = time.monotonic() + self.delete_timeout
        while self.get(kind, name) is not None:
            if time.monotonic() >= deadline:
                raise InfrastructureError(
                    f"{kind} {name} is still being deleted after {self.delete_timeout:.0f}s; "
                    f"apply again once `kubectl get {kind.lower()} {name} -n {self.namespace}` "
                    "no longer finds it"
                )
            self.sleep(1.0)

    # --- status and logs ------------------------------------------------------------------

    def status(self, trainjob: str) -> dict[str, Any]:
        job = self.get("TrainJob", trainjob)
        if job is None:
            raise UserError(f"TrainJob {trainjob} not found in namespace {self.namespace}")
        conditions = job.get("status", {}).get("conditions", [])
        pods = [
            {"pod": p.metadata.name, "phase": p.status.phase, "node": p.spec.node_name}
            for p in self.pods(trainjob)
        ]
        return {"name": trainjob, "conditions": conditions, "pods": pods}

    def logs(self, trainjob: str) -> list[str]:
        """Every node pod's whole log, each line tagged [pod/NAME/node]."""
        pods = self.pods(trainjob)
        if not pods:
            raise UserError(f"TrainJob {trainjob} has no node pods in namespace {self.namespace}")
        lines = []
        for pod in pods:
            text = self._call(
                f"logs of {pod.metadata.name}",
                self.core.read_namespaced_pod_log,
                pod.metadata.name,
                self.namespace,
                container="node",
            )
            lines += [f"[pod/{pod.metadata.name}/node] {line}" for line in text.splitlines()]
        return lines


def _alloc(node: Any, resource: str) -> Any:
    allocatable = getattr(node.status, "allocatable", None) or {}
    return allocatable.get(resource)


def _no_nodes(options: RenderOptions) -> str:
    where = ",".join(f"{k}={v}" for k, v in options.node_selector.items()) or "any node"
    return f"no GPU node matches {where}: check --node-selector"


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)
