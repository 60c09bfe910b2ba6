"""Run under torchrun by test_elche.py: ElChe training loops, what each rank saw, as JSON.

argv: OUT_DIR SCENARIO, with SCENARIO one of
- cadence: rank 1 three times slower; per window, the counts and this rank's sample indices;
  per epoch, a digest of the parameters;
- sync: ElChe sync next to torch DDP on the same batches (AdamW: state that parameter
  averaging would not keep equal); then an epoch of 5 batches, whose fifth would leave
  rank 1 without one; then a loop that steps by hand (no ``elche.step``);
- diverge: rank 0 breaks out of its loop mid-window and carries on with the next epoch;
- hazards: sync mode with a branch one rank takes, a break after a step, and a rank that
  steps by hand while the other steps through ElChe.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from muster.errors import CohortDiverged
from muster.train.elche import ElChe


def data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(samples, 16, generator=g)
    return x, x @ torch.randn(16, 1, generator=g)


def params(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def cadence(rank: int) -> dict[str, object]:
    torch.manual_seed(rank)  # different starts: ElChe must broadcast rank 0's
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = data(40 * 64 + 17)  # 40 full batches and 17 samples left over
    elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=64, anchor_batches=3)
    windows: list[dict[str, object]] = []
    epochs: list[list[float]] = []
    for epoch in range(3):
        current = -1
        for indices in elche.epoch(epoch):
            if elche.window != current:
                current = elche.window
                windows.append({"epoch": epoch, "counts": list(elche.counts), "indices": []})
            windows[-1]["indices"] += indices.tolist()  # type: ignore[operator]
            t0 = time.perf_counter()
            elche.step(nn.functional.mse_loss(model(x[indices]), y[indices]))
            if rank == 1:
                time.sleep(2 * (time.perf_counter() - t0) + 0.002)
        epochs.append(params(model))
    return {"windows": windows, "epochs": epochs, "rounds": elche.window}


def sync(rank: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))
    twin = DistributedDataParallel(nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1)))
    twin.module.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=0.01)
    x, y = data(6 * 32)
    elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=32, mode="sync")
    for epoch in range(2):
        for indices in elche.epoch(epoch):
            elche.step(nn.functional.mse_loss(model(x[indices]), y[indices]))
            twin_optimizer.zero_grad()
            nn.functional.mse_loss(twin(x[indices]), y[indices]).backward()
            twin_optimizer.step()
    result: dict[str, object] = {
        "windows": elche.window,
        "params": params(model),
        "ddp": params(twin.module),
    }
    # DDP's reducer sits in reference cycles; free it now, while the process group lives,
    # not whenever the collector runs (possibly after destroy_process_group).
    del twin, twin_optimizer
    gc.collect()
    # 5 batches an epoch: the last window leaves rank 1 without a batch.
    x, y = data(5 * 32)
    elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=32, mode="sync")
    counts: list[list[int]] = []
    for indices in elche.epoch(0):
        counts.append(list(elche.counts))
        elche.step(nn.functional.mse_loss(model(x[indices]), y[indices]))
    result.update(tail_counts=counts, tail_windows=elche.window, tail_params=params(model))
    # Stepped by hand: each rank's own gradient and step; the round averages the parameters.
    elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=32, mode="sync")
    for indices in elche.epoch(0):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[indices]), y[indices]).backward()
        optimizer.step()
    assert elche.last_round is not None
    result.update(
        by_hand_params=params(model),
        by_hand_averaged=elche.last_round.divergence is not None,
    )
    return result


def diverge(rank: int) -> dict[str, object]:
    """Rank 0 leaves its loop early (a real break, mid-window) and goes on to the next epoch;
    rank 1 runs the loop as written. Every rank must hear of it at the next round."""
    model = nn.Linear(4, 1)
    elche = ElChe(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dataset_size=64,
        batch_size=8,
        mode="sync",
    )
    before = params(model)
    try:
        for epoch in range(2):
            for _ in elche.epoch(epoch):  # (no step: only rounds could move the model)
                if rank == 0 and epoch == 0 and elche.window == 1:
                    break
    except CohortDiverged as error:
        return {"error": str(error), "moved": params(model) != before}
    return {"error": None}


class Branchy(nn.Module):
    """A model with a branch only rank 0 takes and one nobody takes."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 1)
        self.rank0_only = nn.Linear(4, 1)
        self.never = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.trunk(x)
        if dist.get_rank() == 0:
            out = out + self.rank0_only(x)
        return out


def sync_hazards(rank: int) -> dict[str, object]:
    """Sync mode's round runs inside ``step``, before the optimizer: a rank out of step must
    be caught there, before any gradient is averaged."""
    result: dict[str, object] = {}
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    # 1. A parameter one rank's loss reaches, and one nobody's: the first is averaged (zero
    # on the other rank), the second keeps grad None on every rank and does not move,
    # weight decay or not.
    model = Branchy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    elche = ElChe(model, optimizer, dataset_size=64, batch_size=8, mode="sync")
    never_before = params(model.never)
    for indices in elche.epoch(0):
        elche.step(model(x[indices]).pow(2).mean())
    result["branchy"] = params(model)
    result["never_moved"] = params(model.never) == never_before
    result["never_grad_none"] = model.never.weight.grad is None
    # 2. Rank 0 breaks out after its step, mid-epoch, and goes on to the next epoch.
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    elche = ElChe(model, optimizer, dataset_size=64, batch_size=8, mode="sync")
    try:
        for epoch in range(2):
            for indices in elche.epoch(epoch):
                elche.step(model(x[indices]).pow(2).mean())
                if rank == 0 and epoch == 0 and elche.window == 1:
                    break
        result["break"] = None
    except CohortDiverged as error:
        result["break"] = str(error)
    # 3. Rank 0 steps through ElChe, rank 1 by hand.
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    elche = ElChe(model, optimizer, dataset_size=64, batch_size=8, mode="sync")
    try:
        for indices in elche.epoch(0):
            loss = model(x[indices]).pow(2).mean()
            if rank == 0:
                elche.step(loss)
            else:
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        result["mixed"] = None
    except CohortDiverged as error:
        result["mixed"] = str(error)
    return result


def main() -> None:
    out, scenario = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    scenarios = {"cadence": cadence, "sync": sync, "diverge": diverge, "hazards": sync_hazards}
    result = scenarios[scenario](rank)
    with open(os.path.join(out, f"{scenario}{rank}.json"), "w") as fh:
        json.dump(result, fh)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not the interpreter's teardown: gloo sometimes aborts there


if __name__ == "__main__":
    main()
