"""The collective backend, and how its survivors re-form when a peer is lost (seed 002, view 7).

Under the collective backend every round is a set of all-reduces over one process group, and
a peer that dies takes the group with it: gloo raises "Connection closed by peer" on the
ranks that talk to it, NCCL's watchdog aborts. With three ranks or more, on the default
process group, the survivors then *re-form* instead of stopping:

1. The survivor that sees the loss calls every other member (``muster.train.reformwire``:
   an HMAC'd frame on a port each rank bound when the cohort formed). Each rank waits for
   its collectives in 200 ms slices, so a rank parked in one with a survivor wakes when
   called; the broken group is kept, not destroyed: once an optimizer exists torch holds it
   from elsewhere, and a destructor would wait for the lost peer anyway. A host that dies
   without a word fails no collective: a collective waited on for 30 s pings the members.
2. A survivor walks the members in rank order and takes as leader the first that answers a
   ping with the run's MAC, giving each candidate ``CANDIDATE_S`` (5 s): a dead process
   refuses at once, a dead host or a frozen process stays silent. Survivors that see the
   same ranks alive pick the same leader, the lowest live rank; if they do not (a rank
   dying meanwhile), the majority rule below keeps a split from training twice.
3. The leader hosts a ``TCPStore`` on its listening socket; each survivor registers there. The
   leader waits (at most ``wait_s``) until every member of the old cohort has registered or
   stopped answering, then names the new members: only a strict majority of the old cohort
   may go on, so two halves of a split network never both train; a minority stops with a
   save. A rank left out (it came too late) stops with a save as well.
4. The members build a new default process group (``init_process_group`` on that store), each
   keeping its *logical* rank: COUNT's slots, the shares and the sampler keep their meaning, a
   lost rank is a zero count, exactly as the star drops a dead rank.
5. The members exchange how far their round had got, and repair it (:func:`decide`). Each round
   ends with one more tiny all-reduce, DONE, so a rank past it knows every rank holds the
   round's whole result; the failure then leaves the survivors at most one round apart:
   - all in the same round, none with its result: each puts back its pre-round state (a host
     copy taken before the round) and the round runs again without the dead rank (cadence),
     or the step is skipped on every rank (sync: nobody stepped; the batch is lost);
   - all in the same round, some with its result (or, in sync mode, stepped): that rank's
     model (sync: and optimizer state) is broadcast to the rest: the round stands, dead
     rank's contribution included;
   - some one round ahead: the ranks behind hold the earlier round's result and go on; those
     ahead run their round again (cadence; the others meet them there) or skip the step (sync,
     and the ranks behind skip that step too).

A cohort of two cannot re-form (one survivor is not a majority), nor can a cohort on a group
the caller passed (``ElChe(group=...)``): both stop with a save, as does ``reform=False``.
The costs of re-forming being possible: one DONE per round, a host copy of the
floating-point parameters and buffers at each cadence round (of the buffers at each sync
step), with one ``cuda.synchronize`` for it when the model is on a GPU.

The rendezvous itself (the call and ping port, the leader's store) is
``muster.train.reformwire``; this module is the backend and the repair.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from muster.errors import CohortStopped
from muster.train.collective import (
    STAGES,
    Progress,
    RoundResult,
    Seat,
    Trace,
    _floating,
    average_round,
    sync_step,
)
from muster.train.mass import gamma_shares
from muster.train.reformwire import ABANDONED, CANDIDATE_S, Reformer

_SLICE = datetime.timedelta(milliseconds=200)  # a collective is waited for in these
_REFORMS_PER_ROUND = 4  # a round re-formed more often than this stops the cohort
_LIVENESS_S = 30.0  # a collective waited on this long pings the members (or stall_s / 4)

# What gloo and NCCL say when a peer is gone mid-collective (and a peer's call to re-form).
PEER_LOST = re.compile(
    r"Connection (closed|reset|refused)|Broken pipe|Read error|writev |No route to host"
    r"|[Uu]nreachable|[Tt]imed out|NCCL (error|communicator)|[Ww]atchdog"
    r"|re-forming the cohort|stopped answering"
)

log = logging.getLogger("muster.train")


def peer_lost(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and bool(PEER_LOST.search(str(error)))


@dataclass(frozen=True)
class Decision:
    """How one survivor repairs the round it was in (see the module's docstring)."""

    kind: str  # "keep", "adopt" (receive or send ``source``'s state), "redo", "void"
    source: int | None = None  # adopt: the logical rank whose state everyone takes
    void_next: bool = False  # sync: skip the next step too (the ranks ahead skipped it)
    behind: bool = False  # this rank finished the round some others are one past


def decide(reports: Sequence[dict[str, Any]], me: int, sync: bool) -> Decision:
    """The repair every survivor computes from the same reports ({rank, window, stage})."""
    windows = sorted({int(r["window"]) for r in reports})
    mine = next(r for r in reports if int(r["rank"]) == me)
    if len(windows) > 2 or windows[-1] - windows[0] > 1:
        raise CohortStopped(f"the survivors are in rounds {windows}, more than one apart")
    if len(windows) == 2:
        behind = [r for r in reports if int(r["window"]) == windows[0]]
        if any(r["stage"] != "closing" for r in behind):
            raise CohortStopped(
                "a survivor one round behind had not finished its round: the round ahead "
                "cannot have run"
            )
        if int(mine["window"]) == windows[0]:
            return Decision("keep", void_next=sync, behind=True)
        return Decision("void" if sync else "redo")
    stages = [str(r["stage"]) for r in reports]
    if all(s == "closing" for s in stages):
        return Decision("keep")
    ahead = ("stepped", "closing") if sync else ("closing",)
    if any(s in ahead for s in stages):
        best = max(STAGES.index(s) for s in stages)
        source = min(int(r["rank"]) for r in reports if STAGES.index(r["stage"]) == best)
        return Decision("adopt", source)
    return Decision("void" if sync else "redo")


@dataclass
class CollectiveBackend:
    """all_reduce over torch.distributed (gloo or NCCL): every round paces the window; with a
    ``reformer``, a lost peer re-forms the survivors (the module's docstring)."""

    group: Any = None
    trace: Trace | None = None
    seat: Seat | None = None
    reformer: Reformer | None = None
    optimizer: torch.optim.Optimizer | None = None
    stall_s: float | None = None  # a collective waited for longer stops the cohort
    reforms: list[dict[str, Any]] = field(default_factory=list)  # what each re-form did
    _copies: list[torch.Tensor] = field(default_factory=list)  # host copies, reused
    _void: int | None = None  # sync: the window whose step this rank skips (see decide)
    # A rank one round behind the others at a re-form plans the next window with the old
    # members, as the ranks ahead already did (their deal of it stands): that window's number.
    hold: int | None = None

    @property
    def members(self) -> tuple[int, ...] | None:
        return self.seat.members if self.seat is not None else None

    def round(
        self, model: nn.Module, batches: int, gamma: float, side: torch.Tensor, window: int
    ) -> RoundResult:
        if self.reformer is None:
            return average_round(model, batches, gamma, self.group, side, window=window,
                                 trace=self.trace, progress=self._progress())  # fmt: skip
        tensors = _floating([*model.parameters(), *model.buffers()])
        self._keep(tensors)
        given = side.clone()
        for _attempt in range(_REFORMS_PER_ROUND):
            progress = self._progress()
            try:
                return average_round(
                    model, batches, gamma, self.group, side,
                    window=window, trace=self.trace, seat=self.seat, progress=progress,
                )  # fmt: skip
            except CohortStopped:
                self._put_back(tensors)  # (a stall: the save holds the pre-round model)
                raise
            except RuntimeError as exc:
                if not peer_lost(exc):
                    raise
                lost = str(exc).splitlines()[0][:200]
            # (out of the except block: its traceback holds the broken group's sockets open)
            with self._repairing(lost, tensors):
                decision = self._reform(lost, window, progress, False)
                if decision.kind == "redo":
                    self._put_back(tensors)
                    side.copy_(given)
                    continue
                if decision.kind == "adopt":
                    self._adopt(decision.source, tensors, with_optimizer=False)
                return self._result(progress, gamma)
        self._put_back(tensors)
        raise CohortStopped(f"window {window}'s round was re-formed {_REFORMS_PER_ROUND} times")

    def step(
        self, model: nn.Module, step: Callable[[], Any], side: torch.Tensor, window: int
    ) -> RoundResult:
        if self.reformer is None:
            return sync_step(model, step, self.group, side, window=window, trace=self.trace,
                             progress=self._progress())  # fmt: skip
        assert self.seat is not None
        if self._void == window:  # (the ranks ahead skipped this step: so does this one)
            self._void = None
            return self._voided(model)
        buffers = _floating(model.buffers())
        self._keep(buffers)
        progress = self._progress()
        try:
            return sync_step(model, step, self.group, side, window=window, trace=self.trace,
                             seat=self.seat, progress=progress)  # fmt: skip
        except CohortStopped:
            self._put_back(buffers)
            raise
        except RuntimeError as exc:
            if not peer_lost(exc):
                raise
            lost = str(exc).splitlines()[0][:200]
        with self._repairing(lost, buffers):
            decision = self._reform(lost, window, progress, True)
            if decision.void_next:
                self._void = window + 1
            if decision.kind == "void":
                self._put_back(buffers)
                return self._voided(model)
            if decision.kind == "adopt":
                assert decision.source is not None
                if progress.stage == "stepped":
                    self._put_back(buffers)  # (its BUFFER was cut short: its own buffers go)
                every = _floating(model.parameters()) + list(buffers)
                self._keep(every)  # (a broadcast cut short puts all of it back, not a mix)
                buffers[:] = every  # (what _repairing puts back)
                self._adopt(decision.source, every, with_optimizer=True)
            counts = progress.counts or (0,) * self.seat.world
            n = len(self.seat.members)
            return RoundResult(True, progress.collectives, counts, 1.0 / n, n, None)

    def _voided(self, model: nn.Module) -> RoundResult:
        """A sync step no rank takes: the gradients go, the model stays."""
        assert self.seat is not None
        for param in model.parameters():
            param.grad = None
        return RoundResult(False, 0, (0,) * self.seat.world, 0.0, 0, None)

    @contextlib.contextmanager
    def _repairing(self, lost: str, kept: list[torch.Tensor]) -> Iterator[None]:
        """A re-form and its repair either finish, or leave this rank's pre-round tensors in
        place (for the save) and stop the cohort."""
        try:
            yield
        except CohortStopped as exc:
            self._put_back(kept)
            raise CohortStopped(f"a peer was lost in a collective ({lost}); {exc}") from exc
        except Exception as exc:
            self._put_back(kept)
            raise CohortStopped(
                f"a peer was lost in a collective ({lost}); the survivors' repair failed: "
                f"{str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}"
            ) from exc
        except BaseException:  # (Ctrl-C mid-rendezvous: the tensors still go back)
            self._put_back(kept)
            raise

    def _progress(self) -> Progress:
        # (on NCCL the collectives run as before: its work.wait(timeout) would make the CPU
        # wait for the GPU at every bucket, and its timeouts read differently; untested here)
        nccl = str(dist.get_backend(self.group)) == "nccl"
        return Progress(wait=None if nccl else self._wait, closes=self.reformer is not None)

    def _wait(self, work: Any) -> None:
        """Wait for a collective's work in slices: give up when a peer calls a re-form, and
        stop the cohort when it has waited ``stall_s`` (a rank alive but never coming: a lost
        one makes the collective fail instead). gloo only: on NCCL the watchdog is the
        ceiling."""
        started = checked = time.monotonic()
        while True:
            if self.reformer is not None and self.reformer.kicked:
                ABANDONED.append(work)  # (dropped, it would wait for the lost peer)
                raise RuntimeError("muster: a peer is re-forming the cohort (it lost a peer)")
            try:
                work.wait(_SLICE)
                return
            except RuntimeError as exc:
                if "Operation timed out" not in str(exc):
                    raise
            every = min(_LIVENESS_S, self.stall_s / 4) if self.stall_s else _LIVENESS_S
            if self.reformer is not None and time.monotonic() - checked > every:
                # A host that died without a word (no FIN, no RST) fails no collective: a
                # long wait asks every member for a sign of life.
                self._check_members(work)
                checked = time.monotonic()
            waited = time.monotonic() - started
            if self.stall_s is not None and waited > self.stall_s:
                raise CohortStopped(
                    f"a collective stalled: no answer in {waited:.0f} s (stall_s) while no "
                    "peer was lost: a rank is alive but not coming (wedged, or far slower)"
                )

    def _check_members(self, work: Any) -> None:
        assert self.reformer is not None
        assert self.seat is not None
        reformer = self.reformer
        others = [r for r in self.seat.members if r != self.seat.rank]
        with ThreadPoolExecutor(max_workers=min(16, max(1, len(others)))) as pool:
            heard = list(pool.map(lambda r: reformer.answers(r, CANDIDATE_S, kick=False),
                                  others))  # fmt: skip
        silent = [r for r, ok in zip(others, heard, strict=True) if not ok]
        if silent:
            ABANDONED.append(work)
            raise RuntimeError(f"muster: ranks {silent} stopped answering (a lost peer)")

    # -- the repair ----------------------------------------------------------------------------

    def _reform(self, lost: str, window: int, progress: Progress, sync: bool) -> Decision:
        assert self.reformer is not None
        assert self.seat is not None
        log.warning("rank %d: a peer was lost in window %d (%s, %s): re-forming",
                    self.seat.rank, window, progress.stage, lost)  # fmt: skip
        started = time.monotonic()
        counts = list(progress.counts) if progress.counts is not None else None
        seat, reports = self.reformer.reform(
            {"window": window, "stage": progress.stage, "counts": counts}
        )
        before = self.seat.members
        self.seat = seat
        decision = decide(reports, seat.rank, sync)
        if progress.counts is None and decision.source is not None:  # (COUNT was cut short
            # here but not at the source, which finished the round: its counts are the round's)
            progress.counts = tuple(next(r["counts"] for r in reports
                                         if r["rank"] == decision.source))  # fmt: skip
        if decision.behind:  # (the ranks ahead dealt the next window to the old members)
            self.hold = window + 1
        self.reforms.append({
            "window": window, "members": list(seat.members), "lost": sorted(set(before) -
            set(seat.members)), "decision": decision.kind, "seconds": time.monotonic() - started,
        })  # fmt: skip
        log.warning("rank %d: re-formed with ranks %s in %.1f s (window %d: %s)", seat.rank,
                    list(seat.members), time.monotonic() - started, window,
                    decision.kind)  # fmt: skip
        return decision

    def _keep(self, tensors: list[torch.Tensor]) -> None:
        """Host copies of ``tensors`` (buffers reused from round to round)."""
        if [(c.shape, c.dtype) for c in self._copies] != [(t.shape, t.dtype) for t in tensors]:
            pin = any(t.is_cuda for t in tensors)
            self._copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
        with torch.no_grad():
            for copy, tensor in zip(self._copies, tensors, strict=True):
                copy.copy_(tensor, non_blocking=True)
        if any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()

    def _put_back(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for copy, tensor in zip(self._copies, tensors, strict=True):
                tensor.copy_(copy)

    def _adopt(self, source: int | None, tensors: list[torch.Tensor], with_optimizer: bool) -> None:
        """Every member takes ``source``'s tensors (and optimizer state)."""
        assert self.seat is not None
        assert source is not None
        src = self.seat.members.index(source)
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor.data, src=src)
        if with_optimizer and self.optimizer is not None:
            state: list[Any] = [self.optimizer.state_dict() if source == self.seat.rank else None]
            dist.broadcast_object_list(state, src=src)
            if source != self.seat.rank:
                self.optimizer.load_state_dict(state[0])

    def _result(self, progress: Progress, gamma: float) -> RoundResult:
        """A round that stands (kept, or adopted from a rank that finished it)."""
        assert self.seat is not None
        counts = progress.counts or (0,) * self.seat.world
        movers = sum(1 for c in counts if c > 0)
        weight = gamma_shares(counts, gamma)[self.seat.rank] if movers else 0.0
        return RoundResult(movers > 0, progress.collectives, counts, weight, movers, None)

    def close(self) -> None:
        if self.reformer is not None:
            self.reformer.close()
