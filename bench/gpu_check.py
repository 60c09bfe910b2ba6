"""The NCCL averaging round on CUDA: correctness checks and its cost against a plain all_reduce.

Skips cleanly (exit 0, says why) where torch sees no CUDA device. Otherwise it starts torchrun
with one rank per GPU (at most 2; one GPU gives a world of one, which still runs NCCL's
premultiply-sum) and checks, on every rank:

- fp32 through premul-sum: the sum of factor-scaled tensors equals the hand-computed one;
- bf16 with a power-of-two factor (the torch bug that returns zeros) takes the pre-scale path
  and is right;
- average_round on a model with float and integer buffers: identical parameters on every rank,
  the weighted average, integer buffers untouched;
- ElChe's per-batch delivered rate on CUDA matches a synchronized measurement (CUDA events,
  not the host clock, which would time only the kernel launches);
- time of one average_round on a ~25M-parameter fp32 model against one plain all_reduce (SUM)
  of the same flat tensor (the anchor); prints both medians and the ratio.

    .venv/bin/python bench/gpu_check.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker() -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from muster.train.collective import average_round, premul_sum_args, weighted_sum

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local)
    failures: list[str] = []

    def check(name: str, ok: bool) -> None:
        print(f"rank {rank} {'ok  ' if ok else 'FAIL'} {name}", flush=True)
        if not ok:
            failures.append(name)

    # fp32 through the fused premultiply-sum.
    x = torch.full((1000,), float(rank + 1), device=device)
    prescale = premul_sum_args(x, 0.25, "nccl")[1]
    check("fp32 uses premul-sum on NCCL", not prescale)
    weighted_sum([x], 0.25, None, "nccl")
    expected = 0.25 * sum(r + 1 for r in range(world))
    check("fp32 premul-sum value", torch.allclose(x, torch.full_like(x, expected)))

    # bf16 with a power-of-two factor: the pre-scale path, never zeros.
    b = torch.full((1000,), float(rank + 1), device=device, dtype=torch.bfloat16)
    check("bf16 pre-scales", premul_sum_args(b, 0.5, "nccl")[1])
    weighted_sum([b], 0.5, None, "nccl")
    check(
        "bf16 value",
        torch.allclose(
            b.float(), torch.full((1000,), 0.5 * sum(r + 1 for r in range(world)), device=device)
        ),
    )

    # A whole round: rank r holds r + 1 everywhere and realized r + 1 batches (gamma 1).
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank + 1))
    model[1].num_batches_tracked.fill_(rank + 7)
    result = average_round(model, rank + 1, gamma=1.0)
    masses = [r + 1 for r in range(world)]
    want = sum(m * m for m in masses) / sum(masses)
    weight = model[0].weight
    gathered = [torch.empty_like(weight) for _ in range(world)]
    dist.all_gather(gathered, weight.detach().contiguous())
    check("parameters identical on every rank", all(torch.equal(g, gathered[0]) for g in gathered))
    check("weighted average", torch.allclose(weight, torch.full_like(weight, want)))
    check("integer buffer stays local", int(model[1].num_batches_tracked) == rank + 7)
    check("three collectives (COUNT, one param bucket, one buffer bucket)", result.collectives == 3)

    # ElChe's stopwatch on CUDA times the work, not the kernel launches.
    from muster.train.elche import ElChe

    net = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)]).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=1e-6)
    data = torch.randn(64 * 512, 4096, device=device)

    def work(xb: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        net(xb).square().mean().backward()
        opt.step()

    for i in range(5):  # warm up
        work(data[i * 512 : (i + 1) * 512])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(20):
        work(data[i * 512 : (i + 1) * 512])
    torch.cuda.synchronize()
    truth = (time.perf_counter() - t0) / 20 * 1e3
    elche = ElChe(net, opt, dataset_size=len(data), batch_size=512, anchor_batches=8)
    for xb in elche.epoch(0, fetch=lambda idx: data[idx.to(device)]):
        work(xb)
    measured = elche.schedule.rate_ms(rank, "delivered") or 0.0
    print(
        f"rank {rank} per batch: synchronized {truth:.2f} ms, ElChe {measured:.2f} ms", flush=True
    )
    check("ElChe's delivered rate is the GPU's time", 0.7 <= measured / truth <= 1.5)

    # Cost: average_round against one plain all_reduce of the same bytes.
    big = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)]).to(device)
    flat = torch.cat([p.detach().reshape(-1) for p in big.parameters()])
    plain, ours = [], []
    for _ in range(25):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        torch.cuda.synchronize()
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        average_round(big, 4, gamma=1.0)
        torch.cuda.synchronize()
        ours.append(time.perf_counter() - t0)
    # Memory: the round holds no second copy of the model (at most two buckets on top).
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    average_round(big, 4, gamma=1.0)
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - resident) / 2**20
    model_mib = sum(p.numel() * p.element_size() for p in big.parameters()) / 2**20
    print(f"rank {rank}: a round on {model_mib:.0f} MiB took {extra:.1f} MiB more", flush=True)
    check("a round's extra memory is bounded by two buckets", extra <= 2 * 25 + 1)
    a, m = statistics.median(plain[5:]) * 1e3, statistics.median(ours[5:]) * 1e3
    if rank == 0:
        params = sum(p.numel() for p in big.parameters()) / 1e6
        print(
            f"{params:.1f}M params, world {world}: all_reduce {a:.2f} ms, "
            f"average_round {m:.2f} ms, ratio {m / a:.2f}",
            flush=True,
        )
    dist.destroy_process_group()
    if failures:
        raise SystemExit(f"rank {rank}: {len(failures)} check(s) failed: {', '.join(failures)}")


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: skipped: torch sees no CUDA device on this machine")
        return
    from muster.cli.local import local_torchrun

    nproc = min(torch.cuda.device_count(), 2)
    done = subprocess.run(
        local_torchrun(os.path.abspath(__file__), "--worker", nproc=nproc),
        timeout=600,
        check=False,
    )
    raise SystemExit(done.returncode)


if __name__ == "__main__":
    main()
