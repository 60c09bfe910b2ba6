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
- ``async`` (star backend only): cadence without the window barrier. At a window's end the
  rank hands its snapshot to the star and trains on; the consensus, when it lands, is applied
  as a delta (the rank keeps what it learned since the snapshot). ``lookahead`` (default 1)
  bounds how many rounds may be in flight: a rank waits for round ``w - lookahead`` before it
  sends round ``w``. Every rank plans window ``w`` from the timings of rounds up to
  ``w - 1 - lookahead`` only, which every rank has applied by then, so all deal the same
  samples. An epoch's last round is sent once every earlier one is applied, and the epoch's
  end waits for it, so the epoch ends on one model.

Backends (``backend=``):
- ``"collective"`` (default): all_reduce on the process group (gloo, NCCL): every round is a
  barrier. A peer lost mid-collective: with 3 ranks or more on the default group, the
  survivors re-form a smaller group (5 s per leader candidate; a majority of the last cohort
  needed) and go on, the lost rank counted as idle (``muster.train.reform``; gloo only;
  ``reform=False`` turns it off); otherwise the cohort stops with a save, as it does when
  a collective waits ``stall_s`` for a rank that is alive but never comes (gloo);
- ``"star"``: the CPU star (``muster.train.star``): each rank's contribution goes through its
  host's fold to rank 0's root over TCP, so ranks need no common collective library, a dead
  rank leaves the sum and the divisor (the rest go on), and every wait has a ceiling
  (``heartbeat_s``, ``timeout_s``, ``stall_s``). ``bf16_wire=True`` halves the bytes.

Stopping with a save (``save=PREFIX``; under muster it defaults to ``$MUSTER_OUTPUT_DIR/
elche``): when the cohort must stop (the star's stall ceiling, a peer lost in a collective,
``elche.save()`` by hand) every rank writes ``PREFIX.rank<N>.pt`` and ``.meta.json`` with the
reason, and ``CohortStopped`` is raised; a rank that dies writes ``PREFIX.rank<N>.death.json``.
``ElChe(..., resume=PREFIX)`` continues where the save left off (``elche.start_epoch`` is
the epoch to loop from): a round-boundary save resumes to the same model as a run that never
stopped.

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

import contextlib
import logging
import math
import os
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, overload

import torch
import torch.distributed as dist
from torch import nn

from muster.errors import CohortLost, CohortStopped, UserError
from muster.train import checkpoint, flight
from muster.train.collective import RoundResult, Seat, debug_trace
from muster.train.mass import MAX_GAMMA
from muster.train.reform import CollectiveBackend, peer_lost
from muster.train.reformwire import Reformer
from muster.train.sampler import WindowSampler
from muster.train.schedule import ElCheSchedule, WindowReport, WindowSummary, cap_counts
from muster.train.star import AsyncRound, StarBackend
from muster.train.starhub import Ceilings

Mode = Literal["sync", "cadence", "async"]
MODES = ("sync", "cadence", "async")
BACKENDS = ("collective", "star")
T = TypeVar("T")

# Per-rank slots in the timing exchange that rides the COUNT collective (the batches and
# the window number travel in COUNT's own slots).
_SLOTS = 4  # marginal ms, has marginal, fill excess ms, compute ms

log = logging.getLogger("muster.train")


class AverageBackend(Protocol):
    """How a round averages the model: CollectiveBackend, or the CPU star (muster.train.star)."""

    def round(
        self, model: nn.Module, batches: int, gamma: float, side: torch.Tensor, window: int
    ) -> RoundResult: ...

    def step(
        self, model: nn.Module, step: Callable[[], Any], side: torch.Tensor, window: int
    ) -> RoundResult: ...


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
        lookahead: int = 1,
        bf16_wire: bool = False,
        heartbeat_s: float = 5.0,
        timeout_s: float = 30.0,
        stall_s: float | None = None,
        save: str | Path | None = None,
        resume: str | Path | None = None,
        hosts: list[int] | None = None,
        reform: bool = True,
    ) -> None:
        if mode not in MODES:
            raise UserError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if backend not in BACKENDS:
            raise UserError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
        if mode == "async" and backend != "star":
            raise UserError(
                "mode='async' needs backend='star': a collective round is itself a barrier "
                "(every rank waits in it), so there is nothing to run ahead of. Use "
                "backend='star', or mode='cadence'"
            )
        if not 1 <= lookahead <= 8:
            raise UserError(f"lookahead must be between 1 and 8 rounds; got {lookahead!r}")
        if not 0 < heartbeat_s < timeout_s:
            raise UserError(
                f"heartbeat_s ({heartbeat_s}) must be above 0 and below timeout_s ({timeout_s})"
            )
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
        self.lookahead = lookahead
        self.backend_name = backend
        self.device = next(model.parameters()).device
        if save is None and os.environ.get("MUSTER_OUTPUT_DIR"):
            save = Path(os.environ["MUSTER_OUTPUT_DIR"]) / "elche"
        self.save_prefix = Path(save) if save is not None else None
        self.star: StarBackend | None = None
        self.collective: CollectiveBackend | None = None
        if backend == "star":
            ceilings = Ceilings(heartbeat_s, timeout_s, stall_s)
            self.star = StarBackend(model, group, ceilings=ceilings, bf16_wire=bf16_wire,
                                    hosts=hosts)  # fmt: skip
            self.backend: AverageBackend = self.star
        else:
            wait_s = stall_s if stall_s is not None else max(10 * timeout_s, 300.0)
            self.collective = CollectiveBackend(group, debug_trace(self.rank),
                                                optimizer=optimizer, stall_s=wait_s)  # fmt: skip
            if reform and group is None and self.world >= 3 and dist.get_backend() == "gloo":
                # (gloo only: NCCL's half, an abort and new communicators, has not been run
                # on GPUs yet; there a lost peer stops the cohort with a save)
                seat = Seat(self.rank, self.world, tuple(range(self.world)))
                reformer = Reformer(seat, str(dist.get_backend()), wait_s)
                if reformer.usable:  # (the same answer on every rank: from one gather)
                    self.collective.seat = seat
                    self.collective.reformer = reformer
                else:
                    reformer.close()
            self.backend = self.collective
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
        self.alive = set(range(self.world))  # ranks the cohort still counts (the star's dead leave)
        self.window_batches = 0  # batches run in the current window, not yet averaged
        self.start_epoch = 0  # the epoch to loop from (after a resume, the saved one)
        self._resume_cursor: int | None = None
        self._inflight: deque[AsyncRound] = deque()  # async: rounds sent, not yet applied
        self._due: list[tuple[int, list[WindowSummary], set[int]]] = []  # async, to record
        self._stopping: str | None = None
        self._closed = False
        if resume is not None:
            self._resume(Path(resume))
        else:
            self._broadcast_initial_state()
        if self.save_prefix is not None:
            _watch_for_death(self)

    def _broadcast_initial_state(self) -> None:
        """Start every rank from rank 0's model, as DDP does."""
        if self.star is not None:
            self.star.start(self.model)
            return
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(tensor.data, src=source, group=self.group)

    def _plan(self, left: int) -> list[int]:
        if self.mode == "sync":
            return [1 if r in self.alive else 0 for r in range(self.world)]
        if self.mode == "async":  # (only rounds every rank has applied by now: see above)
            settled = self.window - 1 - self.lookahead
            while self._due and self._due[0][0] <= settled:
                _, reports, alive = self._due.pop(0)
                self.schedule.record(reports)
                self.alive = alive
        counts = self.schedule.batch_counts()
        counts = [c if r in self.alive else 0 for r, c in enumerate(counts)]
        return cap_counts(counts, max(0, left))

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
        cursor, self._resume_cursor = self._resume_cursor, None
        self.sampler.start_epoch(epoch)
        if cursor is not None:
            self.sampler._cursor = cursor  # (resumed mid-epoch: the samples dealt stay dealt)
        finished = False
        failure: BaseException | None = None
        try:
            while (left := self.sampler.remaining_batches) >= self._least():
                self.counts = self._plan(left)
                if sum(self.counts) == 0:
                    break
                mine = self.sampler.deal(self.counts)
                watch = Stopwatch(self.device)
                self._round_done = False
                self.window_batches = 0
                for indices in mine:
                    self._poll()
                    item = fetch(indices) if fetch is not None else indices
                    watch.ready()
                    yield item
                    watch.done()
                    self.batches_run += 1
                    self.window_batches += 1
                # (the epoch's last window: async sends its round on every round applied)
                self._round(watch.report().summary(),
                            last=self.sampler.remaining_batches < self._least())  # fmt: skip
            self._drain()
            finished = True
        except GeneratorExit:
            raise
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if not finished:
                # Left mid-window (a break, an exception) without its round: this rank's next
                # round must not pass for the one its peers are waiting in. A window number
                # past theirs makes every rank raise CohortDiverged there instead. (In sync
                # mode the round may have run in ``step`` already: then one more.)
                self.window += 2 if self._round_done else 1
            if failure is not None:
                self._died(failure)

    def _least(self) -> int:
        """Batches an epoch needs left for one more window (sync: one per live rank)."""
        return len(self.alive) if self.mode == "sync" else 1

    def step(self, loss: torch.Tensor) -> None:
        """The usual step: zero the gradients, backpropagate ``loss``, step the optimizer (in
        sync mode, on the cohort's mean gradient: every rank must call it for every batch)."""
        self._check_stop()
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
        self.last_round = self._guarded(
            lambda: self.backend.step(self.model, self.optimizer.step, side, self.window)
        )
        self.round_ms += (time.perf_counter() - started) * 1e3
        self._round_done = True
        self.window_batches = 0  # (averaged: nothing of this window is pending any more)
        self._follow_members()

    def _side(self, mine: WindowSummary) -> torch.Tensor:
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
        return side

    def _reports(self, counts: tuple[int, ...], side: torch.Tensor) -> list[WindowSummary]:
        rows = side.view(self.world, _SLOTS).tolist()
        return [
            WindowSummary(
                batches=n,
                marginal_ms=row[0] if row[1] else None,
                fill_excess_ms=row[2],
                compute_rate_ms=row[3] if n > 0 else None,
            )
            for n, row in zip(counts, rows, strict=True)
        ]

    def _round(self, mine: WindowSummary, last: bool = False, record: bool = True) -> None:
        if self._round_done:  # (sync: it ran in ``step``)
            self.window += 1
            return
        side = self._side(mine)
        if self.mode == "async":
            assert self.star is not None
            # A round's snapshot holds every consensus applied before it is sent; the rounds
            # still in flight then are added as deltas, which differ by rank. So the epoch's
            # last round goes out with none in flight: applied, it leaves one model everywhere.
            while self._inflight and (last or len(self._inflight) >= self.lookahead):
                self._apply(self._inflight.popleft())
            self._inflight.append(
                self.star.begin(self.model, mine.batches, self.gamma, side, self.window)
            )
            self.window_batches = 0
            self.window += 1
            return
        started = time.perf_counter()
        # (CohortDiverged, raised on every rank, when a rank is at another window)
        result = self._guarded(
            lambda: self.backend.round(self.model, mine.batches, self.gamma, side, self.window)
        )
        self.window_batches = 0
        self.last_round = result
        self.round_ms += (time.perf_counter() - started) * 1e3
        self._follow_members()
        reports = self._reports(result.counts, side)
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
        if self.mode == "cadence" and record:
            self.schedule.record(reports)
        self.window += 1

    def _follow_members(self) -> None:
        """The ranks the cohort still counts: the star's live ones, or the re-formed group's."""
        if self.star is not None:
            self.alive = set(self.star.alive)
        elif self.collective is not None and self.collective.members is not None:
            if self.collective.hold == self.window + 1:
                return  # (the ranks ahead planned the next window with the old members)
            self.alive = set(self.collective.members)

    # -- async rounds (the star) ---------------------------------------------------------------

    def _poll(self) -> None:
        """Between batches: apply the rounds that have landed, in order (never waits)."""
        self._check_stop()
        while self._inflight and self._inflight[0].ready():
            self._apply(self._inflight.popleft())

    def _drain(self) -> None:
        """An epoch's end: every round in flight applied (the epoch ends on one model)."""
        while self._inflight:
            self._apply(self._inflight.popleft())

    def _apply(self, pending: AsyncRound) -> None:
        started = time.perf_counter()
        result = self._guarded(lambda: pending.apply(self.model))
        self.round_ms += (time.perf_counter() - started) * 1e3
        self.last_round = result
        self._due.append(
            (pending.window, self._reports(result.counts, pending.side), set(pending.alive))
        )

    # -- stopping, saving, resuming --------------------------------------------------------------

    def _guarded(self, run: Callable[[], T]) -> T:
        """Run a round; a cohort that must stop saves first (then CohortStopped goes on up)."""
        try:
            return run()
        except CohortStopped as exc:
            self._save_now(f"the cohort stopped: {exc}")
            raise
        except CohortLost:
            raise
        except RuntimeError as exc:
            if self.star is not None or not peer_lost(exc):
                raise  # (an OOM, an optimizer's own error: not a lost peer)
            # (gloo: "Connection closed by peer"; NCCL: a watchdog abort) A peer is gone and
            # this cohort cannot re-form (two ranks, a group of the caller's, reform=False:
            # muster.train.reform): stop with a save. A loss in the middle of PARAM or
            # BUFFER leaves this rank's tensors pre-scaled or partly summed: the save says
            # where it stopped, and the last round-boundary save is the one to resume from.
            why = "" if self.world >= 3 else " (a cohort of two cannot re-form: one is no majority)"
            reason = f"a peer was lost in a collective ({str(exc).splitlines()[0][:200]}){why}"
            self._save_now(reason)
            raise CohortStopped(reason) from exc

    def _check_stop(self) -> None:
        if self.star is None:
            return
        client = self.star.client
        if client.stopped is not None:
            self._save_now(f"the cohort stopped: {client.stopped}")
            raise CohortStopped(client.stopped)
        client.check()

    def _state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "elche": {
                "window": self.window,
                "epoch": self.sampler.epoch,
                "cursor": self.sampler._cursor,
                "batches_run": self.batches_run,
                "window_batches": self.window_batches,
                "alive": sorted(self.alive),
                "rings": {k: [list(r) for r in v] for k, v in self.schedule.rings.items()},
                "fill_excess_ms": list(self.schedule.fill_excess_ms),
                "scale": self.schedule.scale,
                "mode": self.mode,
                "world": self.world,
                "round_done": self._round_done,
            },
            "rng": torch.get_rng_state(),
        }

    def save(self, reason: str = "requested") -> Path | None:
        """Write this rank's checkpoint and metadata under the save prefix (every rank calls
        it at the same point of the loop to make a resumable set); None without a prefix."""
        if self.save_prefix is None:
            return None
        if self._stopping is None and self._inflight:
            self._drain()  # (async, by hand: the rounds in flight land first)
        where = {
            "reason": reason,
            "window": self.window,
            "epoch": self.sampler.epoch,
            "mode": self.mode,
            "backend": self.backend_name,
            "world": self.world,
            "pending_batches": self.window_batches,
            "alive": sorted(self.alive),
        }
        path = checkpoint.save(self.save_prefix, self.rank, self._state(), where)
        log.warning("rank %d saved %s (%s)", self.rank, path, reason)
        return path

    def _save_now(self, reason: str) -> None:
        if self._stopping is not None:
            return
        self._stopping = reason
        if self.save_prefix is None:
            log.warning("rank %d: %s; nothing saved (no save prefix: ElChe(save=...))",
                        self.rank, reason)  # fmt: skip
            return
        try:
            self.save(reason)
        except Exception:  # (the stop's own reason goes on up, not the save's failure)
            log.exception("rank %d: the save for %r failed", self.rank, reason)

    def _died(self, error: BaseException) -> None:
        if isinstance(error, CohortStopped) or self.save_prefix is None or self._closed:
            return
        if getattr(error, "_muster_death_written", False):
            return
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            reason = f"stopped by {type(error).__name__}"
        else:
            reason = f"{type(error).__name__} out of the training loop"
        where = {
            "window": self.window,
            "epoch": self.sampler.epoch,
            "batches_run": self.batches_run,
        }
        checkpoint.death(self.save_prefix, self.rank, reason, where, error)
        with contextlib.suppress(AttributeError, TypeError):
            error._muster_death_written = True  # type: ignore[attr-defined]

    def _resume(self, prefix: Path) -> None:
        state = checkpoint.load(prefix, self.rank)
        mine = state["elche"]
        if int(mine["world"]) != self.world or mine["mode"] != self.mode:
            raise UserError(
                f"the checkpoint at {prefix} was saved by {mine['world']} ranks in mode "
                f"{mine['mode']!r}; this run has {self.world} in {self.mode!r}: resume with "
                "the same world and mode"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        place = mine
        if self.mode == "async":
            # Async ranks are not paced by a barrier: a stop (or save() at one point of the
            # loop) finds them at different windows, with rounds in flight that no save holds.
            # The cohort resumes from the furthest rank's place (no sample it dealt is dealt
            # again; the others' last windows of dealt samples are skipped), and one round in
            # which every rank weighs the same makes one model of theirs.
            places: list[Any] = [None] * self.world
            keys = ("window", "epoch", "cursor", "alive", "rings", "fill_excess_ms", "scale")
            dist.all_gather_object(places, {k: mine[k] for k in keys}, group=self.group)
            place = max(places, key=lambda p: int(p["window"]))
        self.window = int(place["window"])
        self.batches_run = int(mine["batches_run"])
        self.alive = {int(r) for r in place["alive"]}
        for scale, rings in place["rings"].items():
            for ring, values in zip(self.schedule.rings[scale], rings, strict=True):
                ring.extend(values)
        self.schedule.fill_excess_ms = list(place["fill_excess_ms"])
        self.schedule.scale = place["scale"]
        self.start_epoch = max(0, int(place["epoch"]))
        self._resume_cursor = int(place["cursor"])
        if self.mode == "async":
            self.mode = "cadence"
            try:  # (its timings are none: the schedule does not record it)
                self._round(WindowSummary(1, None, 0.0, None), record=False)
            finally:
                self.mode = "async"
        elif self.mode != "sync" and not mine["round_done"]:
            # The saved window's round never ran (a stall, or a save mid-window): run it now,
            # each rank with the batches it had run (0 at a round boundary: then it is idle).
            self._round(
                WindowSummary(int(mine["window_batches"]), None, 0.0, None), record=False
            )  # (no timings: the schedule does not record it)

    def close(self) -> None:
        """Leave the cohort (the star's links and hubs); the process group stays the caller's.
        Rounds still in flight (async) are waited for first."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if self.star is not None:
            with contextlib.suppress(CohortStopped, CohortLost):
                self._drain()
            self.star.close()
        if self.collective is not None:
            self.collective.close()


_LIVE: weakref.WeakSet[ElChe] = weakref.WeakSet()


def _watch_for_death(elche: ElChe) -> None:
    """An exception the training loop's body raises never passes through ``epoch`` (the
    generator is only closed later): the interpreter's last hook writes the death record of
    every ElChe with a save prefix, then does what it did before."""
    _LIVE.add(elche)
    if getattr(sys.excepthook, "_muster_elche", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        for live in list(_LIVE):
            with contextlib.suppress(Exception):
                live._died(error)
        previous(kind, error, tb)

    hook._muster_elche = True  # type: ignore[attr-defined]
    sys.excepthook = hook
