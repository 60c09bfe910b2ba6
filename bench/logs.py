"""End-to-end log ingest: ranks' lines -> agent -> controller -> store, with 4 ranks.

Each of 4 ranks (2 nodes x 2 processes) prints N numbered lines as fast as it can. Anchor:
the same job under torchrun by hand with each rank's output redirected to files (what the
ranks can produce). muster: a warm local cluster; timed from submit until every line is in
the store (counted in the controller's SQLite file). Prints lines/s for both, the ratio,
and how many lines were lost (must be 0).

    .venv/bin/python bench/logs.py [--lines 250000] [--runs 3]

Goal (issue 3): >= 100,000 lines/s end to end, 0 lost.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from muster.cli.local import LocalCluster, free_port
from muster.client import Client, pack_bundle
from muster.spec import parse_job

SCRIPT = """
import os, sys, time
rank, n = int(os.environ["RANK"]), int(sys.argv[1])
print(f"start {time.time()}", file=sys.stderr, flush=True)
write = sys.stdout.write
for i in range(n):
    write(f"rank={rank} line={i} some typical training log text loss=0.1234\\n")
sys.stdout.flush()
print(f"end {time.time()}", file=sys.stderr, flush=True)
"""


def stamps(texts: list[str], word: str) -> list[float]:
    return [float(t.split()[1]) for t in texts if t.startswith(word + " ")]


def by_hand(workdir: Path, lines: int) -> float:
    """What the ranks produce alone: all lines over (last end - first start)."""
    port = free_port()
    logs = workdir / f"logs-{port}"
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
                "--log-dir",
                str(logs / f"node{node}"),
                "--redirects",
                "3",
                "loud.py",
                str(lines),
            ],
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        for node in (0, 1)
    ]
    for p in procs:
        p.wait(600)
    texts = [ln for f in logs.rglob("stderr.log") for ln in f.read_text().splitlines()]
    return 4 * lines / (max(stamps(texts, "end")) - min(stamps(texts, "start")))


def stored(db: Path, job_id: str) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        row = conn.execute(
            "SELECT count(*) FROM log_lines WHERE job_id = ? AND origin = 'rank'", (job_id,)
        ).fetchone()
    return int(row[0])


def with_muster(api: Client, db: Path, workdir: Path, lines: int) -> tuple[float, int]:
    """Lines stored per second: all lines over (all stored - the ranks' first start)."""
    spec = parse_job(
        {
            "name": "loud",
            "entrypoint": "loud.py",
            "args": [str(lines)],
            "distributed": {"num_workers": 2, "procs_per_worker": 2, "backend": "gloo"},
        }
    )
    data, digest = pack_bundle(workdir / "src")
    api.upload_bundle(data)
    job_id = api.submit(spec.model_dump(mode="json"), digest)["id"]
    total = 4 * lines + 8  # the numbered lines plus each rank's start and end
    deadline = time.monotonic() + 600
    while stored(db, job_id) < total and time.monotonic() < deadline:
        if api.job(job_id)["state"] in ("failed", "cancelled"):
            break
        time.sleep(0.05)
    done = time.time()
    texts = [
        ln["text"] for ln in api.logs(job_id, limit=50_000)["lines"] if ln["stream"] == "stderr"
    ]
    starts = stamps(texts, "start")
    return 4 * lines / (done - min(starts)), total - stored(db, job_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=250_000, help="per rank")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(agents=2) as cluster:
        workdir = Path(tmp)
        (workdir / "src").mkdir()
        (workdir / "src" / "loud.py").write_text(SCRIPT)
        (workdir / "loud.py").write_text(SCRIPT)
        assert cluster.data_dir is not None
        db = cluster.data_dir / "muster.db"
        api = cluster.client()
        hand, ours, lost = [], [], 0
        for i in range(args.runs):
            hand.append(by_hand(workdir, args.lines))
            rate, missing = with_muster(api, db, workdir, args.lines)
            ours.append(rate)
            lost += missing
            print(
                f"run {i + 1}: ranks alone {hand[-1]:,.0f} lines/s, muster end to end "
                f"{rate:,.0f} lines/s, lost {missing}"
            )
    h, m = statistics.median(hand), statistics.median(ours)
    print(
        f"median: ranks alone {h:,.0f} lines/s; muster {m:,.0f} lines/s; ratio {m / h:.2f}; "
        f"lost {lost} (goal >= 100,000 lines/s and 0 lost: "
        f"{'met' if m >= 100_000 and lost == 0 else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
