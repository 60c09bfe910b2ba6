"""The cluster commands at the client seam: muster.k8s.cluster against an in-memory API."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest

from muster.errors import UserError
from muster.k8s.cluster import Cluster
from muster.k8s.render import RenderOptions, render
from muster.k8s.rules import TORCH_DISTRIBUTED
from muster.k8s.verify import analyse
from muster.spec import parse_job
from tests.k8s.fake import FakeApps, FakeCore, FakeCustom, daemon_set, node, pod

GPU_POOL = {"pool": "gpu"}
MEGA = {"cloud.google.com/gke-accelerator": "nvidia-h100-mega-80gb"}
A3_MEGA = [
    node(f"a3-{i}", MEGA, ("nvidia.com/gpu=present:NoSchedule",), **{"nvidia.com/gpu": "8"})
    for i in range(2)
]
MEGA_PLACEMENT: dict[str, Any] = {
    "node_selector": MEGA,
    "tolerations": ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},),
}
JOB: dict[str, Any] = {
    "name": "llama-ft",
    "image": "ghcr.io/example/llama-ft:1.0",
    "entrypoint": "train.py",
    "resources": {"gpus": 8},
    "distributed": {"num_workers": 2, "procs_per_worker": 8, "backend": "nccl"},
}


@pytest.fixture
def api() -> tuple[FakeCore, FakeCustom]:
    core, custom = FakeCore(), FakeCustom()
    custom.objects[("clustertrainingruntimes", None, "torch-distributed")] = copy.deepcopy(
        TORCH_DISTRIBUTED
    )
    return core, custom


def cluster(api: tuple[FakeCore, FakeCustom]) -> Cluster:
    return Cluster(api[0], api[1], namespace="ml")


def test_efa_count_is_read_from_every_eligible_node(api: tuple[FakeCore, FakeCustom]) -> None:
    core, _ = api
    core.node_list = [
        node(f"p5-{i}", GPU_POOL, **{"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"})
        for i in range(3)
    ] + [node("cpu-0", {"pool": "cpu"}, cpu="16")]
    report = cluster(api).preflight(RenderOptions(fabric="efa", node_selector=GPU_POOL))
    assert report.ok, report.checks
    assert report.efa_count == 32
    assert any(c.name == "runtime" and c.ok for c in report.checks)


def test_nodes_that_disagree_on_efa_fail_by_name(api: tuple[FakeCore, FakeCustom]) -> None:
    core, _ = api
    core.node_list = [
        node("p5-0", GPU_POOL, **{"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}),
        node("p4d-0", GPU_POOL, **{"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "4"}),
    ]
    report = cluster(api).preflight(RenderOptions(fabric="efa", node_selector=GPU_POOL))
    assert not report.ok
    (efa,) = [c for c in report.checks if c.name == "efa"]
    assert "p4d-0=4" in efa.detail
    assert "p5-0=32" in efa.detail
    assert "--node-selector" in efa.detail
    assert report.efa_count is None


def test_gpu_nic_networks_are_read_and_checked(api: tuple[FakeCore, FakeCustom]) -> None:
    _, custom = api
    names = [f"aicr-demo-gpu-nic-{i}" for i in range(8)]
    custom.cluster_lists[("networking.gke.io", "networks")] = [
        {"metadata": {"name": n}} for n in ["default", *reversed(names)]
    ]
    api[0].node_list = A3_MEGA
    report = cluster(api).preflight(RenderOptions(fabric="tcpxo", **MEGA_PLACEMENT))
    assert report.ok, report.checks
    assert report.networks == names  # gpu-nic only, in NIC order
    # Names given: used as they are, and the cluster-scoped list is not asked for.
    custom.listed.clear()
    given = RenderOptions(fabric="tcpxo", gpu_nic_networks=tuple(names), **MEGA_PLACEMENT)
    report = cluster(api).preflight(given)
    assert report.ok, report.checks
    assert custom.listed == []
    assert report.networks == names


def test_a_namespace_only_role_gets_the_advice_and_the_other_checks(
    api: tuple[FakeCore, FakeCustom],
) -> None:
    core, custom = api
    custom.forbidden = core.nodes_forbidden = True
    apps = FakeApps()
    apps.forbidden = True
    report = Cluster(core, custom, "ml", apps).preflight(RenderOptions(fabric="tcpxo"))
    checks = {c.name: c for c in report.checks}
    assert not checks["gpu-nic networks"].ok
    assert "ask whoever provisions the cluster for the eight gpu-nic network names" in (
        checks["gpu-nic networks"].detail
    )
    assert "--gpu-nic-networks" in checks["gpu-nic networks"].detail
    assert not checks["nodes"].ok
    assert "may not list nodes" in checks["nodes"].detail
    assert not checks["plugin pair"].ok
    assert "--tcpxo-daemon-image" in checks["plugin pair"].detail


def test_a_refused_recreate_writes_nothing_not_even_the_runtime(
    api: tuple[FakeCore, FakeCustom],
) -> None:
    _, custom = api
    nets = tuple(f"gpu-nic-{i}" for i in range(8))
    opts = RenderOptions(fabric="tcpxo", namespace="ml", gpu_nic_networks=nets)
    c = cluster(api)
    c.apply(render(parse_job(JOB), opts).objects, "2.3")
    before = copy.deepcopy(custom.objects)
    changed = render(parse_job({**JOB, "args": ["--x"]}), replace(opts, nccl_debug="INFO"))
    with pytest.raises(UserError, match="nothing was changed"):
        c.apply(changed.objects, "2.3", confirm=lambda why: False)
    assert custom.objects == before  # the runtime too


def test_the_selector_must_reach_eight_gpu_nodes_whose_taints_are_tolerated(
    api: tuple[FakeCore, FakeCustom],
) -> None:
    core, _ = api
    cordoned = node(
        "a3-9",
        MEGA,
        ("nvidia.com/gpu=present:NoSchedule", "node.kubernetes.io/unschedulable:NoSchedule"),
        **{"nvidia.com/gpu": "8"},
    )
    core.node_list = [
        *A3_MEGA,
        cordoned,
        node("l4-0", {"pool": "small"}, **{"nvidia.com/gpu": "1"}),
    ]
    networks = {"gpu_nic_networks": tuple(f"n-gpu-nic-{i}" for i in range(8))}
    small = RenderOptions(fabric="tcpxo", node_selector={"pool": "small"}, **networks)
    (nodes,) = [c for c in cluster(api).preflight(small).checks if c.name == "nodes"]
    assert not nodes.ok
    assert "no node with 8 GPUs matches pool=small" in nodes.detail
    bare = RenderOptions(fabric="tcpxo", node_selector=MEGA, **networks)
    (nodes,) = [c for c in cluster(api).preflight(bare).checks if c.name == "nodes"]
    assert not nodes.ok
    assert "taints: nvidia.com/gpu=present:NoSchedule" in nodes.detail
    assert "not tolerated" in nodes.detail
    assert "--toleration" in nodes.detail
    placed = RenderOptions(fabric="tcpxo", **MEGA_PLACEMENT, **networks)
    (nodes,) = [c for c in cluster(api).preflight(placed).checks if c.name == "nodes"]
    assert nodes.ok, nodes.detail
    # (a cordoned node's condition taint is not one to tolerate)
    assert "3 node(s) with 8 GPUs; taints: nvidia.com/gpu=present:NoSchedule" in nodes.detail


def test_the_daemon_must_be_the_one_paired_with_the_clusters_plugin(
    api: tuple[FakeCore, FakeCustom],
) -> None:
    core, custom = api
    core.node_list = A3_MEGA
    apps = FakeApps()
    plugin = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/nccl-plugin-gpudirecttcpx-dev:{}"
    apps.daemon_sets["kube-system"] = [daemon_set("nccl-tcpxo-installer", plugin.format("v1.0.15"))]
    networks = tuple(f"n-gpu-nic-{i}" for i in range(8))
    opts = RenderOptions(fabric="tcpxo", gpu_nic_networks=networks, **MEGA_PLACEMENT)

    def pair(options: RenderOptions) -> Any:
        (found,) = [
            c
            for c in Cluster(core, custom, "ml", apps).preflight(options).checks
            if c.name == "plugin pair"
        ]
        return found

    assert pair(opts).ok, pair(opts).detail
    assert "plugin v1.0.15" in pair(opts).detail
    assert "v1.0.21" in pair(opts).detail
    old_daemon = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.18"
    mismatch = pair(replace(opts, tcpxo_daemon_image=old_daemon))
    assert not mismatch.ok
    assert "v1.0.15" in mismatch.detail
    assert "v1.0.18" in mismatch.detail
    assert "use the daemon v1.0.21" in mismatch.detail
    apps.daemon_sets["kube-system"] = [daemon_set("nccl-tcpxo-installer", plugin.format("v1.0.19"))]
    unknown = pair(opts)
    assert not unknown.ok
    assert "plugin v1.0.19" in unknown.detail
    assert "--tcpxo-daemon-image" in unknown.detail
    newer = pair(replace(opts, tcpxo_daemon_image=old_daemon.replace("v1.0.18", "v1.0.25")))
    assert newer.ok, newer.detail  # the user's pairing for a plugin muster does not know
    apps.daemon_sets["kube-system"] = []
    assert "install GPUDirect-TCPXO's NCCL plugin" in pair(opts).detail


def test_a_cluster_without_gke_networks_fails_tcpxo(api: tuple[FakeCore, FakeCustom]) -> None:
    report = cluster(api).preflight(RenderOptions(fabric="tcpxo"))
    assert not report.ok
    assert "found 0 gpu-nic networks" in report.checks[0].detail


def test_a_missing_runtime_fails_preflight(api: tuple[FakeCore, FakeCustom]) -> None:
    report = cluster(api).preflight(RenderOptions(runtime="torch-custom"))
    assert not report.ok
    assert "ClusterTrainingRuntime torch-custom not found" in report.checks[-1].detail


def test_apply_is_server_side_and_recreates_on_a_changed_trainer(
    api: tuple[FakeCore, FakeCustom],
) -> None:
    _, custom = api
    custom.delete_polls = 3  # the old TrainJob lingers for three reads, as a foreground delete does
    c = cluster(api)
    naps: list[float] = []
    c.sleep = naps.append
    objects = render(parse_job(JOB), RenderOptions(namespace="ml")).objects
    assert c.apply(objects, "2.3") == [
        "TrainJob llama-ft applied (server-side, field manager muster)"
    ]
    assert custom.managers == ["muster"]
    assert c.get("TrainJob", "llama-ft") == objects[0]
    # Same trainer: a plain re-apply.
    assert "applied" in c.apply(objects, "2.3")[0]
    assert custom.deleted == []
    # A new argument changes the immutable trainer block: delete, then create. A dry run
    # says so and changes nothing; without a yes nothing is deleted either.
    changed = render(parse_job({**JOB, "args": ["--lr", "3e-4"]}), RenderOptions(namespace="ml"))
    (line,) = c.apply(changed.objects, "2.3", dry_run=True)
    assert "must be deleted and created anew (dry run: nothing deleted)" in line
    with pytest.raises(UserError, match="pass --yes"):
        c.apply(changed.objects, "2.3", confirm=lambda why: False)
    assert custom.deleted == []
    assert c.get("TrainJob", "llama-ft") == objects[0]
    asked: list[str] = []
    (line,) = c.apply(changed.objects, "2.3", confirm=lambda why: asked.append(why) or True)
    assert "trainer cannot change in place" in asked[0]
    assert "recreated: trainer cannot change in place" in line
    assert custom.deleted == ["trainjobs/llama-ft"]
    assert naps  # it waited for the old one to go before creating the new one
    assert c.get("TrainJob", "llama-ft")["spec"]["trainer"]["args"] == ["--lr", "3e-4"]


def test_a_delete_that_never_finishes_is_reported(api: tuple[FakeCore, FakeCustom]) -> None:
    from muster.errors import InfrastructureError

    _, custom = api
    c = cluster(api)
    c.apply(render(parse_job(JOB), RenderOptions(namespace="ml")).objects, "2.3")
    custom.delete_polls = 10**6
    c.delete_timeout = 0.0
    c.sleep = lambda _: None
    changed = render(parse_job({**JOB, "args": ["--x"]}), RenderOptions(namespace="ml"))
    with pytest.raises(InfrastructureError, match="still being deleted after 0s"):
        c.apply(changed.objects, "2.3", confirm=lambda why: True)


def test_a_dry_run_sends_every_object_for_validation_and_stores_none(
    api: tuple[FakeCore, FakeCustom],
) -> None:
    _, custom = api
    nets = tuple(f"gpu-nic-{i}" for i in range(8))
    objects = render(
        parse_job(JOB), RenderOptions(fabric="tcpxo", namespace="ml", gpu_nic_networks=nets)
    ).objects
    lines = cluster(api).apply(objects, "2.3", dry_run=True)
    assert all("would be created (server-side dry run" in line for line in lines), lines
    assert custom.dry_runs == ["llama-ft-tcpxo", "llama-ft"]
    assert ("trainjobs", "ml", "llama-ft") not in custom.objects


def test_apply_writes_the_tcpxo_runtime_first(api: tuple[FakeCore, FakeCustom]) -> None:
    _, custom = api
    nets = tuple(f"gpu-nic-{i}" for i in range(8))
    objects = render(
        parse_job(JOB), RenderOptions(fabric="tcpxo", namespace="ml", gpu_nic_networks=nets)
    ).objects
    lines = cluster(api).apply(objects, "2.2")
    assert [line.split()[0] for line in lines] == ["TrainingRuntime", "TrainJob"]
    assert ("trainingruntimes", "ml", "llama-ft-tcpxo") in custom.objects


def test_apply_refuses_a_runtime_the_cluster_lacks(api: tuple[FakeCore, FakeCustom]) -> None:
    objects = render(parse_job(JOB), RenderOptions(runtime="torch-custom")).objects
    with pytest.raises(UserError, match="references ClusterTrainingRuntime torch-custom"):
        cluster(api).apply(objects, "2.3")


def test_logs_are_whole_and_tagged_by_pod_and_feed_verify_fabric(
    api: tuple[FakeCore, FakeCustom],
) -> None:
    core, _ = api
    banner = "{host}:{pid}:{pid} [0] NCCL INFO Using network {net}\nstep 0 loss 2.3\n"
    core.pod_list = [
        pod("llama-ft-node-0-1-bbb", "llama-ft", banner.format(host="b", pid=7, net="Socket")),
        pod("llama-ft-node-0-0-aaa", "llama-ft", banner.format(host="a", pid=5, net="IB")),
        pod("other-node-0-0-ccc", "other", "unrelated\n"),
    ]
    lines = cluster(api).logs("llama-ft")
    assert lines[0] == "[pod/llama-ft-node-0-0-aaa/node] a:5:5 [0] NCCL INFO Using network IB"
    assert len(lines) == 4
    assert all("tail_lines" not in call for call in core.log_calls)  # the whole log
    assert all(call["container"] == "node" for call in core.log_calls)
    report = analyse(lines, "ib")
    assert report.verdict == "fallback"
    assert "llama-ft-node-0-1-bbb pid 7" in report.summary


def test_status_lists_conditions_and_pods(api: tuple[FakeCore, FakeCustom]) -> None:
    core, custom = api
    job = render(parse_job(JOB), RenderOptions(namespace="ml")).objects[0]
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    custom.objects[("trainjobs", "ml", "llama-ft")] = job
    core.pod_list = [pod("llama-ft-node-0-0-aaa", "llama-ft", "", phase="Succeeded")]
    status = cluster(api).status("llama-ft")
    assert status["conditions"] == [{"type": "Complete", "status": "True"}]
    assert status["pods"] == [
        {
            "pod": "llama-ft-node-0-0-aaa",
            "phase": "Succeeded",
            "node": "host-of-llama-ft-node-0-0-aaa",
        }
    ]
    with pytest.raises(UserError, match="TrainJob nope not found in namespace ml"):
        cluster(api).status("nope")


def test_without_a_kubeconfig_the_cli_says_so(tmp_path: Any) -> None:
    env = dict(os.environ, KUBECONFIG=str(tmp_path / "missing"), HOME=str(tmp_path))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    done = subprocess.run(
        [sys.executable, "-m", "muster", "k8s", "status", "llama-ft"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode != 0
    assert "no kubeconfig" in done.stderr


def test_preflight_and_apply_commands_fill_in_what_the_cluster_tells(
    api: tuple[FakeCore, FakeCustom], monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from muster.cli import k8s as k8s_cli
    from muster.cli.main import app
    from tests.cli.test_validate_plan import ROOT

    core, custom = api
    core.node_list = [
        node(f"p5-{i}", GPU_POOL, **{"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"})
        for i in range(2)
    ]
    monkeypatch.setattr(
        k8s_cli.Cluster, "connect", classmethod(lambda cls, ns, ctx: Cluster(core, custom, ns))
    )
    job = str(ROOT / "examples/k8s/job.yaml")
    runner = CliRunner()
    done = runner.invoke(
        app, ["k8s", "preflight", job, "--fabric", "efa", "--node-selector", "pool=gpu"]
    )
    assert done.exit_code == 0, done.output
    assert "2 node(s), 32 EFA devices each" in done.output
    assert "every patch target is in the runtime" in done.output
    suggested = next(line for line in done.output.splitlines() if line.startswith("render with"))
    assert suggested.endswith("--efa-count 32 --node-selector pool=gpu")
    done = runner.invoke(app, ["k8s", "apply", job, "--fabric", "efa", "-n", "ml"])
    assert done.exit_code == 0, done.output
    stored = custom.objects[("trainjobs", "ml", "llama-ft")]
    assert stored["spec"]["trainer"]["resourcesPerNode"]["limits"]["vpc.amazonaws.com/efa"] == 32
    # Another trainer (--efa-count 4): not recreated without --yes (no terminal to ask on).
    again = ["k8s", "apply", job, "--fabric", "efa", "--efa-count", "4", "-n", "ml"]
    done = runner.invoke(app, [*again, "--dry-run"])
    assert done.exit_code == 0, done.output
    assert "dry run: nothing deleted" in done.output
    done = runner.invoke(app, ["k8s", "apply", job, "--fabric", "efa", "-n", "ml", "--dry-run"])
    assert "TrainJob llama-ft unchanged (server-side dry run" in done.output, done.output
    done = runner.invoke(app, again)
    assert done.exit_code == 2, done.output
    assert "pass --yes" in done.output
    assert custom.deleted == []
    done = runner.invoke(app, [*again, "--yes"])
    assert done.exit_code == 0, done.output
    assert custom.deleted == ["trainjobs/llama-ft"]
    # TCPXO: the tolerations and the daemon image given to preflight are the ones it checks.
    nets = ",".join(f"n-gpu-nic-{i}" for i in range(8))
    core.node_list = A3_MEGA
    tcpxo = ["k8s", "preflight", job, "--fabric", "tcpxo", "--gpu-nic-networks", nets]
    tcpxo += ["--node-selector", "cloud.google.com/gke-accelerator=nvidia-h100-mega-80gb"]
    done = runner.invoke(app, tcpxo)
    assert done.exit_code == 1, done.output
    assert "not tolerated: nvidia.com/gpu=present:NoSchedule" in done.output
    done = runner.invoke(app, [*tcpxo, "--toleration", "nvidia.com/gpu:NoSchedule"])
    assert "ok   nodes: 2 node(s) with 8 GPUs" in done.output, done.output
    assert "--toleration nvidia.com/gpu:NoSchedule" in done.output  # in the render line
    core.node_list = [
        node(f"p5-{i}", GPU_POOL, **{"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"})
        for i in range(2)
    ]
    core.node_list.append(
        node("p4d-0", GPU_POOL, **{"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "4"})
    )
    done = runner.invoke(app, ["k8s", "preflight", job, "--fabric", "efa"])
    assert done.exit_code == 1
    assert "FAIL efa" in done.output


def test_an_mpi_launchers_pod_is_read_with_replicated_job_launcher(
    api: tuple[FakeCore, FakeCustom],
) -> None:
    core, _ = api
    banner = "host-a:7:7 [0] NCCL INFO Using network IB"
    core.pod_list = [
        pod("mpi-job-node-0-0-x", "mpi-job", "worker says nothing\n"),
        pod("mpi-job-launcher-0-0-y", "mpi-job", banner + "\n", replicated_job="launcher"),
    ]
    c = cluster(api)
    assert analyse(c.logs("mpi-job"), "ib").verdict == "inconclusive"
    lines = c.logs("mpi-job", "launcher")
    # Trainer names the trainer container node in the launcher's pod too.
    assert lines == [f"[pod/mpi-job-launcher-0-0-y/node] {banner}"]
    assert core.log_calls[-1]["container"] == "node"
    assert analyse(lines, "ib").verdict == "attached"
    with pytest.raises(UserError, match="no launcher pods"):
        c.logs("other-job", "launcher")
