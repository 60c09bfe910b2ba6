"""The star reduce against gloo's all_reduce, its host uplink and its root's memory.

1. Time: one 64 MiB f32 reduce (the sum, divided once) through the star, against gloo's
   all_reduce of the same tensor on the same ranks, 2 and 4 ranks under torchrun on this
   machine, interleaved, median of the slowest rank per repetition. The star runs two or
   three ways: every rank on one host (one fold, in rank 0's process beside the root), every
   rank a host of its own (a fold per rank, each with its own uplink to the root), and at 4
   ranks two hosts of two (a fold per pair). Each is printed with the ratio a network
   would allow if each host's link were the bound (``link_bound``): on one machine the
   "links" are loopback, so the measured ratio is CPU's, not the network's.
2. Uplink: the bytes a fold sends its root for one 16 MiB reduce with 1, 2 and 4 local ranks,
   over the model's bytes (goal 1x: the fold sums before it sends).
3. Root memory: a root alone in its own process, 4 hosts each sending 64 MiB contributions
   from processes of their own, 3 reduces; the growth of the root's peak RSS over the model's
   bytes (goal <= 2x; a root that gathered every contribution first would hold 4x).

    .venv/bin/python bench/star.py [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20
SALT = b"b" * 32


def layouts(world: int) -> dict[str, list[int]]:
    """The star's arms: each rank's host, by arm name."""
    arms = {"one host": [0] * world, "a host per rank": list(range(world))}
    if world >= 4 and world % 2 == 0:
        arms["two hosts"] = [r * 2 // world for r in range(world)]
    return arms


def link_bound(hosts: list[int]) -> float | None:
    """The star's time over a ring all_reduce's where each host's link is the bound (None on
    one host: no link). A ring ordered by host sends 2(n-1)/n of the model each way over each
    host's link; the star's root host receives and sends the model once for every other
    host. So a host per rank costs n/2 (2x at 4 ranks) whatever the code, and a fold of
    several ranks per host can beat the ring (2 hosts of 2: 0.67x). Against an all_reduce
    that is itself hierarchical (2(h-1)/h of the model over each host's link) the root host
    costs h/2 however its ranks fold: the star trades the root's link for one round trip."""
    n, h = len(hosts), len(set(hosts))
    return None if h == 1 else (h - 1) / (2 * (n - 1) / n)


def worker(out: str, reps: int) -> None:
    import torch
    import torch.distributed as dist

    from muster.train.star import form
    from muster.train.starhub import Ceilings

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 64 * MIB // 4
    values = torch.full((n,), float(rank + 1))
    target = torch.empty(n)
    ceilings = Ceilings(heartbeat_s=2.0, timeout_s=60.0)
    stars = {name: form(None, ceilings, hosts=hosts) for name, hosts in layouts(world).items()}
    times: dict[str, list[float]] = {"gloo": [], **{k: [] for k in stars}}
    expected = sum(range(1, world + 1)) / world

    def timed(run: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        run()
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's
        return float(took)

    for _ in range(reps + 1):  # (the first repetition warms up; it is dropped)
        for name in times:
            if name == "gloo":
                buf = values.clone()
                times[name].append(timed(lambda buf=buf: dist.all_reduce(buf)))
                assert float(buf[0]) == sum(range(1, world + 1))
            else:
                client = stars[name].client
                times[name].append(
                    timed(lambda c=client: c.submit("param", values, n, 1.0, target).wait())
                )
                assert abs(float(target[0]) - expected) < 1e-5
    for star in stars.values():
        star.close()
    if rank == 0:
        Path(out).write_text(json.dumps({k: v[1:] for k, v in times.items()}))
    dist.destroy_process_group()
    os._exit(0)


def uplink(local: int) -> float:
    """Bytes a fold sends up for one 16 MiB reduce, over 16 MiB."""
    import torch

    from muster.train.star import StarClient
    from muster.train.starhub import Ceilings, Hub

    ceilings = Ceilings(heartbeat_s=2.0, timeout_s=60.0)
    ranks = set(range(local))
    root = Hub(name="root", salt=SALT, ranks=ranks, bind="127.0.0.1", ceilings=ceilings)
    fold = Hub(name="fold", salt=SALT, ranks=ranks, bind="127.0.0.1", ceilings=ceilings,
               parent=("127.0.0.1", root.address[1]))  # fmt: skip
    fold.connect_parent(*root.address)
    clients = [StarClient(r, fold.address, SALT, ceilings, "f32") for r in range(local)]
    fold.wait_joined()
    root.wait_joined()
    n = 16 * MIB // 4
    results: list[Any] = []

    def run(client: StarClient) -> None:
        results.append(client.submit("param", torch.ones(n), n, 1.0, torch.empty(n)).wait())

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent = fold.uplink_sent
    for c in clients:
        c.close()
    fold.close()
    root.close()
    return sent / (n * 4)


def _root_process(port_out: Any, result_out: Any, hosts: int, rounds: int) -> None:
    import psutil
    import torch  # noqa: F401  (imported before the baseline, as in a rank)

    from muster.train.starhub import Ceilings, Hub

    root = Hub(name="root", salt=SALT, ranks=set(range(hosts)), bind="127.0.0.1",
               ceilings=Ceilings(heartbeat_s=2.0, timeout_s=60.0))  # fmt: skip
    me = psutil.Process()
    base = me.memory_info().rss  # (torch imported, the hub listening: what a rank has anyway)
    peak = base
    port_out.put(root.address[1])
    root.wait_joined()
    while root.op.number < rounds:  # sampled every 2 ms while the reduces run
        peak = max(peak, me.memory_info().rss)
        time.sleep(0.002)
    result_out.put(peak - base)
    time.sleep(1.0)
    root.close()


def _host_process(port: int, rank: int, rounds: int, mib: int) -> None:
    import torch

    from muster.train.star import StarClient
    from muster.train.starhub import Ceilings

    n = mib * MIB // 4
    client = StarClient(rank, ("127.0.0.1", port), SALT, Ceilings(2.0, 60.0), "f32")
    values, target = torch.full((n,), 1.0), torch.empty(n)
    for _ in range(rounds):
        client.submit("param", values, n, 1.0, target).wait()
    client.close()


def root_memory(hosts: int = 4, rounds: int = 3, mib: int = 64) -> float:
    ctx = multiprocessing.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    root = ctx.Process(target=_root_process, args=(ports, results, hosts, rounds))
    root.start()
    port = ports.get(timeout=60)
    clients = [ctx.Process(target=_host_process, args=(port, r, rounds, mib)) for r in range(hosts)]
    for c in clients:
        c.start()
    grown = results.get(timeout=300)
    for c in clients:
        c.join(timeout=60)
    root.join(timeout=60)
    return float(grown) / (mib * MIB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.reps)
        return
    from muster.cli.local import local_torchrun

    print("64 MiB f32 reduce, slowest rank, median of", args.reps)
    for world in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "times.json"
            cmd = local_torchrun(os.path.abspath(__file__), "--reps", str(args.reps),
                                 "--worker", str(out), nproc=world)  # fmt: skip
            env = dict(os.environ, OMP_NUM_THREADS="1")
            subprocess.run(cmd, check=True, env=env, timeout=900)
            times = json.loads(out.read_text())
        gloo = statistics.median(times.pop("gloo"))
        print(f"  {world} ranks: gloo all_reduce {gloo * 1e3:.0f} ms")
        arms = layouts(world)
        for name, got in times.items():
            star = statistics.median(got)
            bound = link_bound(arms[name])
            ideal = "no link" if bound is None else f"{bound:.2f}x"
            print(f"    star, {name}: {star * 1e3:.0f} ms = {star / gloo:.2f}x gloo "
                  f"(goal <= 1.5; link-bound ideal {ideal})")  # fmt: skip
    print("host uplink per reduce, over the model's bytes (goal 1x):")
    for local in (1, 2, 4):
        print(f"  {local} local ranks: {uplink(local):.4f}x")
    grown = root_memory()
    print(f"root peak memory growth, 4 hosts x 64 MiB: {grown:.2f}x the model (goal <= 2)")


if __name__ == "__main__":
    main()
