"""Heterogeneous data parallel on a virtual clock: the real algorithms, simulated costs.

Every arm trains real models on a real task, one process, rank after rank; only time is
simulated: a batch costs ``c`` on the fast rank and ``k * c`` on the slow one, an all-reduce
``alpha + beta * bytes``. Runs are deterministic (the same seed gives the same curve), so the
ratios carry no noise, and the CI-sized task runs in seconds (tests/train/test_replay.py);
bench/train_hetero.py runs it at full size and compares it with real 2-rank gloo runs.

The task: noisy teacher-student classification. A fixed random teacher MLP gives every input
a softmax over 10 classes; each training label is *sampled* from it, so the best expected
loss is known exactly: H*, the mean entropy of the teacher's softmax over the held-out inputs
(evaluated on their teacher probabilities, not on sampled labels). Labels this noisy make the
gradient noisy, the regime in which a larger global batch (data parallelism) pays.

Arms (2 ranks; rank 1 is the slow one; every arm's learning rate is its own):
- ``alone``: rank 0 by itself, batch B;
- ``ddp``: one step per batch pair (global batch 2B): the step waits for the slow rank;
- ``ddp-prop``: DDP with speed-proportional batches (the fast rank takes ~2Bk/(k+1) of the
  2B samples): the same updates as ``ddp``, steps as long as the busier rank's share;
- ``local``: post-local SGD (torch's PeriodicModelAverager): every rank runs ``period`` local
  steps, then the models are averaged equally; the fast rank waits at each average;
- ``sync``: ElChe sync mode: DDP's updates (the gradients are averaged before each step),
  plus the small COUNT collective of its round after every batch;
- ``cadence``: ElChe cadence: the slowest rank runs ``anchor`` batches per window, the fast
  one as many as it can in that time (muster.train.schedule with these timings), then a
  realized-work average (muster.train.mass shares, n**gamma).

Optimizer AdamW (weight decay 0), learning rate warmed up over the first 2% of the sample
budget, then cosine to a tenth, driven by the samples the cohort has processed (not by local
steps), so arms that see samples at different rates decay alike.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muster.train.mass import gamma_shares
from muster.train.schedule import ElCheSchedule, WindowReport

CLASSES = 10


@dataclass(frozen=True)
class Task:
    inputs: int = 32
    hidden: int = 64  # the student's width (two hidden layers)
    samples: int = 2**13
    held: int = 2048
    temperature: float = 1.0  # the teacher's logits are divided by it: label noise
    budget_epochs: float = 8.0  # the sample budget the learning-rate schedule spans
    batch: int = 64  # per rank


SIZES = {
    # seconds: the CI test
    "ci": Task(samples=2**14, budget_epochs=2, batch=16),
    # minutes: what bench/README.md records
    "quick": Task(hidden=128, samples=2**16, budget_epochs=2, batch=16),
    # compute-bound enough for the real 2-rank layer (a few ms a batch on one core)
    "mid": Task(inputs=64, hidden=512, samples=2**15, budget_epochs=2, batch=64),
    # the size (~0.5M parameters, 2^18 samples): hours on a 2-core machine
    "full": Task(inputs=64, hidden=640, samples=2**18, held=4096, batch=128, budget_epochs=3),
}


@dataclass
class Data:
    x: torch.Tensor
    y: torch.Tensor
    held_x: torch.Tensor
    held_p: torch.Tensor  # the teacher's probabilities on the held-out inputs
    h_star: float


def make_data(task: Task, seed: int = 0) -> Data:
    """The teacher is fixed (seed 1000); ``seed`` draws the inputs and the sampled labels."""
    teacher_gen = torch.Generator().manual_seed(1000)
    w1 = torch.randn(task.inputs, 64, generator=teacher_gen) / math.sqrt(task.inputs)
    w2 = torch.randn(64, CLASSES, generator=teacher_gen) * 2.0 / math.sqrt(64)

    def probs(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(torch.tanh(x @ w1) @ w2 / task.temperature, dim=1)

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(task.samples, task.inputs, generator=gen)
    y = torch.multinomial(probs(x), 1, generator=gen).squeeze(1)
    held_x = torch.randn(task.held, task.inputs, generator=torch.Generator().manual_seed(999))
    held_p = probs(held_x)
    h_star = float(-(held_p * held_p.clamp_min(1e-12).log()).sum(1).mean())
    return Data(x, y, held_x, held_p, h_star)


def new_model(task: Task, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(task.inputs, task.hidden),
        nn.ReLU(),
        nn.Linear(task.hidden, task.hidden),
        nn.ReLU(),
        nn.Linear(task.hidden, CLASSES),
    )


def held_loss(model: nn.Module, data: Data) -> float:
    """Cross-entropy against the teacher's probabilities: H* is its floor."""
    with torch.no_grad():
        logp = torch.log_softmax(model(data.held_x), dim=1)
        return float(-(data.held_p * logp).sum(1).mean())


@dataclass(frozen=True)
class Costs:
    """The virtual clock: ms per fast-rank batch of B samples, the slowdown, the all-reduce.
    With ``k_alt`` the slowdown switches between ``k`` and ``k_alt`` every ``switch_ms``."""

    batch_ms: float = 10.0
    k: float = 1.0
    alpha_ms: float = 0.5
    ms_per_mb: float = 1.0  # all-reduce: 1 GB/s
    k_alt: float | None = None
    switch_ms: float = 0.0

    def k_at(self, clock: float) -> float:
        if self.k_alt is None or self.switch_ms <= 0:
            return self.k
        return self.k if int(clock // self.switch_ms) % 2 == 0 else self.k_alt

    @property
    def mean_k(self) -> float:
        """The effective slowdown: the slow rank's mean speed is 1/mean_k of the fast one's
        (for a switching slowdown, the harmonic mean of the two: half the time at each)."""
        return self.k if self.k_alt is None else 2 / (1 / self.k + 1 / self.k_alt)


@dataclass(frozen=True)
class Arm:
    name: str  # alone, ddp, ddp-prop, local, sync, cadence
    lr: float
    period: int = 8  # local: steps between averages; cadence: the anchor's batches
    gamma: float = 1.0  # cadence only

    @property
    def label(self) -> str:
        if self.name == "cadence":
            return f"cadence g{self.gamma:g}"
        return self.name


@dataclass
class Curve:
    """Held-out loss against virtual time and samples, at every average (or every few steps)."""

    arm: Arm
    points: list[tuple[float, int, float]] = field(default_factory=list)  # ms, samples, loss

    def first_below(self, target: float, by: str = "time") -> float | None:
        """Time (or samples) of the first evaluated point at or below ``target``. Not
        interpolated: an arm that averages every window has a consensus model only at its
        windows' ends, and must not be credited with part of a window it has not finished."""
        at = 0 if by == "time" else 1
        for point in self.points:
            if point[2] <= target:
                return float(point[at])
        return None


class Stream:
    """Disjoint batches from shuffled epochs (the same order for every arm of a seed)."""

    def __init__(self, samples: int, seed: int) -> None:
        self.samples, self.seed = samples, seed
        self.epoch, self.cursor = 0, 0
        self.order = self._shuffle()

    def _shuffle(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
        return torch.randperm(self.samples, generator=gen)

    def take(self, n: int) -> torch.Tensor:
        if self.cursor + n > self.samples:
            self.epoch += 1
            self.cursor = 0
            self.order = self._shuffle()
        out = self.order[self.cursor : self.cursor + n]
        self.cursor += n
        return out


def _lr(arm: Arm, task: Task, seen: float) -> float:
    budget = task.budget_epochs * task.samples
    warm = 0.02 * budget
    if seen < warm:
        return arm.lr * (0.1 + 0.9 * seen / warm)
    progress = min(1.0, (seen - warm) / max(1.0, budget - warm))
    return arm.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _step(
    model: nn.Module, opt: torch.optim.Optimizer, data: Data, idx: torch.Tensor, lr: float
) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(data.x[idx]), data.y[idx])
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()


def _average(models: list[nn.Module], shares: list[float]) -> None:
    with torch.no_grad():
        for tensors in zip(*(m.parameters() for m in models), strict=True):
            mean = sum(w * t for w, t in zip(shares, tensors, strict=True))
            for t in tensors:
                t.copy_(mean)  # type: ignore[arg-type]


def allreduce_ms(model: nn.Module, costs: Costs) -> float:
    mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return costs.alpha_ms + costs.ms_per_mb * mb


def run(
    arm: Arm,
    task: Task,
    data: Data,
    costs: Costs,
    seed: int,
    stop_at: float | None = None,
    eval_every_ms: float = 0.0,
) -> Curve:
    """Train ``arm`` until the sample budget is spent or the held-out loss reaches
    ``stop_at``; returns its curve against virtual time."""
    budget = task.budget_epochs * task.samples
    b = task.batch
    stream = Stream(task.samples, seed)
    curve = Curve(arm)
    ranks = 1 if arm.name in ("alone", "ddp", "ddp-prop", "sync") else 2
    models = [new_model(task, seed) for _ in range(ranks)]
    opts = [torch.optim.AdamW(m.parameters(), lr=arm.lr, weight_decay=0.0) for m in models]
    ar = allreduce_ms(models[0], costs)
    clock, seen = 0.0, 0
    last_eval = -math.inf
    curve.points.append((0.0, 0, held_loss(models[0], data)))

    def record(force: bool = False) -> bool:
        nonlocal last_eval
        if not force and clock - last_eval < eval_every_ms:
            return False
        last_eval = clock
        loss = held_loss(models[0], data)
        curve.points.append((clock, seen, loss))
        return stop_at is not None and loss <= stop_at

    c = costs.batch_ms
    # Proportional batches are set once, for the mean slowdown (a static split).
    fast = round(2 * b * costs.mean_k / (costs.mean_k + 1))
    schedule = ElCheSchedule(2, anchor_batches=arm.period) if arm.name == "cadence" else None
    while seen < budget:
        k = costs.k_at(clock)
        if arm.name == "alone":
            _step(models[0], opts[0], data, stream.take(b), _lr(arm, task, seen))
            clock += c
            seen += b
        elif arm.name in ("ddp", "ddp-prop", "sync"):
            # Two ranks' mean gradient over 2B samples is one step on the 2B samples (ElChe's
            # sync mode averages the gradients before the step, as DDP does).
            _step(models[0], opts[0], data, stream.take(2 * b), _lr(arm, task, seen))
            if arm.name == "ddp-prop":
                clock += max(c * fast / b, k * c * (2 * b - fast) / b) + ar
            else:
                clock += k * c + ar
            if arm.name == "sync":
                clock += costs.alpha_ms  # (its round after each batch sends COUNT)
            seen += 2 * b
        elif arm.name == "local":
            lr = _lr(arm, task, seen)
            for _ in range(arm.period):
                for m, o in zip(models, opts, strict=True):
                    _step(m, o, data, stream.take(b), lr)
            _average(models, [0.5, 0.5])
            clock += arm.period * k * c + ar
            seen += arm.period * 2 * b
            if record(force=True):
                break
            continue
        else:  # cadence
            assert schedule is not None
            counts = schedule.batch_counts()
            lr = _lr(arm, task, seen)
            for m, o, n in zip(models, opts, counts, strict=True):
                for _ in range(n):
                    _step(m, o, data, stream.take(b), lr)
            _average(models, gamma_shares(counts, arm.gamma))
            times = [c, k * c]
            clock += max(n * t for n, t in zip(counts, times, strict=True)) + ar + costs.alpha_ms
            seen += sum(counts) * b
            schedule.record(
                [WindowReport([t] * n, [t] * n) for n, t in zip(counts, times, strict=True)]
            )
            if record(force=True):
                break
            continue
        if record():
            break
    record(force=True)
    return curve


def tune(
    arm: Arm,
    lrs: list[float],
    target: Callable[[Data], float],
    task: Task,
    costs: Costs,
    seeds: list[int],
    periods: list[int] | None = None,
    eval_every_ms: float = 0.0,
) -> tuple[Arm, float]:
    """The learning rate (and period) with the least median time to ``target`` on ``seeds``;
    returns the tuned arm and that time (inf when no setting reached it)."""
    best, best_time = arm, math.inf
    for lr in lrs:
        for period in periods or [arm.period]:
            trial = replace(arm, lr=lr, period=period)
            times = []
            for seed in seeds:
                data = make_data(task, seed)
                curve = run(
                    trial,
                    task,
                    data,
                    costs,
                    seed,
                    stop_at=target(data),
                    eval_every_ms=eval_every_ms,
                )
                reached = curve.first_below(target(data))
                times.append(math.inf if reached is None else reached)
            median = statistics.median(times)
            if median < best_time:
                best, best_time = trial, median
    if not math.isfinite(best_time):
        print(f"  warning: no setting of {arm.label} reached the target; kept {arm.lr:g}")
    elif best.lr in (min(lrs), max(lrs)):
        print(f"  warning: {arm.label}'s best learning rate {best.lr:g} is at the grid's edge")
    return best, best_time
