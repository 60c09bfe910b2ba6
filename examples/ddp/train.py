"""A small DDP job: an all_reduce every rank checks, then a few steps, then a checkpoint.

Runs under torchrun (and so under muster): `torchrun --nproc-per-node 2 train.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    # Every rank contributes rank + 1; the sum must be world * (world + 1) / 2 everywhere.
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    status = "ok" if value.item() == expected else "WRONG"
    print(f"all_reduce sum={value.item():.0f} expected={expected:.0f} {status}", flush=True)
    if status != "ok":
        raise SystemExit(3)

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1234 + rank)
    weights = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=generator)
        y = x @ weights
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    out = Path(os.environ.get("MUSTER_OUTPUT_DIR", "outputs"))
    out.mkdir(parents=True, exist_ok=True)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        torch.save(model.module.state_dict(), out / "checkpoint.pt")
        (out / "result.txt").write_text(f"rank {rank} final loss {loss.item():.4f}\n")
        print(f"wrote {out / 'checkpoint.pt'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.x with gloo sometimes aborts a rank while the interpreter shuts down, after
    # destroy_process_group (a C++ worker thread still joinable at exit: "terminate called
    # without an active exception"; pytorch/pytorch#190489). Everything is written and
    # flushed by now: leave without the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
