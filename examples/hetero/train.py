"""ElChe on a gang whose members differ in speed: a small classifier, one rank slowed down.

Runs under torchrun (and so under muster):

    torchrun --nproc-per-node 2 examples/hetero/train.py --slowdown 3

Rank ``--slow-rank`` sleeps ``slowdown - 1`` times its compute after every batch, as a GPU a
few times slower would. With ``--mode cadence`` ElChe hands the fast rank proportionally more
batches per window, so neither rank idles; ``--mode sync`` averages after every batch, as
DDP does; ``--backend star --mode async`` averages through the CPU star without waiting at
the window's end. Rank 0 prints each epoch's held-out loss and the window's batch counts, and writes
``result.json`` and ``model.pt`` to ``$MUSTER_OUTPUT_DIR`` (default ``outputs/``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from muster.train.elche import ElChe


def make_data(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points labelled by a fixed random teacher network (the same on every rank)."""
    teacher = torch.Generator().manual_seed(1)
    w1 = torch.randn(32, 64, generator=teacher)
    w2 = torch.randn(64, 8, generator=teacher)
    x = torch.randn(samples, 32, generator=torch.Generator().manual_seed(seed))
    return x, (torch.tanh(x @ w1) @ w2).argmax(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["sync", "cadence", "async"], default="cadence")
    parser.add_argument(
        "--backend", choices=["collective", "star"], default="collective",
        help="star: average over TCP through per-host folds (async needs it)",
    )  # fmt: skip
    parser.add_argument("--gamma", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=32768)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--slowdown", type=float, default=1.0, help="k: the slow rank's factor")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_data(args.samples, seed=2)
    held_x, held_y = make_data(2048, seed=3)
    elche = ElChe(
        model,
        optimizer,
        dataset_size=args.samples,
        batch_size=args.batch_size,
        mode=args.mode,
        gamma=args.gamma,
        backend=args.backend,
    )
    loss_fn = nn.CrossEntropyLoss()
    slow = rank == args.slow_rank
    started = time.perf_counter()
    history = []
    for epoch in range(args.epochs):
        for xb, yb in elche.epoch(epoch, fetch=lambda idx: (x[idx], y[idx])):
            t0 = time.perf_counter()
            elche.step(loss_fn(model(xb), yb))
            if slow and args.slowdown > 1:
                time.sleep((args.slowdown - 1) * (time.perf_counter() - t0))
        with torch.no_grad():  # every rank holds the same model after the epoch's last round
            held = loss_fn(model(held_x), held_y).item()
        history.append({"epoch": epoch, "held_out_loss": held, "counts": elche.counts})
        if rank == 0:
            print(
                f"epoch {epoch} held-out loss {held:.4f} windows {elche.window} "
                f"last window batches per rank {elche.counts}",
                flush=True,
            )
    print(
        f"rank {rank} ran {elche.batches_run} batches in {time.perf_counter() - started:.1f}s, "
        f"{elche.round_ms / 1e3:.1f}s of it in rounds",
        flush=True,
    )
    if rank == 0:
        out = Path(os.environ.get("MUSTER_OUTPUT_DIR", "outputs"))
        out.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), out / "model.pt")
        (out / "result.json").write_text(json.dumps({"mode": args.mode, "epochs": history}))
    elche.close()  # (the star: a rank that hosts a hub serves its peers until they leave)
    dist.barrier()  # no rank tears the group down while a peer still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
