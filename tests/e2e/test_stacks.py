"""`muster stacks` on a job that hangs in a collective: real agents, torchrun, gloo, py-spy.

Ranks 0-2 wait in all_reduce for rank 3, which sleeps before it: the folded output names
rank 3 first, as the one that is not where the others are, and the job goes on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from muster.cli.local import LocalCluster
from muster.plan.stacks import folded, ranks_label
from tests.e2e.helpers import all_lines, submit, wait_state, write_job
from tests.e2e.test_window import muster

pytestmark = pytest.mark.timeout(300)

HANGS = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} ready", flush=True)
if rank == 3:
    time.sleep(600)  # never reaches the collective
t = torch.ones(1)
dist.all_reduce(t)
"""

# The same hang, with torch's flight recorder on and served (muster.train.flight): three
# all_reduces done together, then rank 3 sleeps while the others enter the fourth.
HANGS_RECORDED = """
import time, torch, torch.distributed as dist
from muster.train.flight import serve
dist.init_process_group("gloo")
assert serve(), "muster set MUSTER_DIAG_DIR"
rank = dist.get_rank()
t = torch.ones(1000)
for _ in range(3):
    dist.all_reduce(t)
print(f"rank {rank} ready", flush=True)
if rank == 3:
    time.sleep(600)
dist.all_reduce(t)
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(agents=2) as c:
        yield c


def test_stacks_name_the_rank_that_never_reached_the_collective(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    job = submit(api, write_job(tmp_path / "hang", "hang", HANGS, timeout="5m"))
    deadline = time.monotonic() + 120
    while sum(ln["text"].endswith("ready") for ln in all_lines(api, job)) < 4:
        assert time.monotonic() < deadline, all_lines(api, job)
        time.sleep(0.3)
    time.sleep(1)  # ranks 0-2 go on into all_reduce

    shown = muster(cluster, "stacks", job)
    assert shown.returncode == 0, shown.stderr
    blocks = shown.stdout.split("\n[")
    assert blocks[0].startswith("[rank3] differs from the others"), shown.stdout
    assert "<module> (train.py:7)" in blocks[0], "rank 3 is in its sleep"
    assert blocks[1].startswith("rank0-2]"), shown.stdout
    assert "all_reduce" in blocks[1], "the others wait in the collective"
    assert "Process " not in shown.stdout, "pids are folded away"

    one = api.stacks(job, rank=1)
    assert [s["rank"] for s in one["stacks"]] == [1]
    assert one["missing"] == []
    assert api.job(job)["state"] == "running", "looking does not stop the job"
    api.cancel(job)
    wait_state(api, job)
    gone = muster(cluster, "stacks", job)
    assert gone.returncode == 2
    assert f"job {job} has no running ranks (it is cancelled)" in gone.stderr


def test_stacks_name_the_collective_each_rank_is_parked_in(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """With TORCH_FR_BUFFER_SIZE set in the job, every rank's flight recorder says where it
    waits: ranks 0-2 in all_reduce number 4, rank 3 between collectives after number 3."""
    api = cluster.client()
    path = write_job(
        tmp_path / "fr", "fr", HANGS_RECORDED, timeout="5m", env={"TORCH_FR_BUFFER_SIZE": "64"}
    )
    job = submit(api, path)
    deadline = time.monotonic() + 120
    while sum(ln["text"].endswith("ready") for ln in all_lines(api, job)) < 4:
        assert time.monotonic() < deadline, all_lines(api, job)
        time.sleep(0.3)
    time.sleep(1)

    answer = api.stacks(job)
    where = {s["rank"]: s["collective"] for s in answer["stacks"]}
    assert sorted(where) == [0, 1, 2, 3], answer
    for rank in (0, 1, 2):
        seen = where[rank]
        assert (seen["seq"], seen["op"], seen["sizes"]) == (4, "all_reduce", [[1000]]), where
        assert seen["age_s"] >= 0.5, where
    assert (where[3]["seq"], where[3]["last_seq"]) == (None, 3), where

    shown = muster(cluster, "stacks", job)
    assert shown.returncode == 0, shown.stderr
    blocks = shown.stdout.split("\n[")
    assert blocks[0].startswith("[rank3] differs from the others"), shown.stdout
    assert "collective: none in flight; last all_reduce #3 on default_pg" in blocks[0]
    assert "collective: in all_reduce #4 on default_pg (Float[1000])" in blocks[1], blocks[1]
    api.cancel(job)
    wait_state(api, job)
    dirs = [line for line in all_lines(api, job) if "muster-fr-" in line["text"]]
    assert dirs, "torch names the socket it serves on"
    socket_dir = Path(dirs[0]["text"].split("UNIX ")[-1].strip()).parent
    deadline = time.monotonic() + 15  # cancelled is said at once; the member ends after
    while socket_dir.exists():
        assert time.monotonic() < deadline, "the member's diagnosis directory goes with it"
        time.sleep(0.2)


def test_folding_puts_the_odd_ranks_first() -> None:
    same = 'Thread 100 (idle): "MainThread"\n    wait (x.py:1)'
    other = 'Thread 7 (active): "MainThread"\n    sleep (x.py:2)'
    stacks = [
        {"rank": r, "text": f"Process {r}: python\nPython v3.11\n\n" + same.replace("100", str(r))}
        for r in (0, 1, 2, 5)
    ] + [{"rank": 3, "text": other}]
    groups = folded(stacks)
    assert [ranks for ranks, _ in groups] == [[3], [0, 1, 2, 5]]
    assert groups[1][1] == 'Thread (idle): "MainThread"\n    wait (x.py:1)'
    assert ranks_label([0, 1, 2, 5, 7, 8]) == "rank0-2,5,7-8"


def test_a_job_that_hangs_is_marked_hung_with_its_stacks_and_failed(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """hang_timeout 10s, on_hang fail: Hung within the timeout and a few seconds of the last
    line, the folded stacks in the events (rank 3 first), then the job fails saying so."""
    api = cluster.client()
    path = write_job(
        tmp_path / "hung", "hung", HANGS, timeout="5m", hang_timeout=10, on_hang="fail"
    )
    job = submit(api, path)
    final = wait_state(api, job, timeout=120)
    assert final["state"] == "failed", final["root_cause"]
    assert final["root_cause"].startswith("hung: epoch 1: every rank printed nothing"), final[
        "root_cause"
    ]
    assert "node0 ranks 0-1, node1 ranks 2-3" in final["root_cause"]
    conditions = {c["type"]: c for c in final["conditions"]}
    assert conditions["Hung"]["status"] == "True"
    events = {e["kind"]: e for e in final["events"]}
    stacks = events["HungStacks"]["message"]
    assert stacks.startswith("[rank3]\n"), stacks
    assert "all_reduce" in stacks.split("[rank0-2]")[1]
    ready = max(ln["time"] for ln in all_lines(api, job) if ln["text"].endswith("ready"))
    raised = datetime.fromisoformat(events["Hung"]["time"]).timestamp()
    # the timeout, a check, a beat, and room for a busy runner (short of twice the timeout)
    assert 10 <= raised - ready < 10 + 2 + 4 + 3, raised - ready
