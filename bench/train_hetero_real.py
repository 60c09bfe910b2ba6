"""The real layer of bench/train_hetero.py: 2 ranks on gloo (CPU), the replay's task, and the
arms the replay tuned, in wall time; their ratios are compared with the replay's.

Timing hygiene: each rank runs one thread pinned to its own core; the slow rank sleeps k-1
times its own measured compute after every batch (measured live, so a larger batch sleeps
longer), and the realized k (the slow rank's wall per batch over its compute) is printed;
arms run in a random order per repetition; held-out losses are evaluated after each arm from
snapshots (rank 0's model every ~50 ms for DDP and alone, the consensus after every round for
cadence), off the clock.

Arms: ``alone`` (rank 0 alone), ``ddp-prop`` (torch DDP, speed-proportional batches, each
rank's loss scaled so the gradient is the mean over all samples), ``cadence`` (muster.train's
ElChe). ``--arms`` gives each one's learning rate (and anchor, gamma) as the replay tuned them.

    .venv/bin/python bench/train_hetero_real.py --ks 1,2,4 --reps 3 \\
        --arms '{"alone": [0.001], "ddp-prop": [0.002], "cadence": [0.002, 8, 0.5]}'
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from bench.train_replay import SIZES, Arm, _lr, held_loss, make_data, new_model
    from muster.train.elche import ElChe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if hasattr(os, "sched_setaffinity") and os.cpu_count():
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    task = SIZES[args.size]
    b = task.batch
    slow = rank == 1 and args.k > 1
    specs: dict[str, list[float]] = json.loads(args.arms)
    budget = task.budget_epochs * task.samples
    results: dict[str, Any] = {}

    def train(model: nn.Module, opt: torch.optim.Optimizer, x: Any, y: Any, scale: float) -> float:
        """One batch; returns its compute seconds (the slow rank then sleeps k-1 times it)."""
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        (nn.functional.cross_entropy(model(x), y) * scale).backward()  # type: ignore[no-untyped-call]
        opt.step()
        spent = time.perf_counter() - t0
        if slow:
            time.sleep((args.k - 1) * spent)
        return spent

    def run_arm(name: str, arm: Arm, seed: int, data: Any) -> dict[str, Any]:
        model = new_model(task, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=arm.lr, weight_decay=0.0)
        snaps: list[tuple[float, list[torch.Tensor]]] = []
        compute = wall_batches = 0.0
        dist.barrier()
        start = time.perf_counter()

        def snap(force: bool = False) -> None:
            now = time.perf_counter() - start
            if rank == 0 and (force or not snaps or now - snaps[-1][0] >= 0.05):
                snaps.append((now, [p.detach().clone() for p in model.parameters()]))

        def set_lr(seen: float) -> None:
            for g in opt.param_groups:
                g["lr"] = _lr(arm, task, seen)

        snap(force=True)
        gen = torch.Generator().manual_seed(seed)
        if name == "alone":
            seen = 0
            while rank == 0 and seen < budget:
                idx = torch.randint(task.samples, (b,), generator=gen)
                set_lr(seen)
                train(model, opt, data.x[idx], data.y[idx], 1.0)
                seen += b
                snap()
        elif name == "ddp-prop":
            fast = round(2 * b * args.k / (args.k + 1))
            mine = fast if rank == 0 else 2 * b - fast
            ddp = DistributedDataParallel(model)
            seen = 0
            while seen < budget:
                idx = torch.randint(task.samples, (2 * b,), generator=gen)
                part = idx[:fast] if rank == 0 else idx[fast:]
                set_lr(seen)
                t0 = time.perf_counter()
                # DDP averages the ranks' gradients: weigh each by its share of the samples.
                compute += train(ddp, opt, data.x[part], data.y[part], 2 * mine / (2 * b))
                wall_batches += time.perf_counter() - t0
                seen += 2 * b
                snap()
        else:  # cadence
            elche = ElChe(
                model,
                opt,
                dataset_size=task.samples,
                batch_size=b,
                mode="cadence",
                gamma=arm.gamma,
                anchor_batches=arm.period,
                seed=seed,
            )
            window, before = -1, 0
            for epoch in range(int(task.budget_epochs)):
                for idx in elche.epoch(epoch):
                    if elche.window != window:  # a round just ran: the consensus
                        window = elche.window
                        snap(force=True)
                        set_lr(before)
                        before += sum(elche.counts) * b
                    t0 = time.perf_counter()
                    compute += train(model, opt, data.x[idx], data.y[idx], 1.0)
                    wall_batches += time.perf_counter() - t0
            snap(force=True)
        dist.barrier()
        wall = time.perf_counter() - start
        got = torch.tensor([wall_batches / compute if slow and compute else 1.0])
        dist.broadcast(got, src=1)
        curve = [(t, held_loss(_load(model, p), data)) for t, p in snaps] if rank == 0 else []
        return {
            "seed": seed,
            "wall": wall,
            "curve": curve,
            "h_star": data.h_star,
            "realized_k": float(got),
        }

    order = list(specs)
    for rep in range(args.reps):
        data = make_data(task, rep)
        random.Random(rep).shuffle(order)  # a random order per repetition
        for name in order:
            spec = specs[name]
            arm = Arm(
                name,
                spec[0],
                int(spec[1]) if len(spec) > 1 else 8,
                spec[2] if len(spec) > 2 else 1.0,
            )
            results.setdefault(name, []).append(run_arm(name, arm, rep, data))
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _load(model: Any, params: list[Any]) -> Any:
    import torch

    with torch.no_grad():
        for p, v in zip(model.parameters(), params, strict=True):
            p.copy_(v)
    return model


def first_below(curve: list[list[float]], target: float) -> float | None:
    prev = None
    for t, loss in curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return t
            return prev[0] + (t - prev[0]) * (prev[1] - target) / (prev[1] - loss)
        prev = (t, loss)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--ks", default="1,2,4")
    parser.add_argument("--size", default="ci")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gap", type=float, default=0.10, help="target: H* + gap")
    parser.add_argument(
        "--arms",
        default='{"alone": [0.001], "ddp-prop": [0.002], "cadence": [0.002, 8, 0.5]}',
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from muster.cli.local import local_torchrun

    for k in args.ks.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = local_torchrun(
                os.path.abspath(__file__), "--worker", "--k", k, "--out", str(out), nproc=2
            )
            cmd += ["--size", args.size, "--reps", str(args.reps), "--arms", args.arms]
            subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=7200)
            results = json.loads(out.read_text())
        times = {
            name: [first_below(r["curve"], r["h_star"] + args.gap) for r in runs]
            for name, runs in results.items()
        }
        realized = statistics.median(r["realized_k"] for r in results["cadence"])
        print(f"\nk = {k} (realized {realized:.2f}): wall s to H*+{args.gap:g}, {args.reps} reps")
        for name, ts in times.items():
            shown = ", ".join("-" if t is None else f"{t:.2f}" for t in ts)
            print(f"  {name:10} {shown}")
        if all(t is not None for ts in times.values() for t in ts):
            alone = statistics.median(times["alone"])  # type: ignore[type-var]
            cad = statistics.median(times["cadence"])  # type: ignore[type-var]
            prop = statistics.median(times["ddp-prop"])  # type: ignore[type-var]
            phi = (alone / cad - 1) * float(k)
            print(f"  phi {phi:.2f}; cadence / ddp-prop speed {prop / cad:.2f}")


if __name__ == "__main__":
    main()
