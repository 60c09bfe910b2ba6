"""Walk-ins end to end (seed 003): real controller, `muster join` processes, torchrun, gloo.

A window job waits in the queue while boxes walk in; the world that forms is exactly the
roster, node rank r being the r-th box admitted; the walk-ins leave when the job ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from muster.cli.local import LocalCluster
from muster.client import Client
from tests.agent.test_prepare import FAKE_SMI
from tests.e2e.helpers import all_lines, submit, wait_state, write_job

pytestmark = pytest.mark.timeout(600)

SCRIPT = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum={t.item():.0f}", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(agents=0, heartbeat_interval=1.0, heartbeat_timeout=5.0) as c:
        yield c


def window_job(tmp_path: Path, name: str, window: dict[str, Any], hosts: int = 2) -> Path:
    return write_job(
        tmp_path / name,
        name,
        SCRIPT,
        distributed={
            "num_workers": hosts,
            "procs_per_worker": 1,
            "backend": "gloo",
            "membership": "window",
            "window": window,
        },
    )


def walk_in(
    cluster: LocalCluster, job: str | None, host: str, *extra: str
) -> subprocess.Popen[bytes]:
    """``muster join`` on this machine as box ``host``; ``job`` None: any open window."""
    assert cluster.data_dir is not None
    return cluster._spawn(
        f"join-{host}",
        [
            "join",
            cluster.url,
            *(("--job", job) if job is not None else ()),
            "--host",
            host,
            "--work-dir",
            str(cluster.data_dir / f"join-{host}"),
            *extra,
        ],
        env={"MUSTER_TOKEN": cluster.join_token()},
    )


def wait_window(
    api: Client, job: str, phase: str, ranks: int | None = None, timeout: float = 60
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    view: dict[str, Any] = {}
    while time.monotonic() < deadline:
        view = api.window(job)
        if view["phase"] == phase and (ranks is None or view.get("ranks") == ranks):
            return view
        time.sleep(0.2)
    raise AssertionError(f"window of {job} not {phase} ({ranks} ranks) in {timeout}s: {view}")


def muster(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "muster", *args, "--controller", cluster.url],
        env={**cluster._env(), "MUSTER_API_TOKEN": cluster.token(), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_manual_window_holds_two_walk_ins_until_muster_start_then_trains(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    job = submit(api, window_job(tmp_path, "manual", {"start": "manual", "quorum": 2}))
    assert api.job(job)["state"] == "queued"
    first = walk_in(cluster, job, "box-a")
    wait_window(api, job, "waiting", ranks=1)
    refused = muster(cluster, "start", job)
    assert refused.returncode != 0
    assert "quorum not met: 1 of 2 ranks" in refused.stderr
    second = walk_in(cluster, job, "box-b")
    view = wait_window(api, job, "staging", ranks=2)
    assert [m["host"] for m in view["roster"]] == ["box-a", "box-b"]
    assert [m["first_rank"] for m in view["roster"]] == [0, 1]
    assert view["startable"]
    shown = muster(cluster, "status", job)
    assert "window staging" in shown.stdout
    every = muster(cluster, "status")  # no job: every open window
    assert f"{job}: window staging" in every.stdout
    assert f"startable: muster start {job}" in shown.stdout
    assert "join window staging" in (api.job(job)["why_pending"] or "")
    time.sleep(1.5)  # the clock does not form a manual window
    assert api.window(job)["phase"] == "staging"

    started = muster(cluster, "start", job)
    assert started.returncode == 0, started.stderr
    done = wait_state(api, job)
    assert done["state"] == "succeeded", done["root_cause"]
    detail = api.job(job)
    assert detail["world_size"] == 2
    assert [m["worker"] for m in sorted(detail["members"], key=lambda m: m["node_rank"])] == [
        "walkin-box-a",
        "walkin-box-b",
    ]
    texts = [ln["text"] for ln in all_lines(api, job) if ln["origin"] == "rank"]
    assert "rank 0 of 2 sum=3" in texts
    assert "rank 1 of 2 sum=3" in texts
    # The walk-ins leave once the job is over, with its verdict as their exit code.
    assert first.wait(60) == 0
    assert second.wait(60) == 0
    again = muster(cluster, "start", job)
    assert "no open join window (it is succeeded)" in again.stderr
    after = muster(cluster, "status", job)  # the roster that formed stays on show
    assert f"{job}: window done (job succeeded)" in after.stdout
    assert "box-b" in after.stdout


def test_a_window_outlives_a_controller_restart_with_its_clock(tmp_path: Path) -> None:
    with LocalCluster(agents=0, heartbeat_interval=1.0, heartbeat_timeout=5.0) as own:
        api = own.client()
        window = {"start": "manual", "quorum": 2, "max_join_timeout": "10m"}
        job = submit(api, window_job(tmp_path, "restart", window))
        first = walk_in(own, job, "box-a", "--persist")
        opened = wait_window(api, job, "waiting", ranks=1)["opened_at"]
        own.stop("server", signal.SIGKILL)
        own.start_server()
        # box-a dials again (5 s back-off) and is on the roster again; the clock did not
        # start over (nor did the hard cap).
        view = wait_window(api, job, "waiting", ranks=1, timeout=60)
        assert view["opened_at"] == opened
        assert [m["host"] for m in view["roster"]] == ["box-a"]
        second = walk_in(own, job, "box-b")
        wait_window(api, job, "staging", ranks=2)
        started = muster(own, "start", job)
        assert started.returncode == 0, started.stderr
        done = wait_state(api, job)
        assert done["state"] == "succeeded", done["root_cause"]
        assert first.wait(60) == 0
        assert second.wait(60) == 0


def test_an_auto_window_forms_the_moment_its_target_is_in(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    job = submit(api, window_job(tmp_path, "auto", {"join_timeout": "10m"}, hosts=3))
    boxes = [walk_in(cluster, job, f"auto-{i}") for i in range(3)]
    done = wait_state(api, job, timeout=180)
    assert done["state"] == "succeeded", done["root_cause"]
    texts = [ln["text"] for ln in all_lines(api, job) if ln["origin"] == "rank"]
    assert sorted(t for t in texts if t.startswith("rank")) == [
        f"rank {r} of 3 sum=6" for r in range(3)
    ]
    assert all(box.wait(60) == 0 for box in boxes)


def test_a_hybrid_window_forms_on_its_timeout_with_the_quorum_in(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    rules = {"start": "hybrid", "quorum": 2, "target_ranks": 3, "join_timeout": 15}
    job = submit(api, window_job(tmp_path, "expiry", rules, hosts=3))
    boxes = [walk_in(cluster, job, f"exp-{i}") for i in range(2)]
    # Two of a target of three: held (staging) until the clock forms it, with no start.
    done = wait_state(api, job, timeout=120)
    assert done["state"] == "succeeded", done["root_cause"]
    assert api.window(job)["reason"] == "formed on timeout"
    assert api.job(job)["world_size"] == 2
    assert all(box.wait(60) == 0 for box in boxes)


def test_a_quorum_never_met_fails_the_job_at_the_hard_cap_and_the_walk_in_leaves(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    # The cap leaves the walk-in time to start and join: its start-up (the CLI, then the job
    # Python's versions read in a subprocess) took over 4 s on a busy 2-core machine.
    rules = {"start": "hybrid", "quorum": 2, "join_timeout": 2, "max_join_timeout": 15}
    job = submit(api, window_job(tmp_path, "lonely", rules))
    lonely = walk_in(cluster, job, "lonely")
    done = wait_state(api, job, timeout=60)
    assert done["state"] == "failed"
    assert "quorum never met within max_join_timeout (15s): 1 of 2 ranks" in done["root_cause"]
    assert lonely.wait(30) == 2
    assert "quorum never met" in cluster.log("join-lonely").read_text()


def test_a_walk_in_that_does_not_fit_is_refused_at_the_door_by_name(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    path = window_job(tmp_path, "door", {"start": "manual"})
    data = yaml.safe_load(path.read_text())
    data["resources"] = {"gpus": 1, "device": "cuda"}  # gloo on GPUs: this box has none
    path.write_text(yaml.safe_dump(data))
    job = submit(api, path)
    cpu_box = walk_in(cluster, job, "cpu-box", "--procs", "2")
    assert cpu_box.wait(60) == 2
    log = cluster.log("join-cpu-box").read_text()
    assert "cpu-box offers 2 rank(s) but has 0 GPU(s)" in log
    assert "--devices" in log
    assert api.window(job)["ranks"] == 0
    stray = walk_in(cluster, "no-such-job", "stray")
    assert stray.wait(60) == 2
    assert "there is no job no-such-job" in cluster.log("join-stray").read_text()
    api.cancel(job)


def test_a_box_whose_gpus_or_stage_dir_fail_the_gate_never_walks_in(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    job = submit(api, window_job(tmp_path, "gate", {"start": "manual"}))
    smi = tmp_path / "bin" / "nvidia-smi"  # this box's GPUs, as nvidia-smi lists them: 0, 1
    smi.parent.mkdir()
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    path = f"{smi.parent}:{os.environ['PATH']}"
    assert cluster.data_dir is not None
    missing = cluster._spawn(
        "join-gpu-box",
        ["join", cluster.url, "--job", job, "--host", "gpu-box", "--devices", "0,3"],
        env={"MUSTER_TOKEN": cluster.join_token(), "PATH": path},
    )
    assert missing.wait(60) == 2
    log = cluster.log("join-gpu-box").read_text()
    assert "--devices 0,3: GPU 3 is not on this box (nvidia-smi lists 0,1)" in log
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    stuck = cluster._spawn(
        "join-stuck-box",
        ["join", cluster.url, "--job", job, "--host", "stuck", "--work-dir", str(blocker / "w")],
        env={"MUSTER_TOKEN": cluster.join_token()},
    )
    assert stuck.wait(60) == 2
    assert "takes no writes" in cluster.log("join-stuck-box").read_text()
    assert api.window(job)["ranks"] == 0  # neither dialled
    api.cancel(job)


def test_boxes_of_different_sizes_form_one_world_with_contiguous_ranks(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    job = submit(api, window_job(tmp_path, "mixed", {"quorum": 3, "target_ranks": 3}))
    big = walk_in(cluster, job, "big", "--procs", "2")
    wait_window(api, job, "waiting", ranks=2)
    small = walk_in(cluster, job, "small")
    done = wait_state(api, job, timeout=180)
    assert done["state"] == "succeeded", done["root_cause"]
    detail = api.job(job)
    assert detail["world_size"] == 3
    assert detail["spec"]["distributed"]["node_procs"] == [2, 1]
    nodes = sorted(detail["members"], key=lambda m: m["node_rank"])
    assert [(m["worker"], m["ranks"]) for m in nodes] == [
        ("walkin-big", [0, 1]),
        ("walkin-small", [2, 2]),
    ]
    texts = [ln["text"] for ln in all_lines(api, job) if ln["origin"] == "rank"]
    assert sorted(t for t in texts if t.startswith("rank")) == [
        f"rank {r} of 3 sum=6" for r in range(3)
    ]
    on_small = api.logs(job, node=1)["lines"]
    assert {ln["rank"] for ln in on_small if ln["origin"] == "rank"} == {2}
    assert big.wait(60) == 0
    assert small.wait(60) == 0


def test_pool_agents_never_take_a_window_job(cluster: LocalCluster, tmp_path: Path) -> None:
    """(Who may call start and window: tests/controller/test_auth.py walks every route.)"""
    api = cluster.client()
    cluster.start_agent("pool-agent")
    cluster.wait_for_workers(1)
    job = submit(api, window_job(tmp_path, "pooled", {"start": "manual", "quorum": 1}, hosts=1))
    deadline = time.monotonic() + 15  # (a pass writes the reason; an idle one runs every 5 s)
    while "join window waiting: 0 rank(s) in" not in (api.job(job)["why_pending"] or ""):
        assert time.monotonic() < deadline, api.job(job)
        time.sleep(0.2)
    time.sleep(1)
    assert api.job(job)["state"] == "queued"
    assert not any(w["state"] != "idle" for w in api.workers() if w["id"] == "pool-agent")
    api.cancel(job)
    cluster.stop("pool-agent")


DATA_SCRIPT = """\
import os
import torch.distributed as dist

dist.init_process_group("gloo")
data = os.environ.get("MUSTER_DATA_PATH")
files = sorted(os.listdir(data)) if data else []
share = os.environ.get("MUSTER_GPU_RAM_SHARE")
print(f"rank {dist.get_rank()} reads {data} {files} share {share}", flush=True)
dist.destroy_process_group()
"""


def test_boxes_must_hold_the_same_data_and_their_ranks_are_told_where_it_is(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    copies = {}
    for name, text in (("a", "same"), ("b", "same"), ("c", "other")):
        root = copies[name] = tmp_path / f"data-{name}"
        (root / "shard").mkdir(parents=True)
        (root / "shard" / "0.txt").write_text(text)
    path = write_job(
        tmp_path / "data",
        "data",
        DATA_SCRIPT,
        distributed={
            "num_workers": 2,
            "backend": "gloo",
            "membership": "window",
            "window": {"quorum": 2, "target_ranks": 2},
        },
    )
    api = cluster.client()
    job = submit(api, path)
    first = walk_in(
        cluster, job, "data-a", "--data-path", str(copies["a"]), "--gpu-ram-share", "0.5"
    )
    wait_window(api, job, "waiting", ranks=1)
    odd = walk_in(cluster, job, "data-c", "--data-path", str(copies["c"]))
    assert odd.wait(60) == 2
    log = cluster.log("join-data-c").read_text()
    assert "data-c's dataset signature" in log
    assert "data-a's" in log
    second = walk_in(cluster, job, "data-b", "--data-path", str(copies["b"]))
    done = wait_state(api, job, timeout=180)
    assert done["state"] == "succeeded", done["root_cause"]
    texts = sorted(ln["text"] for ln in all_lines(api, job) if ln["origin"] == "rank")
    assert texts == [
        f"rank 0 reads {copies['a']} ['shard'] share 0.5",
        f"rank 1 reads {copies['b']} ['shard'] share None",
    ]
    assert first.wait(60) == 0
    assert second.wait(60) == 0
