"""Launch latency: submit -> the last rank's first line, muster against torchrun by hand.

The job is 2 nodes x 2 processes on gloo over loopback; each rank prints one line first
thing. Anchor: the same two torchrun commands started by this script, timed until all four
first lines show on their consoles (--tee 3). muster: a warm local cluster (controller +
2 agents), timed from `submit` (bundle packed and uploaded) until all four lines come back
from the logs API. Prints both medians and the ratio.

    .venv/bin/python bench/launch.py [--runs 7]

Goal (issue 3): ratio <= 1.15.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from muster.cli.local import LocalCluster, free_port
from muster.client import Client, pack_bundle
from muster.spec import parse_job

SCRIPT = """
import os
print(f"first line from rank {os.environ['RANK']}", flush=True)
"""
JOB = {
    "name": "launch",
    "entrypoint": "first.py",
    "distributed": {"num_workers": 2, "procs_per_worker": 2, "backend": "gloo"},
}


def by_hand(workdir: Path) -> float:
    """Seconds until both torchruns' consoles showed all four ranks' first lines."""
    port = free_port()
    seen: set[str] = set()
    done = threading.Event()
    lock = threading.Lock()

    def watch(proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "first line from rank" in line:
                with lock:
                    seen.add(line.rsplit(" ", 1)[-1].strip())
                    if len(seen) == 4:
                        done.set()

    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--max-restarts=0",
                "--tee",
                "3",
                "first.py",
            ],
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for node in (0, 1)
    ]
    threads = [threading.Thread(target=watch, args=(p,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    done.wait(120)
    elapsed = time.perf_counter() - start
    for p in procs:
        p.wait(120)
    return elapsed


def with_muster(api: Client, workdir: Path) -> float:
    start = time.perf_counter()
    spec = parse_job(JOB)
    data, digest = pack_bundle(workdir)
    api.upload_bundle(data)
    job_id = api.submit(spec.model_dump(mode="json"), digest)["id"]
    ranks: set[int] = set()
    cursor = ""
    while len(ranks) < 4:
        page = api.logs(job_id, after=cursor)
        cursor = page["next"]
        ranks |= {ln["rank"] for ln in page["lines"] if ln["origin"] == "rank"}
        if len(ranks) < 4:
            time.sleep(0.05)  # a client polling harder than this only steals the ranks' CPU
    elapsed = time.perf_counter() - start
    while api.job(job_id)["state"] not in ("succeeded", "failed"):
        time.sleep(0.05)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(agents=2) as cluster:
        workdir = Path(tmp)
        (workdir / "first.py").write_text(SCRIPT)
        api = cluster.client()
        with_muster(api, workdir)  # warm up both paths once
        by_hand(workdir)
        hand, ours = [], []
        for i in range(args.runs):
            hand.append(by_hand(workdir))
            ours.append(with_muster(api, workdir))
            print(f"run {i + 1}: torchrun by hand {hand[-1]:.3f}s, muster {ours[-1]:.3f}s")
    h, m = statistics.median(hand), statistics.median(ours)
    print(
        f"median: torchrun by hand {h:.3f}s, muster {m:.3f}s, ratio {m / h:.2f} "
        f"(goal <= 1.15: {'met' if m / h <= 1.15 else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
