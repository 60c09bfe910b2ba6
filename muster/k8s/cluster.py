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
# A TrainJob's pods of one replicated job ("node"; "launcher" under an MPI runtime), whose
# container carries the replicated job's name.
PODS = "jobset.sigs.k8s.io/jobset-name={name},jobset.sigs.k8s.io/replicatedjob-name={job}"


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

    def __init__(
        self, core: Any, custom: Any, namespace: str = "default", apps: Any = None
    ) -> None:
        self.core = core
        self.custom = custom
        self.apps = apps  # AppsV1Api: the TCPXO installer's DaemonSet (None: not read)
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
        return cls(client.CoreV1Api(), client.CustomObjectsApi(), namespace, client.AppsV1Api())

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

    def pods(self, trainjob: str, replicated_job: str = "node") -> list[Any]:
        found = self._call(
            f"list pods of {trainjob}",
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=PODS.format(name=trainjob, job=replicated_job),
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
        self._tcpxo_networks(options, report)
        self._tcpxo_nodes(options, report)
        self._tcpxo_pair(options, report)

    def _tcpxo_networks(self, options: RenderOptions, report: Preflight) -> None:
        given = list(options.gpu_nic_networks)
        if given:  # (not listed: a namespace-only role may not list cluster-scoped networks)
            report.networks = given
            report.checks.append(
                Check("gpu-nic networks", True, f"given: {', '.join(given)} (not listed)")
            )
            return
        try:
            nics = [n for n in self.networks() if "gpu-nic" in n]
        except UserError:
            report.checks.append(
                Check(
                    "gpu-nic networks",
                    False,
                    "this role may not list networks.networking.gke.io (they are cluster-"
                    "scoped): ask whoever provisions the cluster for the eight gpu-nic network "
                    "names and pass them with --gpu-nic-networks",
                )
            )
            return
        ok = len(nics) == fab.TCPXO_NICS
        detail = (
            f"found {', '.join(nics)}"
            if ok
            else f"found {len(nics)} gpu-nic networks ({', '.join(nics) or 'none'}); "
            f"TCPXO needs {fab.TCPXO_NICS}: give them with --gpu-nic-networks"
        )
        report.networks = nics if ok else []
        report.checks.append(Check("gpu-nic networks", ok, detail))

    def _tcpxo_nodes(self, options: RenderOptions, report: Preflight) -> None:
        """The selector picks nodes with all eight GPUs, and every NoSchedule/NoExecute taint
        on them is tolerated (the runtime inherits no placement of its own)."""
        where = ",".join(f"{k}={v}" for k, v in options.node_selector.items())
        try:
            nodes = self.nodes(options.node_selector)
        except UserError:
            report.checks.append(
                Check(
                    "nodes",
                    False,
                    "this role may not list nodes (cluster-scoped): ask whoever provisions the "
                    "cluster which label selects the A3 Mega pool and which taints it carries",
                )
            )
            return
        full = [n for n in nodes if int(_alloc(n, fab.GPU) or 0) == fab.TCPXO_GPUS]
        if not full:
            report.checks.append(
                Check(
                    "nodes",
                    False,
                    f"no node with {fab.TCPXO_GPUS} GPUs matches {where or 'any node'}: "
                    "select the A3 Mega pool with --node-selector "
                    "(e.g. cloud.google.com/gke-accelerator=nvidia-h100-mega-80gb)",
                )
            )
            return
        taints = sorted(
            {
                _taint(t)
                for n in full
                for t in (getattr(n.spec, "taints", None) or [])
                if getattr(t, "effect", "") in ("NoSchedule", "NoExecute")
                and not str(getattr(t, "key", "")).startswith(CONDITION_TAINTS)
            }
        )
        untolerated = [t for t in taints if not _tolerated(t, options.tolerations)]
        shown = f"; taints: {', '.join(taints)}" if taints else "; no taints"
        if untolerated:
            report.checks.append(
                Check(
                    "nodes",
                    False,
                    f"{len(full)} node(s) with {fab.TCPXO_GPUS} GPUs{shown}; not tolerated: "
                    f"{', '.join(untolerated)}: add --toleration for each (KEY[=VALUE]:EFFECT), "
                    "or the pods stay Pending",
                )
            )
            return
        report.checks.append(
            Check("nodes", True, f"{len(full)} node(s) with {fab.TCPXO_GPUS} GPUs{shown}")
        )

    def _tcpxo_pair(self, options: RenderOptions, report: Preflight) -> None:
        """The tcpxo-daemon image is the one paired with the NCCL plugin the cluster runs (the
        tag of its installer DaemonSet's image)."""
        daemon = fab.image_tag(options.tcpxo_daemon_image) or "?"
        overridden = options.tcpxo_daemon_image != fab.TCPXO_DAEMON_IMAGE
        if self.apps is None:
            return
        try:
            found = self._call(
                "list DaemonSets",
                self.apps.list_namespaced_daemon_set,
                fab.TCPXO_INSTALLER_NAMESPACE,
            )
        except UserError:
            report.checks.append(
                Check(
                    "plugin pair",
                    False,
                    f"this role may not read DaemonSets in {fab.TCPXO_INSTALLER_NAMESPACE}: ask "
                    "for the NCCL plugin version the cluster's TCPXO installer runs, and give "
                    "its paired daemon with --tcpxo-daemon-image",
                )
            )
            return
        installer = None
        for item in found.items:
            for container in [
                *(item.spec.template.spec.init_containers or []),
                *(item.spec.template.spec.containers or []),
            ]:
                if fab.TCPXO_PLUGIN_IMAGE in (container.image or ""):
                    installer = (item.metadata.name, container.image)
        if installer is None:
            report.checks.append(
                Check(
                    "plugin pair",
                    False,
                    f"no TCPXO NCCL plugin installer DaemonSet in {fab.TCPXO_INSTALLER_NAMESPACE} "
                    f"(an image named {fab.TCPXO_PLUGIN_IMAGE}): install GPUDirect-TCPXO's NCCL "
                    "plugin on the cluster first",
                )
            )
            return
        name, image = installer
        plugin = fab.image_tag(image) or "?"
        paired = fab.TCPXO_PAIRS.get(plugin)
        where = f"plugin {plugin} (DaemonSet {fab.TCPXO_INSTALLER_NAMESPACE}/{name})"
        if paired is None and overridden:
            ok = True  # the user's pairing for a plugin muster has no pair for
            detail = f"{where}; daemon {daemon}, given with --tcpxo-daemon-image (not checked)"
        elif paired is None:
            ok = False
            detail = (
                f"{where}: muster knows no daemon paired with it (it pairs "
                + ", ".join(f"{p} with {d}" for p, d in fab.TCPXO_PAIRS.items())
                + "): give the paired tcpxo-daemon image with --tcpxo-daemon-image"
            )
        else:
            ok = paired == daemon
            detail = (
                f"{where} and daemon {daemon}: a released pair"
                if ok
                else f"{where}, but the daemon is {daemon}, not its pair: use the daemon "
                f"{paired} (--tcpxo-daemon-image, or leave it out for muster's)"
            )
        report.checks.append(Check("plugin pair", ok, detail))

    # --- writing --------------------------------------------------------------------------

    def apply(
        self,
        objects: list[dict[str, Any]],
        trainer_version: str,
        *,
        dry_run: bool = False,
        confirm: Callable[[str], bool] | None = None,
    ) -> list[str]:
        """Apply in order; returns what was done, one line per object. ``dry_run``: the API
        server validates every object (server-side dry run) and nothing changes, a recreate
        included. A TrainJob that must be deleted and recreated is only deleted once
        ``confirm`` (given the reason) says yes, asked before anything is written; without
        ``confirm`` it is refused and nothing changes."""
        runtime = None
        for obj in objects:
            if obj["kind"] in ("TrainingRuntime", "ClusterTrainingRuntime"):
                runtime = obj
        recreate: dict[str, str] = {}  # TrainJob name -> why it must be recreated
        for obj in objects:
            kind, name = obj["kind"], obj["metadata"]["name"]
            if kind != "TrainJob":
                continue
            ref = obj["spec"]["runtimeRef"]
            target = runtime or self.get(ref["kind"], ref["name"])
            if target is None:
                raise UserError(
                    f"TrainJob {name} references {ref['kind']} {ref['name']}, which the "
                    "cluster does not have (`muster k8s preflight` checks it)"
                )
            check([obj], runtime=target, trainer_version=trainer_version)
            existing = self.get(kind, name)
            if existing is None:
                continue
            changed = [
                f
                for f in IMMUTABLE
                if _canon(existing.get("spec", {}).get(f)) != _canon(obj["spec"].get(f))
                and obj["spec"].get(f) is not None
            ]
            if changed:
                recreate[name] = (
                    f"{kind} {name}: {', '.join(changed)} cannot change in place, so "
                    "the running TrainJob (and its pods) must be deleted and created anew"
                )
        if not dry_run:
            for why in recreate.values():
                if confirm is None or not confirm(why):
                    raise UserError(
                        f"{why}; not done: confirm it, or pass --yes (nothing was changed)"
                    )
        done = []
        for obj in objects:
            kind, name = obj["kind"], obj["metadata"]["name"]
            if kind == "TrainJob" and name in recreate:
                if dry_run:
                    done.append(f"{recreate[name]} (dry run: nothing deleted)")
                    continue
                self._delete(kind, name)
                self._wait_gone(kind, name)
                self._ssa(obj)
                changed_fields = recreate[name].split(": ", 1)[1].split(" cannot")[0]
                done.append(
                    f"{kind} {name} recreated: {changed_fields} cannot change in "
                    "place, so the old TrainJob (and its pods) was deleted"
                )
                continue
            if dry_run:
                before = self.get(kind, name)
                after = self._ssa(obj, dry_run=True)  # what the server would store
                if before is None:
                    what = "would be created"
                else:
                    paths = _changes(before.get("spec"), (after or obj).get("spec"), "spec")
                    what = "would change " + ", ".join(paths) if paths else "unchanged"
                done.append(f"{kind} {name} {what} (server-side dry run: valid, nothing changed)")
            else:
                self._ssa(obj)
                done.append(f"{kind} {name} applied (server-side, field manager {FIELD_MANAGER})")
        return done

    def _ssa(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any] | None:
        """Server-side apply; returns the object as the server stored it (or would)."""
        kind, name = obj["kind"], obj["metadata"]["name"]
        body = json.loads(json.dumps(obj))
        kwargs = {
            "field_manager": FIELD_MANAGER,
            "force": True,
            "_content_type": "application/apply-patch+yaml",
        }
        if dry_run:
            kwargs["dry_run"] = "All"
        if kind == "ClusterTrainingRuntime":
            stored = self._call(
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
            stored = self._call(
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
        return dict(stored) if isinstance(stored, dict) else None

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

    def logs(self, trainjob: str, replicated_job: str = "node") -> list[str]:
        """Every pod's whole log (of the ``node`` replicated job, or another: ``launcher``
        under an MPI runtime), each line tagged [pod/NAME/CONTAINER]."""
        pods = self.pods(trainjob, replicated_job)
        if not pods:
            raise UserError(
                f"TrainJob {trainjob} has no {replicated_job} pods in namespace "
                f"{self.namespace}"
                + (
                    ""
                    if replicated_job != "node"
                    else " (an MPI runtime: --replicated-job launcher)"
                )
            )
        lines = []
        for pod in pods:
            container = _container_of(pod)
            text = self._call(
                f"logs of {pod.metadata.name}",
                self.core.read_namespaced_pod_log,
                pod.metadata.name,
                self.namespace,
                container=container,
            )
            tag = f"[pod/{pod.metadata.name}/{container}]"
            lines += [f"{tag} {line}" for line in text.splitlines()]
        return lines


def _container_of(pod: Any) -> str:
    """The container whose log is the job's: Trainer names its trainer container ``node``,
    in a launcher's pod as in a node's; a pod with one container of another name, that one."""
    spec = getattr(pod, "spec", None)
    names = [c.name for c in (getattr(spec, "containers", None) or [])]
    if "node" in names or not names:
        return "node"
    return str(names[0]) if len(names) == 1 else "node"


# Taints the node controller sets for a node's condition (cordoned, not ready): transient,
# and not the pool's own; a pod should not tolerate them.
CONDITION_TAINTS = ("node.kubernetes.io/", "node.cloudprovider.kubernetes.io/")


def _taint(taint: Any) -> str:
    value = getattr(taint, "value", None)
    return f"{taint.key}{'=' + value if value else ''}:{taint.effect}"


def _tolerated(taint: str, tolerations: tuple[dict[str, str], ...]) -> bool:
    """Whether one of ``tolerations`` (as --toleration gives them) tolerates ``taint``
    (KEY[=VALUE]:EFFECT), by Kubernetes' rules: Exists matches any value, no effect any effect."""
    body, _, effect = taint.rpartition(":")
    key, _, value = body.partition("=")
    for t in tolerations:
        if t.get("key") not in (None, "", key):
            continue
        if t.get("effect") not in (None, "", effect):
            continue
        if t.get("operator") == "Exists" or t.get("value", "") == value:
            return True
    return False


def _alloc(node: Any, resource: str) -> Any:
    allocatable = getattr(node.status, "allocatable", None) or {}
    return allocatable.get(resource)


def _no_nodes(options: RenderOptions) -> str:
    where = ",".join(f"{k}={v}" for k, v in options.node_selector.items()) or "any node"
    return f"no GPU node matches {where}: check --node-selector"


def _changes(before: Any, after: Any, path: str, depth: int = 3) -> list[str]:
    """The paths (to ``depth`` levels) where ``after`` sets something ``before`` lacks or
    holds differently: what a server-side apply of ``after`` would change."""
    if _canon(before) == _canon(after):
        return []
    if depth == 0 or not isinstance(before, dict) or not isinstance(after, dict):
        return [path]
    found = []
    for key in after:
        found += _changes(before.get(key), after[key], f"{path}.{key}", depth - 1)
    return found or [path]


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)
