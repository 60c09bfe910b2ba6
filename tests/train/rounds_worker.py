"""Run under torchrun by test_collective.py: averaging rounds on gloo, results as JSON."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from muster.train.collective import average_round


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.norm = nn.BatchNorm1d(2)  # float running stats and an integer counter


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, object] = {"rank": rank}
    net = Net()
    for p in net.parameters():
        torch.nn.init.constant_(p, float(rank + 1))  # rank 0 holds 1s, rank 1 holds 2s
    net.norm.running_mean.fill_(10.0 * (rank + 1))
    net.norm.num_batches_tracked.fill_(rank + 5)

    batches = [3, 1][rank]  # rank 0 realized 3 batches, rank 1 one
    result = average_round(net, batches, gamma=1.0)
    out["weighted"] = net.linear.weight.flatten().tolist()
    out["running_mean"] = net.norm.running_mean.tolist()
    out["num_batches_tracked"] = int(net.norm.num_batches_tracked)
    out["collectives"] = [result.collectives]

    # A rank with zero batches does not move the average: rank 1 idles.
    for p in net.parameters():
        torch.nn.init.constant_(p, float(rank + 1))
    result = average_round(net, [4, 0][rank], gamma=0.0)
    out["zero_rank"] = net.linear.weight.flatten().tolist()
    out["collectives"].append(result.collectives)

    # The whole cohort idle: one collective, everyone keeps its own state.
    for p in net.parameters():
        torch.nn.init.constant_(p, float(rank + 1))
    result = average_round(net, 0, gamma=0.0)
    out["idle"] = net.linear.weight.flatten().tolist()
    out["idle_realized"] = result.realized
    out["collectives"].append(result.collectives)

    # A model without float buffers needs no buffer round.
    plain = nn.Linear(2, 2)
    result = average_round(plain, 2)
    out["collectives"].append(result.collectives)

    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)
    dist.barrier()  # no rank tears the group down while a peer still uses it
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not the interpreter's teardown: gloo sometimes aborts there


if __name__ == "__main__":
    main()
