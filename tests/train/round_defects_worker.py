"""Run under torchrun by test_collective.py: the averaging round's bounds (buckets, memory,
mixed dtypes, gamma, windows that disagree, the divergence triple, the debug trace)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from muster.errors import CohortDiverged, UserError
from muster.train.collective import average_round, debug_trace

MIB = 1024 * 1024


class Mixed(nn.Module):
    """Parameters of two dtypes, and a float64 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(100, dtype=torch.float32))
        self.b = nn.Parameter(torch.zeros(50, dtype=torch.float64))
        self.c = nn.Parameter(torch.zeros(10, dtype=torch.float32))
        self.register_buffer("mean", torch.zeros(4, dtype=torch.float64))


def fill(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, object] = {"rank": rank}

    # A model ten buckets large, one big tensor and small ones: in place, sliced, bounded.
    big = nn.Sequential(nn.Linear(1024, 2560), nn.Linear(2560, 3))  # ~10.5 MiB of float32
    fill(big, float(rank + 1))
    weight = big[0].weight
    before_ptr = weight.data_ptr()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = average_round(big, 1, gamma=1.0, bucket_bytes=MIB)
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    out["big"] = {
        "collectives": result.collectives,
        "values": sorted(
            {round(v, 6) for p in big.parameters() for v in p.detach().flatten().tolist()}
        ),
        "same_storage": weight.data_ptr() == before_ptr,
        "allocated_mib": allocated / MIB,
        "model_mib": sum(p.numel() * 4 for p in big.parameters()) / MIB,
    }

    # Mixed dtypes: one bucket per dtype, counted.
    mixed = Mixed()
    fill(mixed, float(rank + 1))
    mixed.mean.fill_(10.0 * (rank + 1))
    result = average_round(mixed, [3, 1][rank], gamma=1.0)
    out["mixed"] = {
        "collectives": result.collectives,
        "a": mixed.a[0].item(),
        "b": mixed.b[0].item(),
        "mean": mixed.mean[0].item(),
        "weight": result.weight,
        "counts": list(result.counts),
    }

    # A parameter that is not contiguous (a transposed view) is averaged all the same.
    strided = nn.Module()
    strided.w = nn.Parameter(torch.arange(12.0).reshape(3, 4).t() * (rank + 1))
    average_round(strided, 1)
    out["strided"] = strided.w.detach().tolist()

    # Gamma: a huge count and gamma 4 weigh in log space; gamma past the bound is refused
    # on every rank before any collective.
    fill(mixed, float(rank + 1))
    result = average_round(mixed, [10**12, 1][rank], gamma=4.0)
    out["gamma4"] = {"a": mixed.a[0].item(), "weight": result.weight}
    try:
        average_round(mixed, [1000, 200][rank], gamma=200.0)
        out["gamma200"] = "averaged"
    except UserError as exc:
        out["gamma200"] = str(exc)

    # Ranks at different windows: every rank raises before anything is averaged.
    fill(mixed, float(rank + 1))
    try:
        average_round(mixed, 2, window=[3, 2][rank])
        out["diverged"] = "averaged"
    except CohortDiverged as exc:
        out["diverged"] = str(exc)
    out["after_diverged"] = mixed.a[0].item()

    # Models of different layouts (fp16 on one rank, bf16 on the other: the same bytes):
    # every rank refuses before anything is averaged.
    half = nn.Linear(4, 4).to([torch.float16, torch.bfloat16][rank])
    try:
        average_round(half, 1)
        out["layouts"] = "averaged"
    except CohortDiverged as exc:
        out["layouts"] = str(exc)

    # The divergence triple: rank 0 holds 1s, rank 1 3s, equal weights: consensus 2s.
    flat = nn.Linear(4, 4, bias=False)  # 16 values
    fill(flat, [1.0, 3.0][rank])
    result = average_round(flat, 5, gamma=1.0)
    assert result.divergence is not None
    d = result.divergence
    out["triple"] = [d.distance, d.norm_before, d.norm_after]

    # The debug trace (MUSTER_TRAIN_DEBUG=1): enter and exit lines for each collective.
    trace = debug_trace(rank)
    out["traced"] = trace is not None
    if trace is not None:
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            average_round(flat, 1, window=7, trace=trace)
        out["trace"] = said.getvalue().splitlines()

    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not the interpreter's teardown: gloo sometimes aborts there


if __name__ == "__main__":
    main()
