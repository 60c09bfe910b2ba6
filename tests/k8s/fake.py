"""An in-memory stand-in for the kubernetes client's CoreV1Api and CustomObjectsApi.

Only the methods muster.k8s.cluster calls, with the same signatures, and the API server's
behaviour muster relies on: 404s, label selectors, server-side apply recording its field
manager, and a TrainJob's immutable trainer refused with 422 as the CEL rule does.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any


class ApiException(Exception):
    def __init__(self, status: int, reason: str = "") -> None:
        super().__init__(f"({status}) {reason}")
        self.status = status
        self.reason = reason


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def node(
    name: str, labels: dict[str, str], taints: tuple[str, ...] = (), **allocatable: str
) -> SimpleNamespace:
    """A node; ``taints`` as kubectl writes them (KEY[=VALUE]:EFFECT)."""
    parsed = []
    for taint in taints:
        body, _, effect = taint.rpartition(":")
        key, _, value = body.partition("=")
        parsed.append(SimpleNamespace(key=key, value=value or None, effect=effect))
    return SimpleNamespace(
        metadata=SimpleNamespace(name=name, labels=labels),
        spec=SimpleNamespace(taints=parsed or None),
        status=SimpleNamespace(allocatable=dict(allocatable)),
    )


def daemon_set(name: str, image: str) -> SimpleNamespace:
    container = SimpleNamespace(name="installer", image=image)
    return SimpleNamespace(
        metadata=SimpleNamespace(name=name),
        spec=SimpleNamespace(
            template=SimpleNamespace(
                spec=SimpleNamespace(init_containers=[container], containers=[])
            )
        ),
    )


class FakeApps:
    """AppsV1Api's DaemonSet listing; ``forbidden`` answers 403 as a namespace-only role."""

    def __init__(self) -> None:
        self.daemon_sets: dict[str, list[SimpleNamespace]] = {}
        self.forbidden = False

    def list_namespaced_daemon_set(self, namespace: str) -> SimpleNamespace:
        if self.forbidden:
            raise ApiException(403, "daemonsets.apps is forbidden")
        return SimpleNamespace(items=list(self.daemon_sets.get(namespace, [])))


def pod(
    name: str, trainjob: str, log: str, phase: str = "Running", replicated_job: str = "node"
) -> SimpleNamespace:
    labels = {
        "jobset.sigs.k8s.io/jobset-name": trainjob,
        "jobset.sigs.k8s.io/replicatedjob-name": replicated_job,
    }
    return SimpleNamespace(
        metadata=SimpleNamespace(name=name, labels=labels),
        status=SimpleNamespace(phase=phase),
        spec=SimpleNamespace(node_name=f"host-of-{name}"),
        log=log,
    )


class FakeCore:
    def __init__(self) -> None:
        self.node_list: list[SimpleNamespace] = []
        self.pod_list: list[SimpleNamespace] = []
        self.log_calls: list[dict[str, Any]] = []
        self.nodes_forbidden = False  # a namespace-only role: nodes are cluster-scoped

    def list_node(self, label_selector: str = "") -> SimpleNamespace:
        if self.nodes_forbidden:
            raise ApiException(403, "nodes is forbidden")
        return SimpleNamespace(
            items=[n for n in self.node_list if _matches(n.metadata.labels, label_selector)]
        )

    def list_namespaced_pod(self, namespace: str, label_selector: str = "") -> SimpleNamespace:
        return SimpleNamespace(
            items=[p for p in self.pod_list if _matches(p.metadata.labels, label_selector)]
        )

    def read_namespaced_pod_log(self, name: str, namespace: str, **kwargs: Any) -> str:
        self.log_calls.append({"name": name, **kwargs})
        for p in self.pod_list:
            if p.metadata.name == name:
                return str(p.log)
        raise ApiException(404, f"pod {name} not found")


class FakeCustom:
    """Objects keyed by (plural, namespace or None, name)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        self.managers: list[str] = []
        self.deleted: list[str] = []
        self.cluster_lists: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.delete_polls = 0  # how many reads a deleted object survives (foreground deletion)
        self.terminating: dict[tuple[str, str | None, str], int] = {}
        self.listed: list[str] = []  # cluster-scoped lists asked for
        self.dry_runs: list[str] = []  # names applied with dryRun=All
        self.forbidden = False  # cluster-scoped lists refused (a namespace-only role)

    def _get(self, plural: str, namespace: str | None, name: str) -> dict[str, Any]:
        key = (plural, namespace, name)
        if self.terminating.get(key, 0) > 0:  # a foreground delete still under way
            self.terminating[key] -= 1
            if self.terminating[key] == 0:
                self.objects.pop(key, None)
        try:
            return copy.deepcopy(self.objects[(plural, namespace, name)])
        except KeyError:
            raise ApiException(404, f"{plural} {name} not found") from None

    def get_cluster_custom_object(
        self, group: str, version: str, plural: str, name: str
    ) -> dict[str, Any]:
        return self._get(plural, None, name)

    def get_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str
    ) -> dict[str, Any]:
        return self._get(plural, namespace, name)

    def list_cluster_custom_object(self, group: str, version: str, plural: str) -> dict[str, Any]:
        self.listed.append(f"{plural}.{group}")
        if self.forbidden:
            raise ApiException(403, f"{plural}.{group} is forbidden at the cluster scope")
        if (group, plural) not in self.cluster_lists:
            raise ApiException(404, f"the server could not find {plural}.{group}")
        return {"items": copy.deepcopy(self.cluster_lists[(group, plural)])}

    def _apply(
        self, key: tuple[str, str | None, str], body: dict[str, Any], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        assert kwargs.get("_content_type") == "application/apply-patch+yaml"
        self.managers.append(kwargs["field_manager"])
        old = self.objects.get(key)
        if old is not None and "deletionTimestamp" in old["metadata"]:
            raise AssertionError(f"applied over {key} while it is being deleted: lost with it")
        if old is not None and key[0] == "trainjobs":
            for part in ("trainer", "runtimeRef"):
                if old["spec"].get(part) != body["spec"].get(part):
                    raise ApiException(422, f"spec.{part}: Invalid value: field is immutable")
        if kwargs.get("dry_run") == "All":  # validated as a real apply, stored nowhere
            self.dry_runs.append(key[2])
            return body
        self.objects[key] = copy.deepcopy(body)
        return body

    def patch_namespaced_custom_object(
        self,
        group: str,
        version: str,
        namespace: str,
        plural: str,
        name: str,
        body: dict[str, Any],
        **kwargs: Any,
    ) -> dict[str, Any]:
        return self._apply((plural, namespace, name), body, kwargs)

    def patch_cluster_custom_object(
        self, group: str, version: str, plural: str, name: str, body: dict[str, Any], **kwargs: Any
    ) -> dict[str, Any]:
        return self._apply((plural, None, name), body, kwargs)

    def delete_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str, **kwargs: Any
    ) -> dict[str, Any]:
        key = (plural, namespace, name)
        if key not in self.objects:
            raise ApiException(404, f"{plural} {name} not found")
        self.deleted.append(f"{plural}/{name}")
        if self.delete_polls:
            self.terminating[key] = self.delete_polls
            self.objects[key]["metadata"]["deletionTimestamp"] = "2026-11-29T00:00:00Z"
        else:
            del self.objects[key]
        return {}
