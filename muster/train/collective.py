"""The collective averaging backend: realized-work rounds over torch.distributed (seed 002).

One averaging round, on every rank of the process group:

1. COUNT, always: one all_reduce(sum) of a float64 vector in which each rank fills its own
   slots: the batches it realized, its window number, a fingerprint of its model's layout,
   whether it is in ElChe's sync step, how many of its trainable parameters have no
   gradient, and the caller's ``side`` values. After it every rank holds every rank's
   values, so every rank computes the same weights and takes the same branch below:
   - ranks at different windows, whose models differ in layout (dtypes, sizes, devices,
     requires_grad), or of which only some are in the sync step: every rank raises
     ``CohortDiverged`` here, before any model was averaged (a rank that left its loop
     early would otherwise average another window; an fp16 model against bf16 peers would
     sum the wrong bits without a word);
   - the cohort idle (every count 0): every rank keeps its local state; nothing more is sent.
2. PARAM: each rank contributes its floating-point parameters scaled by its share, and the
   collective sums. A rank's share is
   ``n_r**gamma / sum_j n_j**gamma`` (an idle rank's is 0: the idle guard), computed in log
   space from the gathered counts, so no gamma and no count overflows on one rank while the
   others wait in the collective.
3. The divergence triple (seed 002), between the two rounds: this rank's distance from the
   consensus, and the norms of its parameters before and of the consensus after.
4. BUFFER, only if the model has floating-point buffers: the same with mover mass (every rank
   that did any work weighs the same). Integer buffers stay local (they evolve identically on
   every rank); optimizer state stays local.

ElChe's sync mode runs its round inside the step instead (:func:`sync_step`): COUNT, then
GRAD (the gradients' mean, DDP's all-reduce), the optimizer's step, then BUFFER; the models
never differ, so there is no PARAM.

Memory: tensors are reduced in place, in buckets of at most ``bucket_bytes`` of one device
and dtype (25 MiB by default, DDP's bucket): small tensors are packed into one scratch
buffer, a large one is reduced in slices of itself. A round never holds a second copy of
the model; its extra memory is two buckets at most (the scratch, and one tensor's difference
for the divergence), plus, for a parameter that is not contiguous (a channels_last weight),
a contiguous copy of that one tensor while it is reduced. A round is therefore 1 + one
collective per parameter bucket + one per buffer bucket; ``RoundResult.collectives`` counts
them, the same number on every rank of one model layout (which COUNT checks).

On NCCL the scale is fused into the collective (premultiply-sum), except for bf16 (a known
torch bug makes premul-sum return zeros for bf16 with power-of-two factors); there, and on
gloo, the rank pre-scales and the collective sums.

A cohort that survives a lost peer (``muster.train.reform``) runs these functions over a
smaller process group: ``seat`` then names this rank's place in the *original* cohort (its
logical rank, the original world and the members still in it), so COUNT's slots, the shares
and the sampler keep their meaning, and a member's absence is a zero count. ``progress``
records how far a round got (so a failure can be undone) and closes the round with one more
tiny all-reduce, DONE: a rank past DONE knows every rank finished the round's data.

``MUSTER_TRAIN_DEBUG=1`` prints a line on stderr as each collective is entered and left,
naming the window, the collective and its size, so a stuck rank shows where it is parked.
"""

from __future__ import annotations

import math
import os
import sys
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from muster.errors import CohortDiverged, UserError
from muster.train.mass import MAX_GAMMA, gamma_shares, mover_mass

BUCKET_BYTES = 25 * 1024 * 1024
HEAD_SLOTS = 5  # COUNT's slots per rank: batches, window, layout, in-step, missing gradients
Trace = Callable[[str], None]


@dataclass(frozen=True)
class Seat:
    """This rank in the original cohort: its logical rank, the original world, and the
    logical ranks of the members the current process group holds (in group-rank order)."""

    rank: int
    world: int
    members: tuple[int, ...]


@dataclass
class Progress:
    """How far a round got on this rank: ``stage`` is "count" (nothing of the model touched),
    "data" (tensors pre-scaled or partly summed), "stepped" (sync: the optimizer stepped on
    the cohort's gradient) or "closing" (every data collective done: the round's result is
    whole on this rank; only DONE is left)."""

    stage: str = "count"
    counts: tuple[int, ...] | None = None  # every rank's batches, once COUNT is through
    collectives: int = 0
    wait: Callable[[Any], None] | None = None  # waits for each collective's work (or raises)
    closes: bool = True  # ends the round with DONE (a cohort that can re-form needs it)


def all_reduce(tensor: torch.Tensor, op: Any, group: Any, progress: Progress | None) -> None:
    """dist.all_reduce; with a ``progress`` that has a waiter, the waiter waits for it (and
    may give up on it: the re-forming cohort's ranks are told to leave their collective)."""
    if progress is None or progress.wait is None:
        dist.all_reduce(tensor, op=op, group=group)
        return
    progress.wait(dist.all_reduce(tensor, op=op, group=group, async_op=True))


STAGES = ("count", "data", "stepped", "closing")


@dataclass(frozen=True)
class Divergence:
    """How far this rank's parameters were from the consensus the round made (L2 norms over
    every floating-point parameter)."""

    distance: float  # |local - consensus|
    norm_before: float  # |local|
    norm_after: float  # |consensus|


@dataclass(frozen=True)
class RoundResult:
    """What one averaging round did on this rank (the same counts on every rank)."""

    realized: bool
    collectives: int  # COUNT, then one per parameter bucket and one per float-buffer bucket
    counts: tuple[int, ...]  # the batches every rank realized this window
    weight: float  # this rank's share of the parameter average (0: it did no work)
    movers: int  # ranks that did any work
    divergence: Divergence | None  # None when no parameters were averaged


def _floating(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors if t.is_floating_point()]


def premul_sum_args(tensor: torch.Tensor, factor: float, backend: str) -> tuple[Any, bool]:
    """(reduce op, pre-scale first?) for summing ``tensor`` scaled by ``factor``.

    NCCL fuses the scale into the collective, except for bf16 where the rank pre-scales;
    every other backend pre-scales and sums.
    """
    if backend == "nccl" and tensor.dtype != torch.bfloat16:
        make = getattr(dist, "_make_nccl_premul_sum", None)
        if make is not None:
            return make(factor), False
    return dist.ReduceOp.SUM, True


def debug_trace(rank: int) -> Trace | None:
    """The MUSTER_TRAIN_DEBUG=1 tracer: enter/exit lines on stderr, or None."""
    if os.environ.get("MUSTER_TRAIN_DEBUG", "") in ("", "0"):
        return None

    def trace(what: str) -> None:
        print(f"[muster.train rank {rank}] {what}", file=sys.stderr, flush=True)

    return trace


@dataclass
class _Sums:
    """Squared norms (local, consensus, difference), accumulated on the device and read once
    per round (one sync on a GPU)."""

    acc: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def _add(self, index: int, tensor: torch.Tensor) -> None:
        acc = self.acc.get(tensor.device)
        if acc is None:
            acc = self.acc[tensor.device] = torch.zeros(
                3, dtype=torch.float64, device=tensor.device
            )
        # (in float32 at least: a half-precision norm overflows past 65504)
        wide = torch.float32 if tensor.element_size() < 4 else tensor.dtype
        acc[index] += torch.linalg.vector_norm(tensor, dtype=wide).to(torch.float64) ** 2

    def norms(self, local: torch.Tensor, consensus: torch.Tensor) -> None:
        self._add(0, local)
        self._add(1, consensus)

    def difference(self, diff: torch.Tensor) -> None:
        self._add(2, diff)

    def divergence(self) -> Divergence:
        before = after = diff = 0.0
        for acc in self.acc.values():
            b, a, d = acc.tolist()
            before, after, diff = before + b, after + a, diff + d
        return Divergence(math.sqrt(diff), math.sqrt(before), math.sqrt(after))


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Flat 1-D views of ``tensors`` (contiguous ones), packed in order into buckets of one
    device and dtype and at most ``bucket_bytes`` each; a tensor larger than a bucket is cut
    into slices."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    out: list[list[torch.Tensor]] = []
    for (_device, dtype), same in by_kind.items():
        cap = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
        bucket: list[torch.Tensor] = []
        size = 0
        for tensor in same:
            flat = tensor.detach().view(-1)
            for start in range(0, flat.numel(), cap):
                piece = flat[start : start + cap]
                if bucket and size + piece.numel() > cap:
                    out.append(bucket)
                    bucket, size = [], 0
                bucket.append(piece)
                size += piece.numel()
        if bucket:
            out.append(bucket)
    return out


def weighted_sum(
    tensors: list[torch.Tensor],
    factor: float,
    group: Any,
    backend: str,
    *,
    bucket_bytes: int = BUCKET_BYTES,
    sums: _Sums | None = None,
    trace: Trace | None = None,
    label: str = "REDUCE",
    progress: Progress | None = None,
) -> int:
    """Replace every tensor, in place, by the cohort's sum of factor-scaled copies; returns
    the number of collectives (buckets). With ``sums``, also accumulates the squared norms of
    the local values, the sums and their difference."""
    buckets = _buckets([t for t in tensors if t.is_contiguous()], bucket_bytes)
    scratch: torch.Tensor | None = None  # one bucket at most, reused while the kind holds
    for index, views in enumerate(buckets):
        n = sum(v.numel() for v in views)
        kind = (views[0].device, views[0].dtype)
        spare = views[0]  # (unused when a lone view is reduced without sums)
        if len(views) > 1 or sums is not None:
            if scratch is None or (scratch.device, scratch.dtype) != kind:
                scratch = None  # (freed before the next is made)
                largest = max(
                    sum(v.numel() for v in b) for b in buckets if (b[0].device, b[0].dtype) == kind
                )
                scratch = torch.empty(largest, dtype=kind[1], device=kind[0])
            spare = scratch[:n]
        if len(views) == 1:
            buf = views[0]  # reduced in place; the local values wait in the scratch
            if sums is not None:
                spare.copy_(buf)
        else:
            buf = torch.cat(views, out=spare)  # reduced in the scratch; views stay local
        op, prescale = premul_sum_args(buf, factor, backend)
        if prescale:
            buf.mul_(factor)
        if trace is not None:
            megabytes = n * buf.element_size() / 2**20
            name = str(kind[1]).removeprefix("torch.")
            trace(f"enter {label} {index + 1}/{len(buckets)} ({name}, {megabytes:.2f} MiB)")
        all_reduce(buf, op, group, progress)
        if trace is not None:
            trace(f"exit {label} {index + 1}/{len(buckets)}")
        with torch.no_grad():
            if len(views) == 1:
                if sums is not None:
                    sums.norms(spare, buf)
                    sums.difference(spare.sub_(buf))  # (the scratch is free after this)
            else:
                offset = 0
                for view in views:
                    part = buf[offset : offset + view.numel()]
                    if sums is not None:
                        sums.norms(view, part)
                        sums.difference(view - part)  # at most one view's size
                    view.copy_(part)
                    offset += view.numel()
    del scratch
    count = len(buckets)
    # A tensor that is not contiguous (rare for parameters; a channels_last conv weight) is
    # reduced through a contiguous copy of its own, written back and freed before the next:
    # one such tensor at a time is the one allocation past the bucket bound.
    for tensor in tensors:
        if not tensor.is_contiguous():
            copy = tensor.detach().contiguous()
            count += weighted_sum(
                [copy],
                factor,
                group,
                backend,
                bucket_bytes=bucket_bytes,
                sums=sums,
                trace=trace,
                label=label,
                progress=progress,
            )
            with torch.no_grad():
                tensor.copy_(copy)
            del copy
    return count


def layout_of(params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> int:
    """A 32-bit fingerprint of what a round reduces (each tensor's dtype, size, device type
    and whether it trains, in order): ranks whose fingerprints differ would pair the wrong
    bytes (a parameter frozen on one rank only changes the gradient buckets)."""
    shape = [
        (str(t.dtype), t.numel(), t.device.type, bool(t.requires_grad)) for t in (*params, *buffers)
    ]
    return zlib.crc32(repr(shape).encode())


@dataclass(frozen=True)
class _Count:
    """What COUNT gathered, the same on every rank."""

    counts: tuple[int, ...]
    in_step: tuple[bool, ...]
    missing: tuple[int, ...]  # trainable parameters without a gradient, per rank (sync step)


def count_head(
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    batches: int,
    window: int | None,
    in_step: bool,
    side: torch.Tensor | None,
    rank: int,
    world: int,
    missing: int = 0,
) -> list[float]:
    """This rank's COUNT vector: its own slots filled, the others 0, then ``side``; summed
    over the cohort (by a collective, or through the star) every rank's values are in it."""
    extra = side.tolist() if side is not None else []
    head = [0.0] * (HEAD_SLOTS * world)
    head[rank] = float(max(0, batches))
    head[world + rank] = float(window + 1) if window is not None else 0.0
    head[2 * world + rank] = float(layout_of(params, buffers))
    head[3 * world + rank] = 1.0 if in_step else 0.0
    head[4 * world + rank] = float(missing)
    return head + extra


def read_count(
    gathered: Sequence[float],
    rank: int,
    world: int,
    side: torch.Tensor | None,
    among: set[int] | None = None,
) -> _Count:
    """The summed COUNT vector read back, the same on every rank; raises CohortDiverged when
    the cohort is out of step. ``among``: the ranks whose contributions were summed (the star
    leaves dead ranks out; a collective sums everyone)."""
    if side is not None:
        side.copy_(torch.tensor(list(gathered[HEAD_SLOTS * world :]), dtype=torch.float64))
    live = sorted(among) if among is not None else list(range(world))
    windows = [int(w) - 1 for w in gathered[world : 2 * world]]  # (-1: no window given)
    mine = windows[rank]
    if len({windows[r] for r in live}) > 1:
        lagging = ", ".join(f"rank {r} at {windows[r]}" for r in live if windows[r] != mine)
        raise CohortDiverged(
            f"rank {rank} is at the averaging round of window {mine}, but {lagging}: "
            "every rank must run the same loop (no early break on one rank); nothing of "
            "this round was averaged"
        )
    layouts = [int(x) for x in gathered[2 * world : 3 * world]]
    if len({layouts[r] for r in live}) > 1:
        odd = [r for r in live if layouts[r] != layouts[live[0]]]
        raise CohortDiverged(
            f"the models differ in layout (rank {live[0]} and rank {odd[0]}: the "
            "floating-point parameters' and buffers' dtypes, sizes, devices or requires_grad): "
            "every rank must hold the same model in the same dtypes; nothing of this round "
            "was averaged"
        )
    flags = tuple(bool(f) for f in gathered[3 * world : 4 * world])
    if len({flags[r] for r in live}) > 1:
        stepping = [r for r in live if flags[r]]
        raise CohortDiverged(
            f"ranks {stepping} called ElChe.step for this batch and the others stepped by "
            "hand: in sync mode every rank calls elche.step(loss) for every batch, or none "
            "does; nothing of this round was averaged"
        )
    return _Count(
        tuple(int(c) for c in gathered[:world]),
        flags,
        tuple(int(m) for m in gathered[4 * world : 5 * world]),
    )


def _count(
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    batches: int,
    window: int | None,
    in_step: bool,
    side: torch.Tensor | None,
    group: Any,
    trace: Trace | None,
    missing: int = 0,
    seat: Seat | None = None,
    progress: Progress | None = None,
) -> _Count:
    """COUNT: every rank's batches, window, layout and in-step flag, and the summed ``side``;
    raises CohortDiverged on every rank when the cohort is out of step. A rank in ElChe's
    sync step and a rank in a window's round send the same COUNT, so a cohort in which only
    some ranks call ``ElChe.step`` is caught here too."""
    backend = str(dist.get_backend(group))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    among = None
    if seat is not None:
        rank, world, among = seat.rank, seat.world, set(seat.members)
    device = torch.device("cpu")
    if backend == "nccl":  # NCCL reduces CUDA tensors: the model's GPU, else the current one
        first = params[0].device if params else None
        device = first if first is not None and first.type == "cuda" else torch.device("cuda")
    head = count_head(params, buffers, batches, window, in_step, side, rank, world, missing)
    count = torch.tensor(head, dtype=torch.float64, device=device)
    where = "step" if in_step else "round"
    if trace is not None:
        trace(f"enter COUNT (window {window}, {where})")
    all_reduce(count, dist.ReduceOp.SUM, group, progress)
    if trace is not None:
        trace(f"exit COUNT (window {window}, {where})")
    return read_count(count.tolist(), rank, world, side, among)


def _close(group: Any, progress: Progress | None, trace: Trace | None) -> None:
    """DONE: one element all-reduced once the round's data is whole on this rank."""
    if progress is None:
        return
    progress.stage = "closing"
    if not progress.closes:
        return
    done = torch.ones(1, dtype=torch.float32)
    if str(dist.get_backend(group)) == "nccl":
        done = done.cuda()
    if trace is not None:
        trace("enter DONE")
    all_reduce(done, dist.ReduceOp.SUM, group, progress)
    if trace is not None:
        trace("exit DONE")
    progress.collectives += 1


def sync_step(
    model: nn.Module,
    step: Callable[[], Any],
    group: Any = None,
    side: torch.Tensor | None = None,
    *,
    window: int,
    bucket_bytes: int = BUCKET_BYTES,
    trace: Trace | None = None,
    seat: Seat | None = None,
    progress: Progress | None = None,
) -> RoundResult:
    """ElChe's sync round, inside the step: COUNT (the cohort is in step: the same window
    and layout, every rank stepping through ElChe), then GRAD (every gradient replaced by
    the cohort's mean, as DDP's all-reduce does), then ``step()`` (the optimizer: the same
    update on every rank, whatever its state), then BUFFER (floating buffers averaged).

    A parameter no rank's loss reached keeps ``grad=None`` everywhere (the optimizer skips
    it, as under DDP); one that only some ranks reached counts as a zero gradient on the
    others. That takes one more small all-reduce, only in a step where some rank has a
    trainable parameter without a gradient. Sparse gradients are refused.
    """
    backend = str(dist.get_backend(group))
    world = dist.get_world_size(group)
    params, buffers = _floating(model.parameters()), _floating(model.buffers())
    trainable = [p for p in params if p.requires_grad]
    for param in trainable:
        if param.grad is not None and param.grad.is_sparse:
            raise UserError(
                "ElChe sync mode averages dense gradients: a sparse one (nn.Embedding("
                "sparse=True)) cannot be: make it dense, or use mode='cadence'"
            )
    missing = sum(1 for p in trainable if p.grad is None)
    counted = _count(params, buffers, 1, window, True, side, group, trace, missing, seat,
                     progress)  # fmt: skip
    collectives = 1
    if progress is not None:
        progress.counts, progress.stage = counted.counts, "data"
    used = [True] * len(trainable)
    if any(counted.missing):  # which parameters some rank's loss reached
        mask = torch.tensor(
            [0.0 if p.grad is None else 1.0 for p in trainable], dtype=torch.float64
        )
        if backend == "nccl":
            mask = mask.to(trainable[0].device)
        if trace is not None:
            trace(f"enter USED (window {window})")
        all_reduce(mask, dist.ReduceOp.SUM, group, progress)
        if trace is not None:
            trace(f"exit USED (window {window})")
        collectives += 1
        used = [bool(x) for x in mask.tolist()]
    grads = []
    for param, reached in zip(trainable, used, strict=True):
        if not reached:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    collectives += weighted_sum(
        grads, 1.0 / world, group, backend, bucket_bytes=bucket_bytes, trace=trace, label="GRAD",
        progress=progress,
    )  # fmt: skip
    step()
    if progress is not None:
        progress.stage = "stepped"
    if buffers:
        collectives += weighted_sum(
            buffers, 1.0 / world, group, backend, bucket_bytes=bucket_bytes, trace=trace,
            label="BUFFER", progress=progress,
        )  # fmt: skip
    if progress is not None:
        progress.collectives = collectives
        _close(group, progress, trace)
    counts = counted.counts
    return RoundResult(True, collectives, counts, 1.0 / world, world, None)


def average_round(
    model: nn.Module,
    batches: int,
    gamma: float = 1.0,
    group: Any = None,
    side: torch.Tensor | None = None,
    *,
    window: int | None = None,
    bucket_bytes: int = BUCKET_BYTES,
    trace: Trace | None = None,
    seat: Seat | None = None,
    progress: Progress | None = None,
) -> RoundResult:
    """Average ``model`` across the group, each rank weighted by the batches it realized.

    ``side``, a float64 CPU vector of the same length on every rank, rides the COUNT
    collective and is replaced by its sum over the group (the ElChe timing exchange uses it,
    so a window costs no extra collective). ``window``: this rank's window number; a cohort
    whose ranks disagree raises CohortDiverged on every rank before anything is averaged.
    """
    if not math.isfinite(gamma) or not 0.0 <= gamma <= MAX_GAMMA:
        raise UserError(f"gamma must be between 0 and {MAX_GAMMA:g}; got {gamma!r}")
    backend = str(dist.get_backend(group))
    rank = seat.rank if seat is not None else dist.get_rank(group)
    params, buffers = _floating(model.parameters()), _floating(model.buffers())
    counted = _count(params, buffers, batches, window, False, side, group, trace, 0, seat,
                     progress)  # fmt: skip
    counts = counted.counts
    shares = gamma_shares(counts, gamma)
    movers = sum(1 for c in counts if c > 0)
    if progress is not None:
        progress.counts, progress.stage = counted.counts, "data"
    if movers == 0:
        if progress is not None:
            progress.collectives = 1
            _close(group, progress, trace)
        return RoundResult(False, 1, counts, 0.0, 0, None)
    sums = _Sums()
    collectives = 1 + weighted_sum(
        params,
        shares[rank],
        group,
        backend,
        bucket_bytes=bucket_bytes,
        sums=sums,
        trace=trace,
        label="PARAM",
        progress=progress,
    )
    divergence = sums.divergence()  # between the rounds: the buffers cannot mask it
    if buffers:
        collectives += weighted_sum(
            buffers,
            mover_mass(counts[rank]) / movers,
            group,
            backend,
            bucket_bytes=bucket_bytes,
            trace=trace,
            label="BUFFER",
            progress=progress,
        )
    if progress is not None:
        progress.collectives = collectives
        _close(group, progress, trace)
    return RoundResult(True, collectives, counts, shares[rank], movers, divergence)
