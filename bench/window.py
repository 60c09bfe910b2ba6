"""Walk-ins against the pool road (issue 11), and a window of 64 simulated walk-ins.

1. Launch: a 2 hosts x 2 ranks gloo job on loopback, timed from the decision to run it until
   every rank's first line is back from the logs API (polled every 50 ms), both roads in the
   same run, alternating:
   - pool (the anchor): two warm `muster agent`s, idle; to the fourth first line from the
     submit call (bundle already uploaded), and from the moment it returned (the job queued:
     the stronger baseline, as the window job was queued before its boxes dialled);
   - window: the same job with `membership: window` (start auto, target 4 ranks), submitted
     beforehand; two `muster join` boxes walk in, the second once the first is on the
     roster; from the second box's dial (its agent logs the moment its link came up, after
     the handshake; its inventory was probed before) to the fourth first line.
   The rest (placement, node 0's port, ASSIGN, unpack, torchrun, Python start) is the same
   code on both roads. Goal: window / pool-from-queued <= 1.1 (medians).
2. Admission: 64 simulated walk-ins (bench/control_plane.py's SimAgent: the real handshake
   and frames, one asyncio process) dial a manual window of 64 ranks and send their
   INVENTORY at once; timed until the last JOIN_REPLY admitted arrives. Goal: < 2 s.

    .venv/bin/python bench/window.py [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from control_plane import AgentStats, SimAgent  # bench/ is not a package

from muster.cli.local import LocalCluster
from muster.client import Client, pack_bundle, split_token
from muster.spec import parse_job
from muster.wire import Kind

SCRIPT = """
import os
print(f"first line from rank {os.environ['RANK']}", flush=True)
"""
GANG = {"num_workers": 2, "procs_per_worker": 2, "backend": "gloo"}


def first_lines(api: Client, job_id: str, ranks: int) -> float:
    """Wall-clock time at which every rank's first line had come back."""
    seen: set[int] = set()
    cursor = ""
    while len(seen) < ranks:
        page = api.logs(job_id, after=cursor)
        cursor = page["next"]
        seen |= {ln["rank"] for ln in page["lines"] if ln["origin"] == "rank"}
        if len(seen) < ranks:
            time.sleep(0.05)
    return time.time()


def wait_done(api: Client, job_id: str) -> None:
    deadline = time.monotonic() + 120
    while api.job(job_id)["state"] not in ("succeeded", "failed", "cancelled"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{job_id} did not end")
        time.sleep(0.1)


def pool_run(api: Client, digest: str) -> tuple[float, float]:
    """(from the submit call, from the moment it returned: the job queued)."""
    spec = parse_job({"name": "pool", "entrypoint": "first.py", "distributed": GANG})
    start = time.time()
    job_id = api.submit(spec.model_dump(mode="json"), digest)["id"]
    queued = time.time()
    done = first_lines(api, job_id, 4)
    wait_done(api, job_id)
    return done - start, done - queued


def window_run(cluster: LocalCluster, api: Client, digest: str, run: int) -> float:
    gang = {**GANG, "membership": "window", "window": {"join_timeout": "10m"}}
    spec = parse_job({"name": "walk", "entrypoint": "first.py", "distributed": gang})
    job_id = api.submit(spec.model_dump(mode="json"), digest)["id"]
    boxes = []
    assert cluster.data_dir is not None
    for i in range(2):
        host = f"box{run}-{i}"
        boxes.append(
            cluster._spawn(
                host,
                [
                    *("join", cluster.url, "--job", job_id, "--procs", "2", "--host", host),
                    *("--work-dir", str(cluster.data_dir / host)),
                ],
                env={"MUSTER_TOKEN": cluster.join_token()},
            )
        )
        deadline = time.monotonic() + 90
        while True:  # the first is on the roster (or the world formed) before the second dials
            view = api.window(job_id)
            if len(view.get("roster") or []) > i or view["phase"] not in ("waiting", None):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{host} did not walk in: {view}")
            time.sleep(0.05)
    done = first_lines(api, job_id, 4)
    wait_done(api, job_id)
    for box in boxes:
        box.wait(60)
    return done - max(dialled(cluster.log(f"box{run}-{i}")) for i in range(2))


def dialled(log: Path) -> float:
    """When the box's link came up (its agent logs it, to the millisecond, local time)."""
    for line in log.read_text().splitlines():
        if " connected to " in line:
            stamp, millis = line[:23].split(",")
            return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1e3
    raise RuntimeError(f"{log} never says its link came up")


async def admit_64(cluster: LocalCluster, count: int = 64) -> float:
    api = cluster.client()
    gang = {"num_workers": count, "procs_per_worker": 1, "backend": "gloo"}
    window = {"start": "manual", "quorum": count}
    spec = parse_job(
        {
            "name": "many",
            "entrypoint": "first.py",
            "distributed": {**gang, "membership": "window", "window": window},
        }
    )
    job_id = api.submit(spec.model_dump(mode="json"), None)["id"]
    secret = split_token(cluster.join_token())[0]
    url = cluster.url.replace("http", "ws", 1) + "/v1/agents/link"
    stats = AgentStats()
    admitted: dict[str, float] = {}
    all_in = asyncio.Event()

    class WalkIn(SimAgent):
        def _on_frame(self, kind: Kind, body: dict[str, Any], now: float) -> None:
            if kind is Kind.JOIN_REPLY and body.get("admitted"):
                admitted.setdefault(self.id, now)
                if len(admitted) == count:
                    all_in.set()
            super()._on_frame(kind, body, now)

    agents = [WalkIn(i, url, secret, 0.05, stats) for i in range(count)]
    for a in agents:
        host = f"sim-{a.id}"
        a.inventory["join"] = {"job": job_id, "host": host, "ranks": 1}
    gate = asyncio.Semaphore(32)
    await asyncio.gather(*(a.connect(gate) for a in agents))
    started = time.monotonic()
    await asyncio.gather(*(a.send_inventory() for a in agents))
    await asyncio.wait_for(all_in.wait(), 60)
    took = max(admitted.values()) - started
    phase = api.window(job_id)["phase"]
    api.cancel(job_id)
    await asyncio.gather(*(a.close() for a in agents), return_exceptions=True)
    if phase != "staging":
        raise RuntimeError(f"the window of 64 is {phase}, not staging")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "first.py").write_text(SCRIPT)
        data, digest = pack_bundle(workdir)
        with LocalCluster(agents=2) as cluster:
            api = cluster.client()
            api.upload_bundle(data)
            pool_run(api, digest)  # warm both roads once
            window_run(cluster, api, digest, 0)
            pool, queued, walk = [], [], []
            for run in range(1, args.runs + 1):
                from_submit, from_queued = pool_run(api, digest)
                pool.append(from_submit)
                queued.append(from_queued)
                walk.append(window_run(cluster, api, digest, run))
                print(
                    f"run {run}: pool {pool[-1]:.3f}s from submit, {queued[-1]:.3f}s from "
                    f"queued; window {walk[-1]:.3f}s from the last dial",
                    flush=True,
                )
        p, q, w = (statistics.median(x) for x in (pool, queued, walk))
        print(
            f"launch median: pool {p:.3f}s from submit, {q:.3f}s from queued; window "
            f"{w:.3f}s; window / pool-from-queued {w / q:.2f} (goal <= 1.1: "
            f"{'met' if w / q <= 1.1 else 'NOT met'}), window / pool-from-submit {w / p:.2f}"
        )
        with LocalCluster(agents=0) as cluster:
            took = asyncio.run(admit_64(cluster))
        print(
            f"64 simulated walk-ins admitted in {took:.3f}s "
            f"(goal < 2 s: {'met' if took < 2 else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
