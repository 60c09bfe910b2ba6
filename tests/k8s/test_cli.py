"""`muster k8s render` as a user runs it: a real process, YAML on stdout, warnings on stderr."""

from __future__ import annotations

import yaml

from tests.cli.test_validate_plan import ROOT, muster

JOB = ROOT / "examples/k8s/job.yaml"


def test_render_prints_a_stream_kubectl_can_apply() -> None:
    nets = ",".join(f"gpu-nic-{i}" for i in range(8))
    done = muster("k8s", "render", JOB, "--fabric", "tcpxo", "--gpu-nic-networks", nets)
    assert done.returncode == 0, done.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(done.stdout)]
    assert kinds == ["TrainingRuntime", "TrainJob"]


def test_render_warns_on_stderr_only() -> None:
    done = muster("k8s", "render", JOB, "--fabric", "efa", "--efa-count", "32", "-n", "ml")
    assert done.returncode == 0, done.stderr
    (job,) = yaml.safe_load_all(done.stdout)
    assert job["metadata"]["namespace"] == "ml"
    assert "EFA stack" in done.stderr


def test_bad_flags_are_named_with_the_fix() -> None:
    done = muster("k8s", "render", JOB, "--fabric", "roce")
    assert done.returncode == 2
    assert "--fabric: 'roce': choose one of none, tcpxo, efa, ib" in done.stderr
    done = muster("k8s", "render", JOB, "--fabric", "tcpxo", "--toleration", "=x")
    assert done.returncode == 2
    assert "--toleration" in done.stderr
    done = muster("k8s", "render", JOB, "--fabric", "efa")
    assert done.returncode == 2
    assert "--efa-count" in done.stderr
    assert done.stdout == ""


def test_the_kubernetes_client_is_imported_only_to_reach_a_cluster() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from muster.cli import k8s, verify\n"
        "from muster.k8s import cluster, render\n"
        "assert 'kubernetes' not in sys.modules, 'imported eagerly'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
