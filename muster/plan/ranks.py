"""The rank plan and the exact torchrun command every node runs (seed 001, steps 3 and 5).

Node rank r hosts global ranks [r*P, (r+1)*P) for P processes per node; a world a join
window formed from boxes of different sizes lists each node's count (``node_procs``), and
node r hosts the next that many ranks.
"""

from __future__ import annotations

import bisect
import shlex
from dataclasses import dataclass

from muster.errors import BadRequest
from muster.spec.job import JobSpec


@dataclass(frozen=True)
class NodePlan:
    node_rank: int
    ranks: range

    @property
    def label(self) -> str:
        return f"node{self.node_rank}"


@dataclass(frozen=True)
class RankPlan:
    num_nodes: int
    procs_per_node: int  # the spec's procs_per_worker; nodes[r].ranks says each node's own
    nodes: tuple[NodePlan, ...]

    @property
    def world_size(self) -> int:
        return self.nodes[-1].ranks.stop if self.nodes else 0

    @property
    def uniform(self) -> bool:
        return all(len(n.ranks) == self.procs_per_node for n in self.nodes)

    def node_of(self, global_rank: int) -> int:
        """The node rank that hosts ``global_rank``."""
        if not 0 <= global_rank < self.world_size:
            raise BadRequest(f"rank {global_rank} is outside 0..{self.world_size - 1}")
        starts = [n.ranks.start for n in self.nodes]
        return bisect.bisect_right(starts, global_rank) - 1


def node_procs(spec: JobSpec) -> tuple[int, ...]:
    """Each node's process count, in node order: ``distributed.node_procs`` for a world a
    join window formed from boxes of different sizes, else ``procs_per_worker`` each."""
    gang = spec.gang
    if gang.node_procs:
        return tuple(gang.node_procs)
    return (gang.procs_per_worker,) * gang.num_workers


def rank_plan(spec: JobSpec) -> RankPlan:
    """Node r hosts the next ``node_procs(spec)[r]`` global ranks: contiguous, in node order."""
    nodes, first = [], 0
    for r, count in enumerate(node_procs(spec)):
        nodes.append(NodePlan(r, range(first, first + count)))
        first += count
    return RankPlan(len(nodes), spec.gang.procs_per_worker, tuple(nodes))


def entrypoint_argv(spec: JobSpec) -> list[str]:
    """The script (or ``-m module``) and its arguments, as torchrun takes them."""
    module = spec.module
    head = ["-m", module] if module is not None else [spec.entrypoint.strip()]
    return [*head, *spec.args]


def torchrun_argv(
    spec: JobSpec,
    node_rank: int,
    master_addr: str,
    master_port: int | str,
    python: str = "python",
    capture_dir: str | None = None,
) -> list[str]:
    """The command node ``node_rank`` runs; every node runs the same but for --node-rank.

    With ``capture_dir``, torchrun writes each local rank's stdout and stderr to its own
    files under it (``--log-dir DIR --redirects 3``), so no two ranks' lines ever mix; the
    agent tails those files.
    """
    capture = ["--log-dir", capture_dir, "--redirects", "3"] if capture_dir else []
    gang = spec.gang
    if not 0 <= node_rank < gang.num_workers:
        raise BadRequest(f"node rank {node_rank} is outside 0..{gang.num_workers - 1}")
    procs = node_procs(spec)[node_rank]
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(gang.num_workers),
        "--nproc-per-node",
        str(procs),
        "--node-rank",
        str(node_rank),
        "--master-addr",
        master_addr,
        "--master-port",
        str(master_port),
        "--max-restarts=0",
        *capture,
        *entrypoint_argv(spec),
    ]


def shell_line(argv: list[str]) -> str:
    """The argv as one line a user can paste into a shell."""
    return shlex.join(argv)
