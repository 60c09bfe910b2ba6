"""A real 2-node x 2-proc job end to end on loopback (seed 001's whole flow)."""

from __future__ import annotations

import hashlib
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from muster.cli.local import LocalCluster
from tests.e2e.helpers import all_lines, submit, wait_no_processes, wait_state, write_job

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(agents=2) as c:
        yield c


def test_ddp_example_succeeds_with_artifacts_and_gating(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    job_id = submit(api, ROOT / "examples/ddp/job.yaml")
    job = wait_state(api, job_id)
    assert job["state"] == "succeeded", job["root_cause"]

    lines = all_lines(api, job_id)
    for rank in range(4):
        mine = [ln["text"] for ln in lines if ln["origin"] == "rank" and ln["rank"] == rank]
        assert "all_reduce sum=10 expected=10 ok" in mine, f"rank {rank}: {mine[:5]}"

    arts = {a["path"]: a for a in api.artifacts(job_id)}
    assert {"node0/checkpoint.pt", "node1/checkpoint.pt"} <= set(arts)
    for path, item in arts.items():
        dest = tmp_path / path
        api.download_artifact(job_id, path, dest)
        assert hashlib.sha256(dest.read_bytes()).hexdigest() == item["sha256"]
    # DDP keeps the replicas identical: both nodes' checkpoints are the same bytes.
    assert arts["node0/checkpoint.pt"]["sha256"] == arts["node1/checkpoint.pt"]["sha256"]

    # Gating: node 0 published its address before any member got its assignment.
    kinds = [(e["kind"], e["data"].get("node")) for e in job["events"]]
    published = kinds.index(("RendezvousPublished", None))
    assigned = [i for i, (k, _n) in enumerate(kinds) if k == "Assigned"]
    assert len(assigned) == 2
    assert published < min(assigned)
    assert [kinds[i][1] for i in assigned] == [0, 1]
    members = {m["node_rank"]: m for m in job["members"]}
    assert (members[0]["ranks"], members[1]["ranks"]) == ([0, 1], [2, 3])
    wait_no_processes(cluster, job_id)

    deadline = time.monotonic() + 15  # gauges refresh on the supervision tick and passes
    while True:
        metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
        if 'muster_jobs{state="succeeded"} 1.0' in metrics or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert "muster_agents_connected 2.0" in metrics
    assert 'muster_jobs{state="succeeded"} 1.0' in metrics
    ingested = re.search(r"^muster_log_lines_ingested_total (\S+)$", metrics, re.M)
    assert ingested is not None
    assert float(ingested.group(1)) >= len(lines)
    assert "muster_placement_seconds_count 1.0" in metrics


LOUD = """
import os
rank = int(os.environ["RANK"])
for i in range(50_000):
    print(f"rank={rank} line={i}")
"""


def test_every_line_of_every_rank_stored_once_in_order(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    job_id = submit(api, write_job(tmp_path / "loud", "loud", LOUD))
    job = wait_state(api, job_id, timeout=180)
    assert job["state"] == "succeeded", job["root_cause"]
    lines = [ln for ln in all_lines(api, job_id) if ln["origin"] == "rank"]
    assert len(lines) == 4 * 50_000
    for rank in range(4):
        mine = [ln for ln in lines if ln["rank"] == rank]
        assert [ln["text"] for ln in mine] == [f"rank={rank} line={i}" for i in range(50_000)]
        assert [ln["seq"] for ln in mine] == list(range(1, 50_001))
        assert {ln["stream"] for ln in mine} == {"stdout"}


FAIL_RANK_3 = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} up", flush=True)
if rank == 3:
    print("rank 3 is about to fail", file=sys.stderr, flush=True)
    import a_module_nobody_installed  # a failure the catalogue names (exit code 1)
time.sleep(600)
"""


def test_fail_fast_names_rank_3_and_leaves_no_process(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    job_id = submit(api, write_job(tmp_path / "fail", "fail", FAIL_RANK_3))
    job = wait_state(api, job_id, timeout=90)
    assert job["state"] == "failed"
    cause = job["root_cause"]
    assert "node1 (worker agent-1): global rank 3 exited with code 1" in cause, cause
    assert "rank 3 is about to fail" in cause
    # Named from its last lines, with the fix (muster.gang.catalogue).
    assert "a module is missing: this rank's Python has no module a_module_nobody_installed" in (
        cause
    )
    assert "\nfix: install it in the Python the agent runs ranks with" in cause
    wait_no_processes(cluster, job_id, timeout=30)
    final = wait_state(api, job_id)
    states = {m["node_rank"]: m["state"] for m in final["members"]}
    assert states[1] == "failed"
    # Workers come back for the next job.
    cluster.wait_for_workers(2, timeout=30)


# Real failures, each as torch or Python words it (gloo CPU, 2 nodes x 1 rank), and the name
# and fix the catalogue gives them (muster.gang.catalogue; samples in tests/gang).
CATALOGUED = {
    "gloo collective timed out": (
        "import datetime, time, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=3))\n"
        "if dist.get_rank() == 1:\n"
        "    time.sleep(60)\n"
        "dist.all_reduce(torch.ones(1))\n",
        "a gloo recv waited 3000 ms",
        0,
    ),
    "world size or rank mismatch": (
        "import torch.distributed as dist\n"
        "from torch.utils.data import DistributedSampler\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n"
        "    DistributedSampler(list(range(8)), num_replicas=1, rank=1)\n"
        "import time; time.sleep(60)\n",
        "rank 1 was given a world of 0 + 1",
        1,
    ),
    "address already in use": (
        "import os, socket, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(1)  # rank 0 binds first\n"
        "s = socket.socket(); s.bind(('127.0.0.1', int(os.environ['FIXED_PORT']))); s.listen()\n"
        "time.sleep(60)\n",
        "a port this rank listens on was taken",
        1,
    ),
}


@pytest.mark.parametrize("name", sorted(CATALOGUED))
def test_each_catalogued_failure_is_named_with_its_fix_soon_after_the_rank_exits(
    cluster: LocalCluster, tmp_path: Path, name: str
) -> None:
    script, what, rank = CATALOGUED[name]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = cluster.client()
    job_file = write_job(
        tmp_path / "c",
        "catalogued",
        script,
        env={"FIXED_PORT": str(port)},
        distributed={"num_workers": 2, "procs_per_worker": 1, "backend": "gloo"},
    )
    job_id = submit(api, job_file)
    job = wait_state(api, job_id, timeout=90)
    assert job["state"] == "failed", job
    cause = job["root_cause"]
    assert f"global rank {rank} exited with code 1" in cause, cause
    assert f"\n{name}: {what}" in cause, cause
    assert "\nfix: " in cause, cause
    last = max(ln["time"] for ln in all_lines(api, job_id) if ln["rank"] == rank)
    named = datetime.fromisoformat(job["finished_at"]).timestamp()
    assert named - last < 10, (last, job["finished_at"])
    cluster.wait_for_workers(2, timeout=30)


SLEEPER = """
import os, time
print(f"rank {os.environ['RANK']} sleeping", flush=True)
time.sleep(600)
"""


def test_timeout_fails_the_job_and_stops_every_rank(cluster: LocalCluster, tmp_path: Path) -> None:
    api = cluster.client()
    job_id = submit(api, write_job(tmp_path / "slow", "slow", SLEEPER, timeout=4))
    job = wait_state(api, job_id, timeout=60)
    assert job["state"] == "failed"
    assert "timed out after 4s" in job["root_cause"]
    wait_no_processes(cluster, job_id)


def test_cancel_stops_a_running_job(cluster: LocalCluster, tmp_path: Path) -> None:
    api = cluster.client()
    job_id = submit(api, write_job(tmp_path / "cancel", "cancel", SLEEPER))
    wait_state(api, job_id, {"running"}, timeout=60)
    assert api.cancel(job_id)["state"] == "cancelled"
    wait_no_processes(cluster, job_id)
    # A member's end is on record once its agent has reported the exit (tens of ms after
    # the processes are gone): wait for it, within a bound.
    deadline = time.monotonic() + 10
    while True:
        members = api.job(job_id)["members"]
        if all(m["state"] in ("cancelled", "failed") for m in members):
            break
        assert time.monotonic() < deadline, members
        time.sleep(0.1)
    cluster.wait_for_workers(2, timeout=30)


NCCL_BANNER = """
import os, socket
rank = int(os.environ["RANK"])
net = "Socket" if rank == 3 else "IB"
print(f"{socket.gethostname()}:{os.getpid()}:{os.getpid()} [{os.environ['LOCAL_RANK']}] "
      f"NCCL INFO Using network {net}", flush=True)
"""


def test_verify_fabric_reads_a_jobs_stored_logs(cluster: LocalCluster, tmp_path: Path) -> None:
    api = cluster.client()
    job_id = submit(api, write_job(tmp_path / "nccl", "nccl-banner", NCCL_BANNER))
    assert wait_state(api, job_id)["state"] == "succeeded"
    done = subprocess.run(
        [sys.executable, "-m", "muster", "verify-fabric", "--job", job_id, "--fabric", "ib"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"MUSTER_CONTROLLER": cluster.url, "PATH": "/usr/bin:/bin", "COLUMNS": "200"},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 of 4 rank(s) use network Socket" in done.stdout
    assert "rank3 pid" in done.stdout
