"""The Python SDK end to end: ``from muster import launch, Client, AsyncClient`` against a real
controller and two local agents running real torchrun jobs."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from muster.cli.local import LocalCluster
from muster.errors import InfrastructureError, JobFailed, SpecError, UserError
from tests.e2e.helpers import wait_state, write_job

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)

FAILING = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} starts", flush=True)
if rank == 3:
    sys.exit(7)
time.sleep(60)
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(agents=2) as c:
        yield c


def test_launch_streams_rank_lines_and_returns_the_result(cluster: LocalCluster) -> None:
    from muster import Client, launch

    printed: list[str] = []
    result = launch(
        ROOT / "examples/ddp/job.yaml",
        controller=cluster.url,
        token=cluster.token(),
        output=printed.append,
        timeout=300,
    )
    assert result.ok
    assert result.state == "succeeded"
    assert result.exit_codes == {0: 0, 1: 0, 2: 0, 3: 0}
    for rank in range(4):
        assert f"[rank{rank}] all_reduce sum=10 expected=10 ok" in printed, printed[:20]
    assert {"node0/checkpoint.pt", "node1/checkpoint.pt"} <= {a["path"] for a in result.artifacts}
    # The Client sees the same job, and a dict spec launches without a file (workdir: cwd).
    client = Client(cluster.url, cluster.token())
    assert client.job(result.id)["state"] == "succeeded"
    assert result.id in {j["id"] for j in client.jobs()}
    assert {w["id"] for w in client.workers()} == {w["id"] for w in cluster.client().workers()}
    client.close()


def test_the_star_backend_trains_under_muster(cluster: LocalCluster) -> None:
    """muster.train's CPU star in async mode on a 2-node gang: the root on node 0's
    MASTER_ADDR, one fold per node (torchrun's GROUP_RANK), the job's outputs collected."""
    from muster import launch

    printed: list[str] = []
    result = launch(
        ROOT / "examples/hetero/job-star.yaml",
        controller=cluster.url,
        token=cluster.token(),
        output=printed.append,
        timeout=300,
    )
    assert result.ok, printed[-20:]
    assert any("[rank0] epoch 1 held-out loss" in line for line in printed), printed[-20:]
    assert "node0/result.json" in {a["path"] for a in result.artifacts}


def test_a_failed_job_raises_job_failed_with_the_blamed_ranks_code(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    from muster import launch

    job = write_job(tmp_path / "fails", "fails", FAILING, timeout="5m")
    printed: list[str] = []
    with pytest.raises(JobFailed) as caught:
        launch(job, controller=cluster.url, token=cluster.token(), output=printed.append)
    result = caught.value.result
    assert result.state == "failed"
    assert result.exit_codes[3] == 7
    assert "global rank 3 exited with code 7" in (result.root_cause or "")
    assert "[rank3] rank 3 starts" in printed
    assert f"job {result.id} failed" in str(caught.value)


def test_bad_input_raises_muster_errors_before_anything_runs(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    from muster import launch

    with pytest.raises(SpecError) as caught:
        launch({"name": "Bad Name", "entrypoint": "train.py"}, controller=cluster.url,
               token=cluster.token())  # fmt: skip
    assert "name" in caught.value.fields
    with pytest.raises(InfrastructureError, match="cannot reach the controller"):
        launch(ROOT / "examples/ddp/job.yaml", controller="http://127.0.0.1:9", token="x")
    with pytest.raises(UserError, match="workdir"):
        launch({"name": "nowhere", "entrypoint": "train.py"}, workdir=tmp_path / "absent",
               controller=cluster.url, token=cluster.token())  # fmt: skip


def test_launch_times_out_on_a_silent_job_and_leaves_it_running(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    from muster import launch

    job = write_job(tmp_path / "silent", "silent", "import time\ntime.sleep(120)\n")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not end within 3s; it goes on"):
        launch(job, controller=cluster.url, token=cluster.token(), output=print, timeout=3)
    assert time.monotonic() - started < 15  # the bound holds though nothing is printed
    api = cluster.client()
    (silent,) = [j for j in api.jobs() if j["name"] == "silent"]
    assert silent["state"] not in ("succeeded", "failed", "cancelled")
    api.cancel(silent["id"])
    wait_state(api, silent["id"])


def test_the_async_client_follows_and_waits(cluster: LocalCluster, tmp_path: Path) -> None:
    from muster import AsyncClient, JobResult
    from muster.spec import load_job_file

    async def scenario() -> tuple[list[dict[str, object]], JobResult]:
        async with AsyncClient(cluster.url, cluster.token()) as api:
            spec = load_job_file(ROOT / "examples/ddp/job.yaml")
            job = await api.submit_with_bundle(spec, ROOT / "examples/ddp")
            lines = [line async for line in api.follow(job["id"], rank=1)]
            return lines, await api.wait(job["id"], timeout=60)

    lines, result = asyncio.run(scenario())
    assert result.ok
    assert {line["rank"] for line in lines if line["origin"] == "rank"} == {1}
    assert any(line["text"] == "all_reduce sum=10 expected=10 ok" for line in lines)


def test_import_muster_stays_light() -> None:
    """The SDK loads on first use: the agents' and ranks' `import muster` pulls no httpx."""
    code = (
        "import sys, muster; print('httpx' in sys.modules); "
        "muster.launch; print('httpx' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["False", "True"]
