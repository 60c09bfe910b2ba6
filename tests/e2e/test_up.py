"""`muster up CLUSTER_FILE JOB` over a real OpenSSH server on loopback: one walk-in per
configured worker, started over SSH, dialling back through a reverse forward; the job's lines
are followed until it ends and the exit code is its verdict."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from muster.cli.local import LocalCluster
from tests.sshd import Sshd, sshd_or_skip

pytestmark = pytest.mark.timeout(600)

SCRIPT = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([1.0])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {os.environ['BOX']} "
      f"sum={t.item():.0f}", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(agents=0, heartbeat_interval=1.0, heartbeat_timeout=5.0) as c:
        yield c


@pytest.fixture(scope="module")
def sshd(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    server = sshd_or_skip(tmp_path_factory.mktemp("sshd"), cluster.port, guarded=False)
    yield server
    server.stop()


def cluster_file(tmp_path: Path, cluster: LocalCluster, sshd: Sshd) -> Path:
    def worker(host: str, procs: int) -> dict[str, object]:
        return {
            "host": host,
            "procs": procs,
            "interface": "lo",
            "python": sys.executable,
            "work_dir": str(tmp_path / host),
            "env": {"BOX": host},
            "ssh": {
                "target": "127.0.0.1",
                "port": sshd.port,
                "user": "root",
                "identity_file": str(sshd.key),
                "options": sshd.client_options,
            },
        }

    data = {
        "controller": {"host": "127.0.0.1", "port": cluster.port},
        "workers": [worker("w1", 2), worker("w2", 1)],
        "env": {"FROM_CLUSTER": "1"},
    }
    path = tmp_path / "muster.cluster.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def job_file(tmp_path: Path) -> Path:
    root = tmp_path / "job"
    root.mkdir()
    (root / "train.py").write_text(SCRIPT)
    (root / "job.yaml").write_text(
        yaml.safe_dump(
            {"name": "fanout", "entrypoint": "train.py", "distributed": {"num_workers": 1}}
        )
    )
    return root / "job.yaml"


def test_up_runs_the_job_on_every_configured_worker_through_ssh(
    cluster: LocalCluster, sshd: Sshd, tmp_path: Path
) -> None:
    env = {
        **cluster._env(),
        "MUSTER_API_TOKEN": cluster.token(),
        "MUSTER_TOKEN": cluster.join_token(),
        "COLUMNS": "200",
    }
    done = subprocess.run(
        [
            *(sys.executable, "-m", "muster", "up"),
            *(str(cluster_file(tmp_path, cluster, sshd)), str(job_file(tmp_path))),
            *("--controller", cluster.url),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        jobs = cluster.client().jobs()
        pytest.fail(f"{done.stderr[-2000:]}\n{[(j['id'], j['root_cause']) for j in jobs]}")
    assert "a window of 3 rank(s) on 2 host(s)" in done.stderr
    for rank, box in ((0, "w1"), (1, "w1"), (2, "w2")):
        assert f"[rank{rank}] rank {rank} of 3 on {box} sum=3" in done.stdout
    api = cluster.client()
    job = next(j for j in api.jobs() if j["name"] == "fanout")
    detail = api.job(job["id"])
    assert detail["spec"]["env"]["FROM_CLUSTER"] == "1"
    assert detail["spec"]["distributed"]["node_procs"] == [2, 1] or detail["spec"]["distributed"][
        "node_procs"
    ] == [1, 2]
    # The join secret went down ssh's stdin: no process ever had it on its command line.
    logs = "".join(p.read_text() for p in sshd.log.parent.glob("*.log"))
    assert cluster.join_token().split("#")[0] not in logs


def test_a_worker_ssh_cannot_reach_fails_up_with_sshs_words_and_cancels_the_job(
    cluster: LocalCluster, sshd: Sshd, tmp_path: Path
) -> None:
    path = cluster_file(tmp_path, cluster, sshd)
    data = yaml.safe_load(path.read_text())
    data["workers"][1]["ssh"]["port"] = 1  # nothing listens there
    path.write_text(yaml.safe_dump(data))
    env = {
        **cluster._env(),
        "MUSTER_API_TOKEN": cluster.token(),
        "MUSTER_TOKEN": cluster.join_token(),
    }
    done = subprocess.run(
        [
            *(sys.executable, "-m", "muster", "up", str(path), str(job_file(tmp_path))),
            *("--controller", cluster.url),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "ssh to w2 ended at once" in done.stderr
    assert "Connection refused" in done.stderr
    api = cluster.client()
    cancelled = [j for j in api.jobs() if j["name"] == "fanout" and j["state"] == "cancelled"]
    assert cancelled
