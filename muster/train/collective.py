"""The collective averaging backend: realized-work rounds over torch.distributed (seed 002).

One averaging round, on every rank of the process group:

1. COUNT, always: all_reduce(sum) of [gamma_mass(n), mover_mass(n)] in float64.
2. If the cohort's gamma mass is not realized (every rank idle), return after that one
   collective: every rank holds the same sums, so every rank takes the same branch and the
   number of collectives stays identical across ranks.
3. PARAM: each rank contributes its floating-point parameters scaled by n**gamma / sum, summed.
   On NCCL the scale is fused into the collective (premultiply-sum); for bf16 on NCCL, and on
   gloo, the rank pre-scales and the collective sums (a known torch bug makes premul-sum return
   zeros for bf16 with power-of-two factors).
4. BUFFER, only if the model has floating-point buffers: the same with mover mass. Integer
   buffers stay local (they evolve identically on every rank); optimizer state stays local.

Tensors of one dtype travel as one flat buffer, so a round is at most three collectives.
A second backend (the CPU star with per-host folds) can sit beside this one: both take the
same masses from ``muster.train.mass``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from muster.train.mass import gamma_mass, is_realized, mover_mass


@dataclass(frozen=True)
class RoundResult:
    """What one averaging round did on this rank."""

    realized: bool
    collectives: int  # 1 (idle cohort), 2 (params) or 3 (params and float buffers)
    cohort_mass: float  # sum of n**gamma over the cohort
    movers: float  # ranks that did any work


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


def weighted_sum(tensors: list[torch.Tensor], factor: float, group: Any, backend: str) -> None:
    """Replace every tensor by the cohort's sum of factor-scaled copies, one dtype at a time."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        op, prescale = premul_sum_args(flat, factor, backend)
        if prescale:
            flat.mul_(factor)
        dist.all_reduce(flat, op=op, group=group)
        offset = 0
        with torch.no_grad():
            for t in same:
                size = t.numel()
                t.copy_(flat[offset : offset + size].view_as(t))
                offset += size


def average_round(
    model: nn.Module,
    batches: int,
    gamma: float = 1.0,
    group: Any = None,
    side: torch.Tensor | None = None,
) -> RoundResult:
    """Average ``model`` across the group, each rank weighted by the batches it realized.

    ``side``, a float64 CPU vector of the same length on every rank, rides the COUNT
    collective and is replaced by its sum over the group (the ElChe timing exchange uses it,
    so a window costs no extra collective).
    """
    backend = str(dist.get_backend(group))
    device = next(model.parameters()).device
    head = [gamma_mass(batches, gamma), mover_mass(batches)]
    extra = side.tolist() if side is not None else []
    count = torch.tensor(head + extra, dtype=torch.float64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    if side is not None:
        side.copy_(count[2:].cpu())
    cohort_mass, movers = float(count[0]), float(count[1])
    if not is_realized(cohort_mass):
        return RoundResult(False, 1, cohort_mass, movers)
    params = _floating(model.parameters())
    weighted_sum(params, gamma_mass(batches, gamma) / cohort_mass, group, backend)
    buffers = _floating(model.buffers())
    if not buffers:
        return RoundResult(True, 2, cohort_mass, movers)
    weighted_sum(buffers, mover_mass(batches) / movers, group, backend)
    return RoundResult(True, 3, cohort_mass, movers)
