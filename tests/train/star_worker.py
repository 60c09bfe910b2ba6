"""Run under torchrun by test_star.py: the star reduce on real ranks, what each saw, as JSON.

argv: OUT_DIR SCENARIO [ARGS], with SCENARIO one of
- invariance: 4 ranks; one round with counts 1..4 and gamma 0.5, with 1, 2 and 4 ranks per
  host (fold depth); the consensus, the expected average, the folds' uplink bytes;
- modes: 2 ranks; sync next to torch DDP on the same batches, then cadence and async with
  rank 1 slower; final parameters, losses;
- kill: 3 ranks on 2 torchrun nodes (ARGS: the node's rank); rank 2 kills itself mid-window;
  the survivors go on: what the rounds accepted;
- stall: 2 ranks; rank 1 sleeps past the stall ceiling in its window: both save and stop;
- resume: 2 ranks, sync; a run straight through, and one saved mid-epoch then resumed;
- async_resume: 2 ranks, async with lookahead 2, rank 1 slower; every rank saves after its
  12th batch (at different windows, rounds in flight) and stops; a second run resumes from
  that and trains on: its losses and final parameters;
- death: 2 ranks; rank 1 raises out of its loop: its death record, rank 0 goes on;
- lost: 2 ranks, the collective backend; rank 1 vanishes: rank 0 stops with a save.
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
from torch.nn.parallel import DistributedDataParallel

from muster.errors import CohortStopped
from muster.train.elche import ElChe
from muster.train.star import StarBackend
from muster.train.starhub import Ceilings

FAST = Ceilings(heartbeat_s=0.5, timeout_s=3.0, stall_s=60.0, idle_s=30.0)


def data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(samples, 16, generator=g)
    return x, x @ torch.randn(16, 1, generator=g)


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def invariance(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    counts = [r + 1 for r in range(world)]
    weights = torch.tensor([c**0.5 for c in counts], dtype=torch.float64)
    weights /= weights.sum()
    expected = sum(w * flat(net(r)).double() for r, w in enumerate(weights.tolist()))
    for per_host in (1, 2, 4):
        model = net(rank)
        hosts = [r // per_host for r in range(world)]
        backend = StarBackend(model, None, ceilings=FAST, hosts=hosts)
        side = torch.zeros(world, dtype=torch.float64)
        side[rank] = float(rank * 10)
        result = backend.round(model, counts[rank], 0.5, side, window=0)
        fold = backend.star.fold
        out[str(per_host)] = {
            "consensus": flat(model).tolist(),
            "side": side.tolist(),
            "realized": result.realized,
            "weight": result.weight,
            "uplink": fold.uplink_sent if fold is not None else None,
            "model_bytes": flat(model).numel() * 4,
        }
        backend.close()
    out["expected"] = expected.tolist()
    return out


def modes(rank: int, world: int) -> dict[str, object]:
    x, y = data(24 * 32)
    out: dict[str, object] = {}
    # sync through the star == torch DDP on the same batches (AdamW)
    reference = net(0)
    ddp = DistributedDataParallel(reference)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    model = net(rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=32, mode="sync",
                  backend="star", heartbeat_s=0.5, timeout_s=3.0, shuffle=False)  # fmt: skip
    for indices in elche.epoch(0):
        elche.step(nn.functional.mse_loss(model(x[indices]), y[indices]))
        ddp_opt.zero_grad()
        nn.functional.mse_loss(ddp(x[indices]), y[indices]).backward()  # type: ignore[no-untyped-call]
        ddp_opt.step()
    out["sync_gap"] = float((flat(model) - flat(reference)).abs().max())
    elche.close()
    for mode in ("cadence", "async"):
        model = net(rank)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=32, mode=mode,
                      backend="star", anchor_batches=2, heartbeat_s=0.5,
                      timeout_s=3.0)  # fmt: skip
        losses = []
        counts: dict[tuple[int, int], list[int]] = {}  # (epoch, window): its counts
        for epoch in range(3):
            for indices in elche.epoch(epoch):
                t0 = time.perf_counter()
                loss = nn.functional.mse_loss(model(x[indices]), y[indices])
                elche.step(loss)
                losses.append(float(loss))
                if rank == 1:
                    time.sleep(2 * (time.perf_counter() - t0) + 0.004)
                counts[epoch, elche.window] = list(elche.counts)
        out[mode] = {
            "first": sum(losses[:4]) / 4,
            "last": sum(losses[-4:]) / 4,
            "params": flat(model).tolist(),
            "windows": elche.window,
            # every window's counts summed per rank (an epoch's last window alone may be
            # cut to [1, 1] by the batches left)
            "counts": [sum(c[r] for c in counts.values()) for r in range(world)],
        }
        elche.close()
    return out


def kill(rank: int, world: int) -> dict[str, object]:
    x, y = data(64 * 32)
    model = net(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=32, mode="cadence",
                  backend="star", anchor_batches=2, heartbeat_s=0.5, timeout_s=3.0)  # fmt: skip
    seen: list[dict[str, object]] = []
    for epoch in range(2):
        for n, indices in enumerate(elche.epoch(epoch)):
            elche.step(nn.functional.mse_loss(model(x[indices]), y[indices]))
            if rank == 2 and elche.window == 2 and n > 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if elche.last_round is not None and (not seen or seen[-1]["window"] != elche.window):
                seen.append({"window": elche.window, "counts": list(elche.last_round.counts),
                             "alive": sorted(elche.alive)})  # fmt: skip
    out = {"rounds": seen, "params": flat(model).tolist(), "dead": elche.star.dead}  # type: ignore[union-attr]
    elche.close()
    return out


def stall(rank: int, world: int, save: str) -> dict[str, object]:
    x, y = data(16 * 32)
    model = net(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=32, mode="cadence",
                  backend="star", anchor_batches=2, heartbeat_s=0.5, timeout_s=3.0,
                  stall_s=3.0, save=save)  # fmt: skip
    started = time.monotonic()
    try:
        for indices in elche.epoch(0):
            elche.step(nn.functional.mse_loss(model(x[indices]), y[indices]))
            if rank == 1 and elche.window == 1:
                time.sleep(8)  # (alive: its heartbeats go on; its round does not come)
        return {"stopped": None}
    except CohortStopped as exc:
        return {"stopped": str(exc), "after_s": time.monotonic() - started}
    finally:
        elche.close()


def resume(rank: int, world: int, save: str) -> dict[str, object]:
    x, y = data(20 * 32)

    def run(stop_at: int | None, resume_from: str | None) -> list[float]:
        model = net(rank)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=32, mode="sync",
                      backend="star", heartbeat_s=0.5, timeout_s=3.0, save=save,
                      resume=resume_from)  # fmt: skip
        step = elche.batches_run
        for epoch in range(elche.start_epoch, 2):
            for indices in elche.epoch(epoch):
                elche.step(nn.functional.mse_loss(model(x[indices]), y[indices]))
                step += 1
                if step == stop_at:
                    elche.save("a test's stop")
                    break
            if step == stop_at:
                break
        elche.close()
        return flat(model).tolist()

    straight = run(None, None)
    at_save = run(13, None)
    resumed = run(None, save)
    return {"straight": straight, "at_save": at_save, "resumed": resumed}


def async_resume(rank: int, world: int, save: str) -> dict[str, object]:
    x, y = data(40 * 32)

    def run(stop_at: int | None, resume_from: str | None) -> dict[str, object]:
        model = net(rank)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=32, mode="async",
                      backend="star", anchor_batches=2, lookahead=2, heartbeat_s=0.5,
                      timeout_s=3.0, save=save, resume=resume_from)  # fmt: skip
        start = (elche.start_epoch, elche.window)
        losses: list[float] = []
        for epoch in range(elche.start_epoch, 3):
            for indices in elche.epoch(epoch):
                t0 = time.perf_counter()
                loss = nn.functional.mse_loss(model(x[indices]), y[indices])
                elche.step(loss)
                losses.append(float(loss.detach()))
                if rank == 1:
                    time.sleep(2 * (time.perf_counter() - t0) + 0.004)
                if len(losses) == stop_at:
                    elche.save("a test's stop")
                    break
            if len(losses) == stop_at:
                break
        window = elche.window
        elche.close()
        return {"losses": losses, "params": flat(model).tolist(), "start": start,
                "window": window}  # fmt: skip

    first = run(12, None)
    second = run(None, save)
    return {"first": first, "second": second}


def death(rank: int, world: int, save: str) -> dict[str, object]:
    x, y = data(16 * 32)
    model = net(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=32, mode="cadence",
                  backend="star", anchor_batches=2, heartbeat_s=0.5, timeout_s=3.0,
                  save=save)  # fmt: skip
    windows = 0
    for epoch in range(2):
        for indices in elche.epoch(epoch):
            elche.step(nn.functional.mse_loss(model(x[indices]), y[indices]))
            if rank == 1 and elche.window == 2:
                raise RuntimeError("a rank's own bug")
        windows = elche.window
    out = {"windows": windows, "alive": sorted(elche.alive)}
    elche.close()
    return out


def lost(rank: int, world: int, save: str) -> dict[str, object]:
    """The collective backend: rank 1 leaves mid-epoch; rank 0's next collective fails and
    it stops with a save."""
    x, y = data(16 * 32)
    model = net(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    elche = ElChe(model, optimizer, dataset_size=len(x), batch_size=32, mode="cadence",
                  anchor_batches=2, save=save)  # fmt: skip
    try:
        for indices in elche.epoch(0):
            elche.step(nn.functional.mse_loss(model(x[indices]), y[indices]))
            if rank == 1 and elche.window == 1:
                os._exit(0)  # (gone, without a word to its peers)
    except CohortStopped as exc:
        return {"stopped": str(exc)}
    return {"stopped": None}


def main() -> None:
    out_dir, scenario, *args = sys.argv[1:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {
        "invariance": lambda: invariance(rank, world),
        "modes": lambda: modes(rank, world),
        "kill": lambda: kill(rank, world),
        "stall": lambda: stall(rank, world, *args),
        "resume": lambda: resume(rank, world, *args),
        "death": lambda: death(rank, world, *args),
        "async_resume": lambda: async_resume(rank, world, *args),
        "lost": lambda: lost(rank, world, *args),
    }
    result = runs[scenario]()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if scenario in ("kill", "death", "lost"):
        os._exit(0)  # (a peer is gone: the process group's teardown would wait for it)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
