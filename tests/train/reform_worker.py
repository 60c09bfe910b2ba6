"""Run under torchrun by test_reform.py: the collective backend losing a rank, as JSON.

argv: OUT_DIR SCENARIO KILL [SAVE], SCENARIO one of
- cadence / sync: 3 ranks, one torchrun node each; rank KILL SIGKILLs itself in window 2
  (cadence, after its first batch) or at batch 5 (sync); the survivors re-form and finish
  two epochs: the rounds they saw, their final parameters, their re-forms;
- minority: 3 ranks; ranks 1 and 2 die at once: rank 0 alone is no majority and stops with
  a save (SAVE);
- freeze: as cadence, but rank KILL is SIGSTOPped (silent, its sockets open), stall_s 8 s:
  the survivors' waits ping the members, find it silent and re-form without it;
- stall: 2 ranks under one torchrun; rank 1 sleeps in its window until rank 0 has saved
  (past stall_s, 3 s): rank 0 stops with a save (SAVE) saying the collective stalled.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from muster.errors import CohortStopped
from muster.train.elche import ElChe


def data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(samples, 16, generator=g)
    return x, x @ torch.randn(16, 1, generator=g)


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))


def flat(model: nn.Module) -> list[float]:
    return torch.cat([t.detach().flatten() for t in model.state_dict().values()
                      if t.is_floating_point()]).tolist()  # fmt: skip


def stall(rank: int, save: str) -> dict[str, object]:
    x, y = data(16 * 32)
    model = net(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=32, mode="cadence",
                  anchor_batches=2, save=save, stall_s=3.0)  # fmt: skip
    started = time.monotonic()
    try:
        for indices in elche.epoch(0):
            elche.step(nn.functional.mse_loss(model(x[indices]), y[indices]))
            if rank == 1 and elche.window == 1:  # alive, but its round does not come:
                deadline = time.monotonic() + 60  # until rank 0 has stopped with its save
                while not Path(f"{save}.rank0.meta.json").exists():
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
    except CohortStopped as exc:
        return {"stopped": str(exc), "after_s": time.monotonic() - started}
    return {"stopped": None}


def train(
    rank: int,
    mode: str,
    kill: set[int],
    save: str | None,
    how: signal.Signals = signal.SIGKILL,
    stall_s: float = 60.0,
) -> dict[str, object]:
    x, y = data(64 * 32)
    model = net(rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=32, mode=mode,  # type: ignore[arg-type]
                  anchor_batches=2, save=save, stall_s=stall_s)  # fmt: skip
    seen: list[dict[str, object]] = []
    losses: list[float] = []

    def record() -> None:  # (the last round seen, once per window)
        last = elche.last_round
        if last is not None and (not seen or seen[-1]["window"] != elche.window):
            seen.append({"window": elche.window, "counts": list(last.counts),
                         "alive": sorted(elche.alive)})  # fmt: skip

    try:
        for epoch in range(2):
            for n, indices in enumerate(elche.epoch(epoch)):
                loss = nn.functional.mse_loss(model(x[indices]), y[indices])
                losses.append(float(loss.detach()))
                elche.step(loss)
                dies = elche.window == 2 and n > 0 if mode == "cadence" else elche.window == 5
                if rank in kill and dies:
                    os.kill(os.getpid(), how)
                if rank == 1 and elche.window == 2:
                    time.sleep(0.05)  # (a slower rank: the windows' counts differ)
                record()
            record()  # (the epoch's last round runs as its loop ends: after any step)
    except CohortStopped as exc:
        return {"stopped": str(exc)}
    collective = elche.collective
    assert collective is not None
    return {
        "stopped": None,
        "rounds": seen,
        "model": flat(model),
        "reforms": collective.reforms,
        "group": [dist.get_rank(), dist.get_world_size()],
        "first": sum(losses[:6]) / 6,
        "last": sum(losses[-6:]) / 6,
        "windows": elche.window,
    }


def main() -> None:
    out_dir, scenario, kill, *rest = sys.argv[1:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if scenario == "stall":
        result = stall(rank, rest[0])
    elif scenario == "freeze":  # (a host gone without a word: no FIN, no RST)
        result = train(rank, "cadence", {int(kill)}, None, signal.SIGSTOP, stall_s=8.0)
    elif scenario == "minority":
        result = train(rank, "cadence", {1, 2}, rest[0])
    else:
        result = train(rank, scenario, {int(kill)}, None)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # (a peer is gone: torch's teardown would wait for it)


if __name__ == "__main__":
    main()
