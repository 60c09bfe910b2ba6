"""The real layer of bench/train_hetero.py: 2 ranks on gloo (CPU), the replay's task, and the
arms the replay tuned, in wall time; their ratios are compared with the replay's.

Timing hygiene: each rank runs one thread pinned to its own core; the slow rank sleeps k-1
times its own measured compute after every batch (measured live, so a larger batch sleeps
longer), and the realized k (the slow rank's wall time per batch over the fast rank's compute
per batch, in cadence) is printed;
arms run in a random order per repetition; held-out losses are evaluated after each arm from
snapshots (rank 0's model every ~20 ms for DDP and alone, the consensus after every round for
cadence), copied and evaluated off the clock; the time to target is the first snapshot at or
below it (not interpolated).

Arms: ``alone`` (rank 0 alone), ``ddp-prop`` (DDP's algorithm with speed-proportional
batches: each rank's gradient weighted by its share of the samples and all-reduced between
backward and the step, without DDP's bucket overlap, so that only compute is slowed and not
the all-reduce's wait), ``cadence`` (muster.train's ElChe). Every arm reads shuffled epochs.
``--arms`` gives each one's learning rate (and anchor, gamma) as the replay tuned them.

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

    from bench.train_replay import SIZES, Arm, Stream, _lr, held_loss, make_data, new_model
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

    def pace(started: float) -> float:
        """The slow rank sleeps k-1 times the compute since ``started``; returns it."""
        spent = time.perf_counter() - started
        if slow:
            time.sleep((args.k - 1) * spent)
        return spent

    def train(
        model: nn.Module,
        opt: torch.optim.Optimizer,
        x: Any,
        y: Any,
        scale: float = 1.0,
        reduce: bool = False,
    ) -> float:
        """One batch; returns its compute seconds. Only compute is slowed: with ``reduce``
        (DDP's algorithm) the gradients are all-reduced between backward and the step, and
        the all-reduce, with its wait for the other rank, is not stretched."""
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        (nn.functional.cross_entropy(model(x), y) * scale).backward()  # type: ignore[no-untyped-call]
        spent = pace(t0)
        if reduce:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)  # the sum of share-weighted gradients: the mean over all
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        t1 = time.perf_counter()
        opt.step()
        return spent + pace(t1)

    def calibrate(model_for_costs: nn.Module, rank: int) -> dict[str, float]:
        """This machine's costs in the replay's terms (medians, ms): a fast batch's compute
        (forward, backward, AdamW step of B samples), the latency of a one-number gloo
        all-reduce (alpha) and the time per MiB of one of the model's size (beta)."""
        data = make_data(task, 0)
        opt = torch.optim.AdamW(model_for_costs.parameters(), lr=1e-4)
        batch = []
        for i in range(80):
            idx = torch.arange(i * b, (i + 1) * b) % task.samples
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model_for_costs(data.x[idx]), data.y[idx]).backward()  # type: ignore[no-untyped-call]
            opt.step()
            batch.append(time.perf_counter() - t0)

        def allreduce_ms(tensor: torch.Tensor, times: int) -> float:
            spent = []
            for _ in range(times):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(tensor)
                spent.append(time.perf_counter() - t0)
            return statistics.median(spent) * 1e3

        alpha = allreduce_ms(torch.zeros(1, dtype=torch.float64), 200)
        flat = torch.zeros(sum(p.numel() for p in model_for_costs.parameters()))
        full = allreduce_ms(flat, 50)
        mib = flat.numel() * flat.element_size() / 2**20
        got = torch.tensor([statistics.median(batch[20:]) * 1e3, alpha, full], dtype=torch.float64)
        dist.all_reduce(got)  # the two ranks' mean
        c, alpha, full = (got / 2).tolist()
        return {"batch_ms": c, "alpha_ms": alpha, "ms_per_mb": max(0.0, full - alpha) / mib}

    def run_arm(name: str, arm: Arm, seed: int, data: Any) -> dict[str, Any]:
        model = new_model(task, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=arm.lr, weight_decay=0.0)
        snaps: list[tuple[float, list[torch.Tensor]]] = []
        compute = wall_batches = 0.0
        batches = 0
        paused = [0.0]  # snapshot copies, taken off the clock
        dist.barrier()
        start = time.perf_counter()

        def snap(force: bool = False) -> None:
            t0 = time.perf_counter()
            now = t0 - start - paused[0]
            if rank == 0 and (force or not snaps or now - snaps[-1][0] >= 0.02):
                snaps.append((now, [p.detach().clone() for p in model.parameters()]))
            paused[0] += time.perf_counter() - t0

        def set_lr(seen: float) -> None:
            for g in opt.param_groups:
                g["lr"] = _lr(arm, task, seen)

        snap(force=True)
        stream = Stream(task.samples, seed)  # shuffled epochs, as ElChe deals them
        if name == "alone":
            seen = 0
            while rank == 0 and seen < budget:
                idx = stream.take(b)
                set_lr(seen)
                train(model, opt, data.x[idx], data.y[idx])
                seen += b
                snap()
        elif name == "ddp-prop":
            fast = round(2 * b * args.k / (args.k + 1))
            mine = fast if rank == 0 else 2 * b - fast
            with torch.no_grad():  # the same start on both ranks, as DDP broadcasts it
                for p in model.parameters():
                    dist.broadcast(p, src=0)
            seen = 0
            while seen < budget:
                idx = stream.take(2 * b)
                part = idx[:fast] if rank == 0 else idx[fast:]
                set_lr(seen)
                t0 = time.perf_counter()
                # Each rank's gradient weighted by its share of the samples; summed.
                compute += train(
                    model, opt, data.x[part], data.y[part], mine / (2 * b), reduce=True
                )
                wall_batches += time.perf_counter() - t0
                seen += 2 * b
                snap()
        else:  # cadence, on the collective backend or (cadence-star) on the CPU star
            elche = ElChe(
                model,
                opt,
                dataset_size=task.samples,
                batch_size=b,
                mode="cadence",
                gamma=arm.gamma,
                anchor_batches=arm.period,
                seed=seed,
                backend="star" if name == "cadence-star" else "collective",
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
                    compute += train(model, opt, data.x[idx], data.y[idx])
                    wall_batches += time.perf_counter() - t0
                    batches += 1
            snap(force=True)
            elche.close()
        dist.barrier()
        wall = time.perf_counter() - start - paused[0]
        # Realized k: the slow rank's wall time per batch over the fast rank's compute per
        # batch (cadence's batches; its rounds are outside both).
        per = torch.zeros(4, dtype=torch.float64)
        if batches:
            per[2 * rank : 2 * rank + 2] = torch.tensor([wall_batches, compute]) / batches
        dist.all_reduce(per)
        got = per[2] / per[1] if per[1] > 0 else torch.tensor(1.0)
        curve = [(t, held_loss(_load(model, p), data)) for t, p in snaps] if rank == 0 else []
        return {
            "seed": seed,
            "wall": wall,
            "curve": curve,
            "h_star": data.h_star,
            "realized_k": float(got),
        }

    results["calibration"] = calibrate(model_for_costs=new_model(task, 0), rank=rank)
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
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not the interpreter's teardown: gloo sometimes aborts there (torch#190489)


def _load(model: Any, params: list[Any]) -> Any:
    import torch

    with torch.no_grad():
        for p, v in zip(model.parameters(), params, strict=True):
            p.copy_(v)
    return model


def first_below(curve: list[list[float]], target: float) -> float | None:
    return next((t for t, loss in curve if loss <= target), None)


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
        cal = results.pop("calibration")
        times = {
            name: [first_below(r["curve"], r["h_star"] + args.gap) for r in runs]
            for name, runs in results.items()
        }
        realized = statistics.median(r["realized_k"] for r in results["cadence"])
        print(f"\nk = {k} (realized {realized:.2f}): wall s to H*+{args.gap:g}, {args.reps} reps")
        print(
            f"  this machine: a batch {cal['batch_ms']:.2f} ms, all-reduce "
            f"{cal['alpha_ms']:.2f} ms + {cal['ms_per_mb']:.2f} ms/MiB"
        )
        replayed = replay(args, cal, realized)
        for name, ts in times.items():
            shown = ", ".join("-" if t is None else f"{t:.2f}" for t in ts)
            # (the replay has no model of the star's transport: cadence-star reads cadence's)
            guess = replayed.get(name, replayed.get(name.split("-")[0], []))
            again = ", ".join("-" if t is None else f"{t:.2f}" for t in guess)
            print(f"  {name:10} {shown}   (replay with these costs: {again})")
        for label, got in (("real", times), ("replay", replayed)):
            if all(t is not None for ts in got.values() for t in ts):
                alone = statistics.median(got["alone"])  # type: ignore[type-var]
                cad = statistics.median(got["cadence"])  # type: ignore[type-var]
                prop = statistics.median(got["ddp-prop"])  # type: ignore[type-var]
                phi = (alone / cad - 1) * float(k)
                print(f"  {label:6} phi {phi:.2f}; cadence / ddp-prop speed {prop / cad:.2f}")
        star = times.get("cadence-star", [])
        if star and all(t is not None for t in star + times["cadence"]):
            ratio = statistics.median(star) / statistics.median(times["cadence"])  # type: ignore[type-var]
            print(f"  cadence on the star / on gloo all_reduce: {ratio:.2f}x the time to target")


def replay(args: argparse.Namespace, cal: dict[str, float], k: float) -> dict[str, list[Any]]:
    """The replay's seconds to the target for the same arms, data and seeds, on a virtual
    clock set to the costs measured on this machine and the realized slowdown."""
    from bench.train_replay import SIZES, Arm, Costs, make_data, run

    task = SIZES[args.size]
    costs = Costs(k=k, **cal)
    out: dict[str, list[Any]] = {}
    for name, spec in json.loads(args.arms).items():
        if name == "cadence-star":
            continue  # (the replay has no model of the star's transport)
        period = int(spec[1]) if len(spec) > 1 else 8
        arm = Arm(name, spec[0], period, spec[2] if len(spec) > 2 else 1.0)
        for rep in range(args.reps):
            data = make_data(task, rep)
            target = data.h_star + args.gap
            reached = run(arm, task, data, costs, rep, stop_at=target, eval_every_ms=20.0)
            at = reached.first_below(target)
            out.setdefault(name, []).append(None if at is None else at / 1e3)
    return out


if __name__ == "__main__":
    main()
