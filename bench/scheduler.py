"""Gang placement speed: muster's indexed scheduler against a plain linear scan, same run.

A pool of 10,000 simulated workers (torch versions, providers, regions, GPU counts, network
capabilities) and 1,000 queued gangs of 2-8 members, placed in queue order, each placement
taking its workers out of the pool. Prints placements per second and p50/p99 per placement
for both, and the ratio.

    .venv/bin/python bench/scheduler.py [--workers 10000] [--jobs 1000] [--seed 1]

Goal (issue 2): >= 5,000 placements/s and p99 < 5 ms on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from muster.scheduler import Placement, PoolIndex, place_gang
from muster.scheduler.linear import linear_place
from muster.spec import (
    Gpus,
    JobSpec,
    NetworkCaps,
    WorkerInventory,
    WorkerState,
    WorkerView,
    parse_job,
)

REGIONS = [
    ("aws", "us-east-1", "us"),
    ("aws", "eu-west-1", "eu"),
    ("gcp", "us-central1", "us"),
    ("gcp", "europe-west4", "eu"),
    ("azure", "eastus", "us"),
    ("lambda", "us-tx-1", "us"),
    ("runpod", "eu-ro-1", "eu"),
    ("coreweave", "us-east-04", "us"),
]
TORCH = ["2.4.0", "2.5.1", "2.5.1", "2.6.0"]


def make_pool(n: int, rnd: random.Random) -> list[WorkerView]:
    views = []
    for i in range(n):
        provider, region, region_class = rnd.choice(REGIONS)
        gpus = rnd.choice([0, 1, 2, 4, 8, 8])
        container = provider == "runpod"
        inv = WorkerInventory(
            id=f"w{i:05d}",
            hostname=f"w{i:05d}.{region}",
            advertise_address=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",
            torch_version=rnd.choice(TORCH),
            torchrun=True,
            backends=["gloo", "nccl"] if gpus else ["gloo"],
            gpus=Gpus(count=gpus, vendor=rnd.choice(["nvidia"] * 5 + ["amd"]) if gpus else None),
            provider=provider,
            region=region,
            region_class=region_class,
            network=NetworkCaps(
                private_network_id=None if container else f"{provider}-{region}-vpc",
                can_create_device=not container,
                container_only=container,
            ),
        )
        views.append(WorkerView(inventory=inv))
    return views


def make_jobs(n: int, rnd: random.Random) -> list[JobSpec]:
    jobs = []
    for i in range(n):
        gpus = rnd.choice([0, 1, 2, 4, 8])
        dist: dict[str, Any] = {
            "num_workers": rnd.randint(2, 8),
            "procs_per_worker": max(gpus, 1),
            "network": rnd.choice(["colocated", "regional", "regional", "global"]),
            "transport": rnd.choice(["direct", "direct", "auto"]),
        }
        jobs.append(
            parse_job(
                {
                    "name": f"job-{i}",
                    "entrypoint": "train.py",
                    "resources": {"gpus": gpus},
                    "distributed": dist,
                }
            )
        )
    return jobs


def run_indexed(views: list[WorkerView], jobs: list[JobSpec]) -> tuple[list[float], int]:
    t0 = time.perf_counter()
    pool = PoolIndex(views)
    print(
        f"  (indexing {len(views)} workers into {len(pool.slots)} kinds took "
        f"{(time.perf_counter() - t0) * 1e3:.0f} ms, once per scheduler pass)"
    )
    times, placed = [], 0
    for spec in jobs:
        t0 = time.perf_counter()
        outcome = place_gang(spec, pool)
        if isinstance(outcome, Placement):
            pool.take(outcome.worker_ids)
            placed += 1
        times.append(time.perf_counter() - t0)
    return times, placed


def run_linear(views: list[WorkerView], jobs: list[JobSpec]) -> tuple[list[float], int]:
    current = list(views)
    position = {v.id: i for i, v in enumerate(current)}
    times, placed = [], 0
    for spec in jobs:
        t0 = time.perf_counter()
        outcome = linear_place(spec, current)
        if outcome is not None:
            for wid in outcome.worker_ids:
                i = position[wid]
                current[i] = WorkerView(inventory=current[i].inventory, state=WorkerState.RESERVED)
            placed += 1
        times.append(time.perf_counter() - t0)
    return times, placed


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(name: str, times: list[float], placed: int) -> float:
    rate = len(times) / sum(times)
    print(
        f"{name:<14} {len(times):>6} {placed:>7} {rate:>12,.0f} "
        f"{pct(times, 0.5) * 1e3:>9.3f} {pct(times, 0.99) * 1e3:>9.3f}"
    )
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=1_000)
    parser.add_argument(
        "--baseline-jobs",
        type=int,
        default=200,
        help="the linear scan is slow; time it on the first N jobs",
    )
    parser.add_argument("--seed", type=int, default=int(os.environ.get("MUSTER_BENCH_SEED", 1)))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(
        f"seed {args.seed}: {args.workers} workers, {args.jobs} gangs of 2-8, "
        f"{args.repeat} runs, medians of the per-run figures"
    )
    rnd = random.Random(args.seed)
    views = make_pool(args.workers, rnd)
    jobs = make_jobs(args.jobs, rnd)
    print(
        f"{'scheduler':<14} {'jobs':>6} {'placed':>7} {'placements/s':>12} "
        f"{'p50 ms':>9} {'p99 ms':>9}"
    )
    rates: dict[str, list[float]] = {"muster": [], "linear": []}
    p99: list[float] = []
    for _ in range(args.repeat):
        times, placed = run_indexed(views, jobs)
        rates["muster"].append(report("muster", times, placed))
        p99.append(pct(times, 0.99))
        times, placed = run_linear(views, jobs[: args.baseline_jobs])
        rates["linear"].append(report("linear scan", times, placed))
    muster_rate = statistics.median(rates["muster"])
    linear_rate = statistics.median(rates["linear"])
    print(
        f"median: muster {muster_rate:,.0f}/s, p99 {statistics.median(p99) * 1e3:.3f} ms; "
        f"linear scan {linear_rate:,.0f}/s; ratio {muster_rate / linear_rate:.0f}x"
    )
    ok = muster_rate >= 5000 and statistics.median(p99) < 0.005
    print("goal (>= 5,000/s, p99 < 5 ms):", "met" if ok else "NOT met")


if __name__ == "__main__":
    main()
