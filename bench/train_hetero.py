"""Heterogeneous data parallel: wall time to a held-out loss, ElChe cadence against torch DDP.

2 ranks on gloo (CPU, one thread each), a small MLP on a synthetic classification task, batches
large enough that compute dominates. Rank 1 is slowed k times: after each batch it sleeps
(k - 1) times its compute (measured alone before the arms start), as a GPU k times slower would.
Arms, in the same torchrun, each from the same initial model for a given seed:

- fast alone: rank 0 trains by itself (rank 1 waits outside the arm);
- ddp: torch DistributedDataParallel, one batch per rank per step;
- pma: torch PeriodicModelAverager (local SGD, parameters averaged every 8 steps);
- cadence g0 / g1: muster.train.ElChe in cadence mode, gamma 0 and 1.

Metric: seconds until the held-out loss first reaches the target (interpolated between the
model snapshots rank 0 takes about every 0.25 s, and at every averaging round for ElChe;
snapshots are evaluated after the arm, outside the clock). Medians over seeds.

    .venv/bin/python bench/train_hetero.py [--ks 1,2,4] [--seeds 3]

Goals (issue 4): cadence >= 1.35x faster than DDP at k=2 and >= 2.2x at k=4 (ideal 1.5x and
2.5x), and within 10% of DDP at k=1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARMS = ["fast alone", "ddp", "pma", "cadence g0", "cadence g1"]


# --------------------------------------------------------------------------- worker (torchrun)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.nn.parallel import DistributedDataParallel

    from muster.train.elche import ElChe
    from muster.train.sampler import WindowSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    slow = rank == world - 1 and args.k > 1

    teacher = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(64, 32, generator=teacher), torch.randn(32, 10, generator=teacher)

    def make(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(samples, 64, generator=torch.Generator().manual_seed(seed))
        return x, (torch.relu(x @ w1) @ w2).argmax(dim=1)

    if (args.samples // args.batch // world) % 8:
        raise SystemExit("--samples / --batch / 2 must be a multiple of 8 (pma's period)")
    x, y = make(args.samples, 2)
    held_x, held_y = make(2048, 3)
    loss_fn = nn.CrossEntropyLoss()

    def new_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(64, args.hidden),
            nn.ReLU(),
            nn.Linear(args.hidden, args.hidden),
            nn.ReLU(),
            nn.Linear(args.hidden, 10),
        )

    def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # The slow rank's delay: (k - 1) times its measured compute per batch.
    probe = new_model(0)
    probe_opt = optimizer_for(probe)
    times = []
    for i in range(25):
        idx = torch.arange(i * args.batch, (i + 1) * args.batch) % args.samples
        t0 = time.perf_counter()
        probe_opt.zero_grad()
        loss_fn(probe(x[idx]), y[idx]).backward()
        probe_opt.step()
        times.append(time.perf_counter() - t0)
    compute_s = statistics.median(times[5:])
    delay = (args.k - 1) * compute_s if slow else 0.0

    class Clock:
        """Arm time on this rank, less the pauses for the epoch-end stop check."""

        def __init__(self) -> None:
            self.start = time.perf_counter()
            self.paused = 0.0
            self.snaps: list[tuple[float, list[torch.Tensor]]] = []
            self.last = -1.0

        def now(self) -> float:
            return time.perf_counter() - self.start - self.paused

        def snap(self, model: nn.Module, force: bool = False) -> None:
            if rank != 0:
                return
            t = self.now()
            if force or t - self.last >= 0.25:
                self.snaps.append((t, [p.detach().clone() for p in model.parameters()]))
                self.last = t

    def held_loss(model: nn.Module, params: list[torch.Tensor] | None = None) -> float:
        with torch.no_grad():
            if params is not None:
                for p, v in zip(model.parameters(), params, strict=True):
                    p.copy_(v)
            return float(loss_fn(model(held_x), held_y))

    def stop_check(clock: Clock, model: nn.Module, alone: bool = False) -> bool:
        """Epoch end: rank 0 evaluates (off the clock) and tells the cohort whether to stop."""
        t0 = time.perf_counter()
        flag = torch.zeros(2, dtype=torch.float64)
        if rank == 0:
            reached = held_loss(model) <= args.target
            flag[0] = float(reached or clock.now() > args.max_seconds * args.k)
        if not alone:
            dist.broadcast(flag, src=0)
        flag[1] = time.perf_counter() - t0
        clock.paused += float(flag[1])
        return bool(flag[0])

    def train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()
        if delay:
            time.sleep(delay)

    def lockstep(
        seed: int, sampler_world: int, sampler_rank: int
    ) -> Iterator[tuple[torch.Tensor, int]]:
        sampler = WindowSampler(
            args.samples, args.batch, rank=sampler_rank, world=sampler_world, seed=seed
        )
        for epoch in range(10_000):
            sampler.start_epoch(epoch)
            while sampler.remaining_batches >= sampler_world:
                yield sampler.deal([1] * sampler_world)[0], epoch
            yield torch.empty(0), epoch  # epoch end marker

    def run_fast_alone(seed: int) -> dict[str, Any]:
        if rank != 0:
            return {}
        model = new_model(seed)
        opt = optimizer_for(model)
        clock = Clock()
        batches = 0
        for idx, _ in lockstep(seed, 1, 0):
            if not len(idx):
                clock.snap(model, force=True)
                if stop_check(clock, model, alone=True):
                    break
                continue
            train_step(model, opt, idx)  # rank 0 is never the slowed one
            batches += 1
            clock.snap(model)
        return finish(clock, model, [batches, 0])

    def run_ddp(seed: int, periodic: bool) -> dict[str, Any]:
        base = new_model(seed)
        model: nn.Module = base if periodic else DistributedDataParallel(base)
        opt = optimizer_for(base)
        averager = PeriodicModelAverager(period=8, warmup_steps=0) if periodic else None
        clock = Clock()
        batches = 0
        for idx, _ in lockstep(seed, world, rank):
            if not len(idx):  # epoch end; for pma, 8 divides the steps of an epoch
                clock.snap(base, force=True)
                if stop_check(clock, base):
                    break
                continue
            train_step(model, opt, idx)
            batches += 1
            if averager is None:
                clock.snap(base)
            else:
                averager.average_parameters(base.parameters())
                if batches % 8 == 0:  # only an averaged model is the common one
                    clock.snap(base)
        return finish(clock, base, gathered(batches))

    def run_cadence(seed: int, gamma: float) -> dict[str, Any]:
        model = new_model(seed)
        opt = optimizer_for(model)
        elche = ElChe(
            model,
            opt,
            dataset_size=args.samples,
            batch_size=args.batch,
            mode="cadence",
            gamma=gamma,
            anchor_batches=args.anchor,
            seed=seed,
        )
        clock = Clock()
        window = -1
        for epoch in range(10_000):
            for idx in elche.epoch(epoch):
                if elche.window != window:  # the first batch after a round: the common model
                    window = elche.window
                    clock.snap(model, force=True)
                train_step(model, opt, idx)
            clock.snap(model, force=True)
            if stop_check(clock, model):
                break
        out = finish(clock, model, gathered(elche.batches_run))
        out["round_s"] = elche.round_ms / 1e3
        return out

    def gathered(batches: int) -> list[int]:
        counts = torch.zeros(world, dtype=torch.int64)
        counts[rank] = batches
        dist.all_reduce(counts)
        return [int(c) for c in counts]

    def finish(clock: Clock, model: nn.Module, batches: list[int]) -> dict[str, Any]:
        wall = clock.now()
        timeline = [(t, held_loss(model, params)) for t, params in clock.snaps]
        return {"wall_s": wall, "batches": batches, "timeline": timeline}

    arms: dict[str, Callable[[int], dict[str, Any]]] = {
        "fast alone": run_fast_alone,
        "ddp": lambda s: run_ddp(s, periodic=False),
        "pma": lambda s: run_ddp(s, periodic=True),
        "cadence g0": lambda s: run_cadence(s, 0.0),
        "cadence g1": lambda s: run_cadence(s, 1.0),
    }
    results: dict[str, dict[str, Any]] = {name: {} for name in arms}
    for seed in range(args.seeds):
        for name, arm in arms.items():
            dist.barrier()
            result = arm(seed)
            dist.barrier()
            if rank == 0:
                results[name][str(seed)] = result
                print(f"k={args.k} seed={seed} {name}: {summary(result, args.target)}", flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"compute_ms": compute_s * 1e3, "arms": results}))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- launcher


def time_to(timeline: list[list[float]], target: float) -> float | None:
    """First time the loss reaches ``target``, interpolated between snapshots."""
    prev: list[float] | None = None
    for t, loss in timeline:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return t
            frac = (prev[1] - target) / (prev[1] - loss)
            return prev[0] + frac * (t - prev[0])
        prev = [t, loss]
    return None


def summary(result: dict[str, Any], target: float) -> str:
    reached = time_to(result["timeline"], target)
    when = f"{reached:.2f}s" if reached is not None else f"not reached in {result['wall_s']:.1f}s"
    return f"{when} batches {result['batches']}"


def launch(args: argparse.Namespace) -> None:
    rows = []
    for k in args.ks:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            from muster.cli.local import local_torchrun

            cmd = local_torchrun(
                os.path.abspath(__file__), "--worker", "--k", str(k), "--out", str(out), nproc=2
            )
            for flag in ("seeds", "samples", "batch", "hidden", "lr", "target", "anchor"):
                cmd += [f"--{flag}", str(getattr(args, flag))]
            cmd += ["--max-seconds", str(args.max_seconds)]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            subprocess.run(cmd, check=True, env=env, timeout=3600)
            data = json.loads(out.read_text())
        medians: dict[str, float | None] = {}
        for name in ARMS:
            times = [time_to(r["timeline"], args.target) for r in data["arms"][name].values()]
            done = [t for t in times if t is not None]
            medians[name] = statistics.median(done) if len(done) == len(times) else None
        rows.append((k, data["compute_ms"], medians))

    def fmt(v: float | None) -> str:
        return f"{v:.2f}" if v is not None else "n/r"

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a is not None and b else "n/a"

    print(f"\nwall seconds to held-out loss {args.target}, median of {args.seeds} seeds")
    print(
        "| k | "
        + " | ".join(ARMS)
        + " | ddp / cadence g0 | ddp / cadence g1 | pma / cadence g1 | compute ms |"
    )
    print("|---" * (len(ARMS) + 5) + "|")
    for k, compute_ms, m in rows:
        cells = [fmt(m[a]) for a in ARMS]
        print(
            f"| {k} | "
            + " | ".join(cells)
            + f" | {ratio(m['ddp'], m['cadence g0'])} | {ratio(m['ddp'], m['cadence g1'])}"
            + f" | {ratio(m['pma'], m['cadence g1'])}"
            + f" | {compute_ms:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--ks", type=lambda s: [float(v) for v in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--target", type=float, default=0.45)
    parser.add_argument("--anchor", type=int, default=8, help="ElChe's anchor_batches")
    parser.add_argument("--max-seconds", type=float, default=30.0, help="per arm, times k")
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
