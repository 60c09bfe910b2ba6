"""ElChe: data parallel training that keeps fast and slow ranks all busy (seed 002).

Plain DDP holds every rank to the slowest one: a rank twice as fast idles half the time at the
gradient all_reduce. ElChe instead gives each rank its own number of batches per *window*,
proportional to its measured speed, and averages the models at the end of the window, each
rank weighted by the work it realized (``n ** gamma`` batches). Under ``torchrun``::

    dist.init_process_group("gloo")            # or "nccl"
    elche = ElChe(model, optimizer, dataset_size=len(data), batch_size=64, mode="cadence")
    for epoch in range(epochs):
        for x, y in elche.epoch(epoch, fetch=lambda idx: (data.x[idx], data.y[idx])):
            elche.step(loss_fn(model(x), y))   # zero_grad, backward, optimizer.step

Modes:
- ``sync``: DDP's algorithm: one batch per rank, and ``step`` runs the round itself: it
  checks the cohort (COUNT), all-reduces the gradients (their mean) before the optimizer
  steps, so every rank makes DDP's update whatever the optimizer (momentum, Adam) and the
  models never drift apart, and averages floating-point buffers. An epoch's last batches that
  would leave a rank without one wait for the next epoch (``DistributedSampler(drop_last=
  True)``). Every rank calls ``step`` once for every batch (a rank that skips it leaves
  the others waiting in the gradient all-reduce, as under DDP); a loop that steps by hand
  on every rank (its own backward and optimizer step) is averaged by parameters after each
  batch instead;
- ``cadence``: the ElChe schedule: the slowest rank runs ``anchor_batches`` per window, faster
  ranks range ahead in proportion to their delivered per-batch cost;
- ``async`` (cadence without the window barrier) needs the CPU star backend, which is not
  built yet; it is refused with that reason.

No controller is needed: at each round every rank adds its window timings to the round's
first collective, so every rank computes the same next counts, and the same dealing of the
epoch's samples (``WindowSampler``). A window never exceeds what is left of the epoch, so
every epoch ends on a round and every rank holds the same model there.

Every rank must run the same loop: leaving it early on one rank (``break``) makes every rank
raise CohortDiverged at the next round (nothing of it is averaged).

The weight of unequal work, ``gamma`` (default 0.5). At a round each rank's model counts with
``n ** gamma`` for the ``n`` batches it ran. Think of a rank's model as the window's start plus
a drift that grows with n and a noise that grows with sqrt(n). Weighing by work (gamma 1)
maximizes the drift kept, but leans on one model and keeps its noise; equal weights (gamma 0)
average the noise down best but throw away the fast rank's extra steps. 0.5 sits between, and
it is what the benchmark's replay measures best once each arm's learning rate is tuned (bench/
README.md, `bench/train_hetero.py`): on the noisy teacher-student task, with the slow rank 4x
slower, cadence reaches the target at phi 0.96 with gamma 0.5 against 0.67 with gamma 1 (phi:
0 is as good as dropping the slow rank, 1 is its work fully used) and at 1.01x the speed of
proportional-batch DDP; at 2x the two are equal (phi 0.92); when the slowdown moves, 0.5 is
among the best. tests/train/test_replay.py pins it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, overload

import torch
import torch.distributed as dist
from torch import nn

from muster.errors import UserError
from muster.train import flight
from muster.train.collective import (
    RoundResult,
    Trace,
    average_round,
    debug_trace,
    sync_step,
)
from muster.train.mass import MAX_GAMMA
from muster.train.sampler import WindowSampler
from muster.train.schedule import ElCheSchedule, WindowReport, WindowSummary

Mode = Literal["sync", "cadence", "async"]
MODES = ("sync", "cadence", "async")
T = TypeVar("T")

# Per-rank slots in the timing exchange that rides the COUNT collective (the batches and
# the window number travel in COUNT's own slots).
_SLOTS = 4  # marginal ms, has marginal, fill excess ms, compute ms

log = logging.getLogger("muster.train")


class AverageBackend(Protocol):
    """How a round averages the model: the collective backend today, the CPU star later."""

    def round(
        self, model: nn.Module, batches: int, gamma: float, side: torch.Tensor, window: int
    ) -> RoundResult: ...

    def step(
        self, model: nn.Module, step: Callable[[], Any], side: torch.Tensor, window: int
    ) -> RoundResult: ...


@dataclass(frozen=True)
class CollectiveBackend:
    """all_reduce over torch.distributed (gloo or NCCL): every round paces the window."""

    group: Any = None
    trace: Trace | None = None

    def round(
        self, model: nn.Module, batches: int, gamma: float, side: torch.Tensor, window: int
    ) -> RoundResult:
        return average_round(
            model, batches, gamma, self.group, side, window=window, trace=self.trace
        )

    def step(
        self, model: nn.Module, step: Callable[[], Any], side: torch.Tensor, window: int
    ) -> RoundResult:
        return sync_step(model, step, self.group, side, window=window, trace=self.trace)


class Stopwatch:
    """One window's per-batch times, in ms: delivered (from the end of the previous batch, or
    the window's start, to the end of this one) and compute (from the batch being handed over
    to its end).

    On a GPU the host runs ahead of the device (kernel launches return at once), so the host
    clock would time the launches, not the work: there the points are CUDA events on the
    current stream, read once at the end of the window.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start = self._point()
        self.readies: list[Any] = []
        self.dones: list[Any] = []

    def _point(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def ready(self) -> None:
        self.readies.append(self._point())

    def done(self) -> None:
        self.dones.append(self._point())

    def _ms(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) if self.cuda else (b - a) * 1e3

    def report(self) -> WindowReport:
        if self.cuda and self.dones:
            self.dones[-1].synchronize()
        delivered, compute = [], []
        previous = self.start
        for ready, done in zip(self.readies, self.dones, strict=True):
            delivered.append(self._ms(previous, done))
            compute.append(self._ms(ready, done))
            previous = done
        return WindowReport(delivered, compute)


class ElChe:
    """Heterogeneity-aware data parallel training over an initialized process group."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        dataset_size: int,
        batch_size: int,
        mode: Mode = "cadence",
        gamma: float = 0.5,
        anchor_batches: int = 8,
        history: int = 4,
        seed: int = 0,
        shuffle: bool = True,
        backend: str = "collective",
        group: Any = None,
    ) -> None:
        if mode not in MODES:
            raise UserError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if mode == "async":
            raise UserError(
                "mode='async' needs the CPU star backend, which muster does not ship yet: "
                "a collective round is itself a barrier. Use mode='cadence'"
            )
        if backend != "collective":
            raise UserError(f"backend must be 'collective' (the only one built); got {backend!r}")
        if not math.isfinite(gamma) or not 0.0 <= gamma <= MAX_GAMMA:
            raise UserError(
                f"gamma must be between 0 (every rank that worked weighs the same) and "
                f"{MAX_GAMMA:g} (n**gamma: the fastest rank all but alone); got {gamma!r}"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise UserError(
                "ElChe needs a process group: call torch.distributed.init_process_group() "
                "first, and start the script with torchrun (or muster)"
            )
        flight.serve()  # `muster stacks` reads its collectives, where the job records them
        owned = {id(p) for p in model.parameters()}
        for param_group in optimizer.param_groups:
            if any(id(p) not in owned for p in param_group["params"]):
                raise UserError("the optimizer holds parameters that are not the model's")
        self.model = model
        self.optimizer = optimizer
        self.mode: Mode = mode
        self.gamma = float(gamma)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend: AverageBackend = CollectiveBackend(group, debug_trace(self.rank))
        self.device = next(model.parameters()).device
        self.sampler = WindowSampler(
            dataset_size, batch_size, rank=self.rank, world=self.world, seed=seed, shuffle=shuffle
        )
        self.schedule = ElCheSchedule(self.world, anchor_batches=anchor_batches, history=history)
        self.window = 0  # windows completed (= averaging rounds run)
        self.counts: list[int] = []  # batch counts of the current (or last) window, per rank
        self.batches_run = 0  # batches this rank ran, all epochs
        self.round_ms = 0.0  # time spent in rounds: waiting for the cohort plus the collectives
        self.last_round: RoundResult | None = None
        self._round_done = False  # sync: this window's round ran inside ``step``
        self._broadcast_initial_state()

    def _broadcast_initial_state(self) -> None:
        """Start every rank from rank 0's model, as DDP does."""
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(tensor.data, src=source, group=self.group)

    def _plan(self, left: int) -> list[int]:
        if self.mode == "sync":
            return [1] * self.world
        return self.schedule.batch_counts(epoch_remaining=left)

    @overload
    def epoch(self, epoch: int, fetch: None = None) -> Iterator[torch.Tensor]: ...
    @overload
    def epoch(self, epoch: int, fetch: Callable[[torch.Tensor], T]) -> Iterator[T]: ...

    def epoch(
        self, epoch: int, fetch: Callable[[torch.Tensor], Any] | None = None
    ) -> Iterator[Any]:
        """This rank's batches of ``epoch``: index tensors, or what ``fetch(indices)`` returns.

        Each yielded batch is timed until the loop asks for the next one; the time ``fetch``
        takes counts as delivered cost, not compute. Rounds run between windows.
        """
        self.sampler.start_epoch(epoch)
        finished = False
        least = self.world if self.mode == "sync" else 1  # (sync: a batch for every rank)
        try:
            while (left := self.sampler.remaining_batches) >= least:
                self.counts = self._plan(left)
                mine = self.sampler.deal(self.counts)
                watch = Stopwatch(self.device)
                self._round_done = False
                for indices in mine:
                    item = fetch(indices) if fetch is not None else indices
                    watch.ready()
                    yield item
                    watch.done()
                    self.batches_run += 1
                self._round(watch.report().summary())
            finished = True
        finally:
            if not finished:
                # Left mid-window (a break, an exception) without its round: this rank's next
                # round must not pass for the one its peers are waiting in. A window number
                # past theirs makes every rank raise CohortDiverged there instead. (In sync
                # mode the round may have run in ``step`` already: then one more.)
                self.window += 2 if self._round_done else 1

    def step(self, loss: torch.Tensor) -> None:
        """The usual step: zero the gradients, backpropagate ``loss``, step the optimizer (in
        sync mode, on the cohort's mean gradient: every rank must call it for every batch)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        if self.mode != "sync":
            self.optimizer.step()
            return
        if self._round_done:
            raise UserError(
                "ElChe.step ran twice for one batch: in sync mode call it once per batch "
                "(accumulate gradients yourself and step by hand, on every rank, instead)"
            )
        started = time.perf_counter()
        side = torch.zeros(self.world * _SLOTS, dtype=torch.float64)  # (COUNT's shape)
        self.last_round = self.backend.step(self.model, self.optimizer.step, side, self.window)
        self.round_ms += (time.perf_counter() - started) * 1e3
        self._round_done = True

    def _round(self, mine: WindowSummary) -> None:
        if self._round_done:  # (sync: it ran in ``step``)
            self.window += 1
            return
        side = torch.zeros(self.world * _SLOTS, dtype=torch.float64)
        base = self.rank * _SLOTS
        side[base : base + _SLOTS] = torch.tensor(
            [
                mine.marginal_ms or 0.0,
                1.0 if mine.marginal_ms is not None else 0.0,
                mine.fill_excess_ms,
                mine.compute_rate_ms or 0.0,
            ],
            dtype=torch.float64,
        )
        started = time.perf_counter()
        # (CohortDiverged, raised on every rank, when a rank is at another window)
        result = self.backend.round(self.model, mine.batches, self.gamma, side, self.window)
        self.last_round = result
        self.round_ms += (time.perf_counter() - started) * 1e3
        rows = side.view(self.world, _SLOTS).tolist()
        reports = [
            WindowSummary(
                batches=n,
                marginal_ms=row[0] if row[1] else None,
                fill_excess_ms=row[2],
                compute_rate_ms=row[3] if n > 0 else None,
            )
            for n, row in zip(result.counts, rows, strict=True)
        ]
        if result.divergence is not None:
            d = result.divergence
            log.info(
                "rank %d window %d: counts %s, weight %.3f, distance from consensus %.4g "
                "(norm %.4g -> %.4g)",
                self.rank,
                self.window,
                list(result.counts),
                result.weight,
                d.distance,
                d.norm_before,
                d.norm_after,
            )
        if self.mode == "cadence":
            self.schedule.record(reports)
        self.window += 1
