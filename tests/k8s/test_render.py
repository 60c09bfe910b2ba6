"""muster k8s render: every fabric, both Trainer versions, against the vendored CRD schemas."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from muster.errors import SpecError
from muster.k8s.render import Rendered, RenderOptions, interfaces_of, render
from muster.k8s.rules import TORCH_DISTRIBUTED, check
from muster.spec import parse_job
from tests.k8s.schema import errors

GOLDEN = Path(__file__).parent / "golden"
NETWORKS = tuple(f"aicr-demo-gpu-nic-{i}" for i in range(8))
JOB: dict[str, Any] = {
    "name": "llama-ft",
    "image": "ghcr.io/example/llama-ft:1.0",
    "entrypoint": "-m train.finetune",
    "args": ["--epochs", "3"],
    "env": {"PYTHONUNBUFFERED": "1"},
    "resources": {"gpus": 8},
    "distributed": {"num_workers": 2, "procs_per_worker": 8, "backend": "nccl"},
}
PLACEMENT = {
    "node_selector": {"cloud.google.com/gke-accelerator": "nvidia-h100-mega-80gb"},
    "tolerations": ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},),
}
FABRIC_OPTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "tcpxo": {"gpu_nic_networks": NETWORKS, **PLACEMENT},
    "efa": {"efa_count": 32},
    "ib": {},
}
CASES = [(f, v) for f in FABRIC_OPTIONS for v in ("2.2", "2.3")]


def rendered(fabric: str, version: str, **extra: Any) -> tuple[list[dict[str, Any]], list[str]]:
    options = RenderOptions(
        fabric=fabric,  # type: ignore[arg-type]
        trainer_version=version,  # type: ignore[arg-type]
        **{**FABRIC_OPTIONS[fabric], **extra},
    )
    out = render(parse_job(dict(JOB)), options)
    return out.objects, out.warnings


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def env_of(job: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in job["spec"]["trainer"].get("env", [])}


@pytest.mark.parametrize(("fabric", "version"), CASES)
def test_every_object_fits_both_trainer_schemas_strictly(fabric: str, version: str) -> None:
    objects, _ = rendered(fabric, version)
    for obj in objects:
        for schema_version in ("2.2", "2.3"):
            assert errors(obj, schema_version) == [], (obj["kind"], schema_version)


@pytest.mark.parametrize(("fabric", "version"), CASES)
def test_golden(fabric: str, version: str) -> None:
    objects, warnings = rendered(fabric, version)
    text = Rendered(objects, warnings).to_yaml() + "".join(f"# warning: {w}\n" for w in warnings)
    path = GOLDEN / f"{fabric}-{version}.yaml"
    if os.environ.get("MUSTER_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; MUSTER_UPDATE_GOLDEN=1 rewrites it"


def test_strict_mode_catches_a_typo() -> None:
    objects, _ = rendered("none", "2.3")
    job = json.loads(json.dumps(objects[0]))
    job["spec"]["trainer"]["numNode"] = 2
    assert any("numNode" in e for e in errors(job, "2.3"))
    # deep in a runtime's pod template, and in a runtime patch
    objects, _ = rendered("tcpxo", "2.2")
    runtime = json.loads(json.dumps(by_kind(objects, "TrainingRuntime")))
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    assert any("restartPolicyy" in e for e in errors(runtime, "2.2"))
    objects, _ = rendered("efa", "2.2")
    job = json.loads(json.dumps(objects[0]))
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "securityContxt"
    ] = {}
    assert any("securityContxt" in e for e in errors(job, "2.2"))


def test_none_is_a_trainjob_against_torch_distributed() -> None:
    objects, warnings = rendered("none", "2.3")
    (job,) = objects
    assert job["spec"]["runtimeRef"] == {
        "name": "torch-distributed",
        "kind": "ClusterTrainingRuntime",
        "apiGroup": "trainer.kubeflow.org",
    }
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 2
    assert trainer["numProcPerNode"] == 8
    assert trainer["command"] == ["torchrun", "-m", "train.finetune"]
    assert trainer["args"] == ["--epochs", "3"]
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 8}
    assert warnings == []


def test_tcpxo_runtime_carries_the_wiring_and_the_trainjob_none() -> None:
    objects, warnings = rendered("tcpxo", "2.2", nccl_env="inline")
    assert any("NCCL plugin v1.0.15" in w and "--nccl-env inline" in w for w in warnings)
    runtime, job = by_kind(objects, "TrainingRuntime"), by_kind(objects, "TrainJob")
    assert [o["kind"] for o in objects] == ["TrainingRuntime", "TrainJob"]
    node = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]
    assert node["template"]["metadata"]["labels"] == {
        "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"
    }
    pod = node["template"]["spec"]["template"]
    notes = pod["metadata"]["annotations"]
    assert notes["networking.gke.io/default-interface"] == "eth0"
    assert interfaces_of(runtime) == list(NETWORKS)
    assert json.loads(notes["networking.gke.io/interfaces"])[0] == {
        "interfaceName": "eth0",
        "network": "default",
    }
    assert "/dev/nvidia7" in notes["devices.gke.io/container.tcpxo-daemon"]
    spec = pod["spec"]
    (daemon,) = spec["initContainers"]
    assert daemon["name"] == "tcpxo-daemon"
    assert daemon["restartPolicy"] == "Always"
    assert "tcpgpudmarxd-dev:v1.0.21" in daemon["image"]
    (worker,) = spec["containers"]
    assert worker["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert worker["resources"]["limits"] == {"nvidia.com/gpu": 8}
    env = {e["name"]: e["value"] for e in worker["env"]}
    assert env["NCCL_FASTRAK_IFNAME"] == "eth1,eth2,eth3,eth4,eth5,eth6,eth7,eth8"
    host_paths = [v for v in spec["volumes"] if "hostPath" in v]
    assert len(host_paths) == 4
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
    assert spec["nodeSelector"] == PLACEMENT["node_selector"]
    assert spec["tolerations"] == list(PLACEMENT["tolerations"])
    assert job["spec"]["runtimeRef"] == {
        "name": "llama-ft-tcpxo",
        "kind": "TrainingRuntime",
        "apiGroup": "trainer.kubeflow.org",
    }
    assert "resourcesPerNode" not in job["spec"]["trainer"]
    assert "runtimePatches" not in job["spec"]
    assert not any(k.startswith("NCCL_") for k in env_of(job))


def test_tcpxo_profile_mode_sources_the_plugins_env_at_start_up() -> None:
    objects, warnings = rendered("tcpxo", "2.3")  # the default, as seed 004 has it
    assert not any("--nccl-env inline" in w for w in warnings)
    runtime, job = by_kind(objects, "TrainingRuntime"), by_kind(objects, "TrainJob")
    worker = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"
    ]["spec"]["containers"][0]
    assert not any(e["name"] == "NCCL_FASTRAK_IFNAME" for e in worker["env"])
    command = job["spec"]["trainer"]["command"]
    assert command[:2] == ["/bin/bash", "-c"]
    assert command[2].startswith(
        "export NCCL_LIB_DIR=/usr/local/nvidia/lib64 && "
        "source /usr/local/nvidia/lib64/nccl-env-profile.sh && exec"
    )
    # --nccl-debug comes after the profile, which may set its own NCCL_DEBUG.
    objects, _ = rendered("tcpxo", "2.3", nccl_debug="INFO")
    debug = by_kind(objects, "TrainJob")["spec"]["trainer"]["command"][2]
    assert "nccl-env-profile.sh && export NCCL_DEBUG=INFO && exec torchrun" in debug
    assert "exec torchrun -m train.finetune" in command[2]
    assert command[3] == "torchrun"  # $0; the job's args follow as "$@"
    assert job["spec"]["trainer"]["args"] == ["--epochs", "3"]


def test_efa_repeats_every_resource_and_sets_ipc_lock_by_patch() -> None:
    objects, warnings = rendered("efa", "2.2")
    (job,) = objects
    resources = job["spec"]["trainer"]["resourcesPerNode"]
    for part in ("limits", "requests"):
        assert resources[part] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}
    env = env_of(job)
    assert env["FI_EFA_FORK_SAFE"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    # The plugin's directory goes in front of the image's own path at start: a pod value
    # would hide the image's ENV.
    assert "LD_LIBRARY_PATH" not in env
    command = job["spec"]["trainer"]["command"]
    assert command[:2] == ["/bin/bash", "-c"]
    assert command[2].startswith(
        'export LD_LIBRARY_PATH="/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu'
        '${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && exec torchrun -m train.finetune'
    )
    (patch,) = job["spec"]["runtimePatches"]
    assert patch["manager"] == "muster.dev/fabric"
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"
    ]["spec"]
    assert pod["containers"] == [
        {"name": "node", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}
    ]
    assert any("EFA stack" in w for w in warnings)
    assert any("Trainer 2.2 replaces" in w for w in warnings)


def test_ib_wiring() -> None:
    objects, warnings = rendered("ib", "2.3")
    (job,) = objects
    assert job["spec"]["trainer"]["resourcesPerNode"]["requests"] == {
        "nvidia.com/gpu": 8,
        "rdma/hca_shared_devices_a": 1,
    }
    env = env_of(job)
    assert (env["NCCL_IB_DISABLE"], env["NCCL_NET_PLUGIN"], env["NCCL_SOCKET_IFNAME"]) == (
        "0",
        "none",
        "eth0",
    )
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"
    ][0]["template"]["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    assert pod["containers"][0]["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert any("rdma-core" in w for w in warnings)


def test_a_fabric_fixed_variable_is_replaced_with_a_warning() -> None:
    job = dict(JOB, env={"FI_PROVIDER": "tcp", "LD_LIBRARY_PATH": "/opt/efa/lib"})
    out = render(parse_job(job), RenderOptions(fabric="efa", efa_count=4))
    env = env_of(out.objects[0])
    assert env["FI_PROVIDER"] == "efa"
    assert env["LD_LIBRARY_PATH"] == "/opt/efa/lib"  # not fixed by the fabric: the user's stands
    assert any("env.FI_PROVIDER='tcp' replaced by 'efa'" in w for w in out.warnings)


@pytest.mark.parametrize(
    ("options", "job", "field", "words"),
    [
        ({"fabric": "tcpxo"}, {}, "--gpu-nic-networks", "eight gpu-nic networks"),
        (
            {"fabric": "tcpxo", "gpu_nic_networks": NETWORKS[:7]},
            {},
            "--gpu-nic-networks",
            "expected 8 names, got 7",
        ),
        (
            {
                "fabric": "tcpxo",
                "gpu_nic_networks": ("network.networking.gke.io/a-gpu-nic-0", *NETWORKS[1:]),
            },
            {},
            "--gpu-nic-networks",
            "give the bare name 'a-gpu-nic-0'",
        ),
        (
            {"fabric": "tcpxo", "gpu_nic_networks": ("vpc-0", *NETWORKS[1:])},
            {},
            "--gpu-nic-networks",
            "not a gpu-nic network",
        ),
        (
            {"fabric": "tcpxo", "gpu_nic_networks": NETWORKS},
            {"resources": {"gpus": 4}, "distributed": {"num_workers": 2}},
            "resources.gpus",
            "all 8 GPUs",
        ),
        ({"fabric": "efa"}, {}, "--efa-count", "muster k8s preflight"),
        ({"fabric": "ib"}, {"resources": {"gpus": 0}}, "resources.gpus", "GPU nodes"),
        ({}, {"image": None}, "image", "container image"),
        ({}, {"env": {"PET_NNODES": "2"}}, "env.PET_NNODES", "remove it"),
        (
            {},
            {
                "distributed": {
                    "num_workers": 2,
                    "procs_per_worker": 8,
                    "backend": "nccl",
                    "membership": "window",
                }
            },
            "distributed.membership",
            "use membership: pool",
        ),
    ],
)
def test_bad_input_names_the_field_and_the_fix(
    options: dict[str, Any], job: dict[str, Any], field: str, words: str
) -> None:
    data = {k: v for k, v in {**JOB, **job}.items() if v is not None}
    if data["resources"].get("gpus") == 0:
        data["distributed"] = {**data["distributed"], "backend": "gloo"}
    with pytest.raises(SpecError) as caught:
        render(parse_job(data), RenderOptions(**options))
    assert field in caught.value.fields
    assert words in str(caught.value)


def test_webhook_and_cel_rules_refuse_what_trainer_would() -> None:
    objects, _ = rendered("efa", "2.2")
    job = json.loads(json.dumps(objects[0]))
    patch = job["spec"]["runtimePatches"][0]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"
    ]["spec"]
    pod["containers"][0]["env"] = [{"name": "X", "value": "1"}]
    pod["containers"].append({"name": "sidecar", "securityContext": {}})
    patch["manager"] = "platform"
    job["spec"]["trainer"]["env"].append({"name": "PET_MASTER_PORT", "value": "1"})
    job["spec"]["trainer"]["resourcesPerNode"]["limits"].pop("nvidia.com/gpu")
    job["metadata"]["name"] = "9-llama"
    with pytest.raises(SpecError) as caught:
        check([job], runtime=TORCH_DISTRIBUTED, trainer_version="2.2")
    text = str(caught.value)
    assert "Trainer rejects env in a patch for 'node'" in text
    assert "defines no container 'sidecar'" in text
    assert "needs a domain prefix" in text
    assert "PET_MASTER_PORT" in text
    assert "repeat the GPU request" in text
    assert "not an RFC 1035 label" in text
    long = json.loads(json.dumps(objects[0]))
    long["metadata"]["name"] = "a" * 64
    with pytest.raises(SpecError, match="longer than 63"):
        check([long], runtime=TORCH_DISTRIBUTED, trainer_version="2.3")


def test_a_runtime_without_the_ancestor_label_is_refused() -> None:
    objects, _ = rendered("tcpxo", "2.3")
    runtime = json.loads(json.dumps(by_kind(objects, "TrainingRuntime")))
    runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["metadata"] = {}
    with pytest.raises(SpecError, match="trainjob-ancestor-step"):
        check([runtime], runtime=runtime, trainer_version="2.3")


@pytest.mark.parametrize("fabric", ["tcpxo", "efa", "ib"])
def test_a_fabric_refuses_fewer_ranks_than_gpus_naming_both_fields(fabric: str) -> None:
    """gpus: 8 without procs_per_worker would run one rank on one GPU of eight."""
    job = dict(JOB, distributed={"num_workers": 2, "backend": "nccl"})
    options = RenderOptions(fabric=fabric, **FABRIC_OPTIONS[fabric])  # type: ignore[arg-type]
    with pytest.raises(SpecError) as caught:
        render(parse_job(job), options)
    assert "distributed.procs_per_worker" in caught.value.fields
    assert "resources.gpus" in str(caught.value)
    assert "set procs_per_worker: 8" in str(caught.value)


def test_no_fabric_warns_of_idle_gpus_and_still_renders() -> None:
    job = dict(JOB, distributed={"num_workers": 2, "backend": "nccl"})
    out = render(parse_job(job), RenderOptions())
    assert out.objects[0]["spec"]["trainer"]["numProcPerNode"] == 1
    assert any("1 rank(s) drive 1 of the 8 GPUs" in w for w in out.warnings), out.warnings


def test_fields_kubernetes_drops_are_named_and_the_controllers_env_reaches_the_pods() -> None:
    job = dict(
        JOB,
        workdir="src",
        output_dir="ckpt",
        priority=5,
        hang_timeout="10m",
        distributed={**JOB["distributed"], "rendezvous": {"port": 29500}, "transport": "auto"},
    )
    out = render(parse_job(job), RenderOptions())
    said = "\n".join(out.warnings)
    for name in (
        "workdir",
        "output_dir",
        "priority",
        "hang_timeout",
        "distributed.rendezvous.port",
        "distributed.transport",
    ):
        assert f"{name} is not carried to Kubernetes" in said, said
    assert "distributed.network" not in said  # not set: nothing to say
    env = env_of(out.objects[0])
    assert env["MUSTER_OUTPUT_DIR"] == "ckpt"
    assert env["OMP_NUM_THREADS"] == "1"
    # A spec that sets none of them renders without a word about them; the user's own
    # OMP_NUM_THREADS stands.
    plain = render(  # (fields set to their defaults drop nothing)
        parse_job(dict(JOB, env={"OMP_NUM_THREADS": "4"}, priority=0, output_dir="outputs")),
        RenderOptions(),
    )
    assert not any("not carried" in w for w in plain.warnings)
    assert env_of(plain.objects[0])["OMP_NUM_THREADS"] == "4"
    assert env_of(plain.objects[0])["MUSTER_OUTPUT_DIR"] == "outputs"


@pytest.mark.parametrize("fabric", ["tcpxo", "efa"])
def test_a_wrapped_entrypoint_with_shell_characters_stays_one_word(
    fabric: str, tmp_path: Path
) -> None:
    """The entrypoint goes into bash -c quoted; the args travel as "$@". bash itself runs
    the rendered command (with torchrun replaced by a script that prints its argv)."""
    evil = "train;$(touch${IFS}pwned)&&.py"
    args = ["--name", "a b", "$HOME", "x'y"]
    job = dict(JOB, entrypoint=evil, args=args)
    out = render(parse_job(job), RenderOptions(fabric=fabric, **FABRIC_OPTIONS[fabric]))  # type: ignore[arg-type]
    trainer = by_kind(out.objects, "TrainJob")["spec"]["trainer"]
    command = trainer["command"]
    assert command[:2] == ["/bin/bash", "-c"]
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "torchrun").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    (shim / "torchrun").chmod(0o755)
    (tmp_path / "profile.sh").write_text("true\n")
    script = command[2].replace(
        "/usr/local/nvidia/lib64/nccl-env-profile.sh", str(tmp_path / "profile.sh")
    )
    done = subprocess.run(
        ["/bin/bash", "-c", script, *command[3:], *trainer["args"]],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": f"{shim}:/usr/bin:/bin", "HOME": "/home/x"},
        timeout=10,
        check=True,
    )
    assert done.stdout.splitlines() == [evil, *args]
    assert not (tmp_path / "pwned").exists()


def test_efa_and_ib_take_the_pods_interface() -> None:
    for fabric in ("efa", "ib"):
        out = render(
            parse_job(dict(JOB)),
            RenderOptions(fabric=fabric, socket_ifname="net1", **FABRIC_OPTIONS[fabric]),  # type: ignore[arg-type]
        )
        assert env_of(out.objects[0])["NCCL_SOCKET_IFNAME"] == "net1"


def test_tcpxo_without_placement_warns_that_the_runtime_inherits_nothing() -> None:
    options = RenderOptions(fabric="tcpxo", gpu_nic_networks=NETWORKS)
    out = render(parse_job(dict(JOB)), options)
    assert any("inherits no placement" in w for w in out.warnings), out.warnings
    _, placed = rendered("tcpxo", "2.3")
    assert not any("inherits no placement" in w for w in placed)
