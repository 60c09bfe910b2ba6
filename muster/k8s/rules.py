"""Trainer's rules that its CRD schemas do not carry (CEL on names, the admission webhook).

``check`` refuses, naming the object and field:
- env in a runtime patch for the node or an initializer container (worker env belongs in
  spec.trainer.env);
- PET_* names in spec.trainer.env (Trainer sets those for torchrun);
- a runtime patch naming a replicated job or container the runtime does not define;
- a runtime patch manager without a domain prefix (``example.com/team``);
- object names that are not RFC 1035 labels of at most 63 characters;
- a TrainingRuntime whose node replicated job lacks the trainjob-ancestor-step label (Trainer
  would then apply none of the TrainJob's trainer block);
- on Trainer 2.2, a resourcesPerNode that does not repeat the GPU request (2.2 replaces the
  runtime's resources with it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from muster.errors import FieldError, SpecError

ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
NO_PATCH_ENV = ("node", "dataset-initializer", "model-initializer")
RFC1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MANAGER = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+/[-A-Za-z0-9_.]+"
)

# The shape of Trainer's torch-distributed ClusterTrainingRuntime: what a patch may target.
TORCH_DISTRIBUTED: dict[str, Any] = {
    "apiVersion": "trainer.kubeflow.org/v1alpha1",
    "kind": "ClusterTrainingRuntime",
    "metadata": {"name": "torch-distributed"},
    "spec": {
        "mlPolicy": {"numNodes": 1, "torch": {}},
        "template": {
            "spec": {
                "replicatedJobs": [
                    {
                        "name": "node",
                        "template": {
                            "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                            "spec": {"template": {"spec": {"containers": [{"name": "node"}]}}},
                        },
                    }
                ]
            }
        },
    },
}


def _jobs(runtime: dict[str, Any]) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = runtime["spec"]["template"]["spec"].get("replicatedJobs", [])
    return jobs


def _containers(pod: dict[str, Any]) -> Iterable[str]:
    for key in ("initContainers", "containers"):
        for container in pod.get(key) or []:
            yield container["name"]


def runtime_targets(runtime: dict[str, Any]) -> dict[str, set[str]]:
    """Replicated job name -> the container names its pods define."""
    return {
        job["name"]: set(_containers(job["template"]["spec"]["template"].get("spec", {})))
        for job in _jobs(runtime)
    }


def _name_errors(obj: dict[str, Any], where: str) -> list[FieldError]:
    name = str(obj.get("metadata", {}).get("name", ""))
    if len(name) > 63:
        return [FieldError(f"{where}.metadata.name", f"{name!r} is longer than 63 characters")]
    if not RFC1035.fullmatch(name):
        return [
            FieldError(
                f"{where}.metadata.name",
                f"{name!r} is not an RFC 1035 label (lowercase letters, digits, '-', starting "
                "with a letter)",
            )
        ]
    return []


def _runtime_errors(runtime: dict[str, Any], where: str) -> list[FieldError]:
    errors = _name_errors(runtime, where)
    for i, job in enumerate(_jobs(runtime)):
        if job["name"] != "node":
            continue
        labels = job["template"].get("metadata", {}).get("labels", {})
        if labels.get(ANCESTOR_LABEL) != "trainer":
            errors.append(
                FieldError(
                    f"{where}.spec.template.spec.replicatedJobs[{i}].template.metadata.labels",
                    f"the node job needs {ANCESTOR_LABEL}: trainer, or Trainer applies none of "
                    "the TrainJob's trainer block",
                )
            )
    return errors


def _trainjob_errors(
    job: dict[str, Any], runtime: dict[str, Any], trainer_version: str, where: str
) -> list[FieldError]:
    errors = _name_errors(job, where)
    spec = job["spec"]
    trainer = spec.get("trainer", {})
    for i, var in enumerate(trainer.get("env", [])):
        if str(var["name"]).startswith("PET_"):
            errors.append(
                FieldError(
                    f"{where}.spec.trainer.env[{i}]",
                    f"{var['name']}: PET_* variables are set by Trainer; remove it",
                )
            )
    targets = runtime_targets(runtime)
    runtime_name = runtime["metadata"]["name"]
    for p, patch in enumerate(spec.get("runtimePatches", [])):
        base = f"{where}.spec.runtimePatches[{p}]"
        if not MANAGER.fullmatch(str(patch.get("manager", ""))):
            errors.append(
                FieldError(
                    f"{base}.manager",
                    f"{patch.get('manager')!r} needs a domain prefix, like example.com/platform",
                )
            )
        jobs = patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {})
        for j, rjob in enumerate(jobs.get("replicatedJobs", [])):
            jwhere = f"{base}.trainingRuntimeSpec.template.spec.replicatedJobs[{j}]"
            if rjob["name"] not in targets:
                errors.append(
                    FieldError(
                        f"{jwhere}.name",
                        f"runtime {runtime_name} has no replicated job {rjob['name']!r} "
                        f"(it has {', '.join(sorted(targets))})",
                    )
                )
                continue
            pod = rjob.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            for key in ("initContainers", "containers"):
                for c, container in enumerate(pod.get(key) or []):
                    cwhere = f"{jwhere}.template.spec.template.spec.{key}[{c}]"
                    if container["name"] not in targets[rjob["name"]]:
                        errors.append(
                            FieldError(
                                f"{cwhere}.name",
                                f"runtime {runtime_name} defines no container "
                                f"{container['name']!r} in {rjob['name']!r}; a patch cannot "
                                "add one",
                            )
                        )
                    if container["name"] in NO_PATCH_ENV and container.get("env"):
                        errors.append(
                            FieldError(
                                f"{cwhere}.env",
                                f"Trainer rejects env in a patch for {container['name']!r}: "
                                "put worker variables in spec.trainer.env",
                            )
                        )
    resources = trainer.get("resourcesPerNode")
    if trainer_version == "2.2" and resources is not None:
        for part in ("limits", "requests"):
            if "nvidia.com/gpu" not in (resources.get(part) or {}):
                errors.append(
                    FieldError(
                        f"{where}.spec.trainer.resourcesPerNode.{part}",
                        "on Trainer 2.2 resourcesPerNode replaces the runtime's resources: "
                        "repeat the GPU request (nvidia.com/gpu) in it",
                    )
                )
    return errors


def check(objects: list[dict[str, Any]], *, runtime: dict[str, Any], trainer_version: str) -> None:
    """Raise SpecError listing every rule the objects break; ``runtime`` is the one the
    TrainJobs reference (rendered, read from the cluster, or torch-distributed's shape)."""
    errors: list[FieldError] = []
    for i, obj in enumerate(objects):
        where = f"{obj.get('kind', 'object')}[{i}]"
        if obj.get("kind") in ("TrainingRuntime", "ClusterTrainingRuntime"):
            errors += _runtime_errors(obj, where)
        elif obj.get("kind") == "TrainJob":
            errors += _trainjob_errors(obj, runtime, trainer_version, where)
    if errors:
        raise SpecError(errors, source="Kubeflow Trainer objects")
