"""The rank plan and the exact torchrun command (seed 001, steps 3 and 5)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from muster.errors import BadRequest
from muster.plan import rank_plan, torchrun_argv
from muster.spec import parse_job


def spec(n: int, p: int, **extra: Any) -> Any:
    return parse_job(
        {
            "name": "j",
            "entrypoint": "train.py",
            "args": ["--lr", "0.1"],
            "distributed": {"num_workers": n, "procs_per_worker": p},
            **extra,
        }
    )


@pytest.mark.parametrize(
    ("n", "p", "expected"),
    [
        (1, 1, [[0]]),
        (2, 2, [[0, 1], [2, 3]]),
        (3, 4, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]),
        (4, 1, [[0], [1], [2], [3]]),
    ],
)
def test_node_r_hosts_ranks_r_times_p(n: int, p: int, expected: list[list[int]]) -> None:
    plan = rank_plan(spec(n, p))
    assert [list(node.ranks) for node in plan.nodes] == expected
    assert plan.world_size == n * p


@given(st.integers(1, 64), st.integers(1, 16))
def test_ranks_partition_the_world(n: int, p: int) -> None:
    plan = rank_plan(spec(n, p))
    every = [r for node in plan.nodes for r in node.ranks]
    assert every == list(range(n * p))
    assert all(plan.node_of(r) == node.node_rank for node in plan.nodes for r in node.ranks)


def test_exact_command() -> None:
    argv = torchrun_argv(spec(2, 2), 1, "10.0.0.1", 29400, python="/usr/bin/python3")
    assert argv == [
        "/usr/bin/python3",
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29400",
        "--max-restarts=0",
        "train.py",
        "--lr",
        "0.1",
    ]


def test_module_entrypoint_command() -> None:
    s = parse_job({"name": "j", "entrypoint": "-m pkg.train", "args": ["x"]})
    assert torchrun_argv(s, 0, "127.0.0.1", 1)[-3:] == ["-m", "pkg.train", "x"]


def test_node_rank_out_of_range() -> None:
    with pytest.raises(BadRequest):
        torchrun_argv(spec(2, 1), 2, "a", 1)


@pytest.mark.parametrize("entrypoint", ["train.py", "-m pkg.train"])
def test_real_torchrun_accepts_the_command(entrypoint: str) -> None:
    """torch's own argument parser reads our argv back to the plan's numbers."""
    run = pytest.importorskip("torch.distributed.run", reason="torch is a test dependency")
    s = parse_job(
        {
            "name": "j",
            "entrypoint": entrypoint,
            "args": ["--lr", "0.1"],
            "distributed": {"num_workers": 3, "procs_per_worker": 2},
        }
    )
    argv = torchrun_argv(s, 2, "10.1.2.3", 29555, capture_dir="/tmp/logs")
    args = run.parse_args(argv[3:])
    assert (args.log_dir, args.redirects) == ("/tmp/logs", "3")
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("3", "2", 2)
    assert (args.master_addr, args.master_port, args.max_restarts) == ("10.1.2.3", 29555, 0)
    assert args.module == (entrypoint != "train.py")
    assert [args.training_script, *args.training_script_args][-2:] == ["--lr", "0.1"]


def test_a_formed_world_of_boxes_of_different_sizes_keeps_ranks_contiguous() -> None:
    """A join window's world: each node runs its own box's count, in admission order."""
    world = spec(3, 1, distributed={"num_workers": 3, "membership": "window"})
    world = world.model_copy(
        update={"distributed": world.gang.model_copy(update={"node_procs": [2, 1, 3]})}
    )
    plan = rank_plan(world)
    assert [list(n.ranks) for n in plan.nodes] == [[0, 1], [2], [3, 4, 5]]
    assert plan.world_size == 6
    assert [plan.node_of(r) for r in range(6)] == [0, 0, 1, 2, 2, 2]
    with pytest.raises(BadRequest):
        plan.node_of(6)
    argv = torchrun_argv(world, 2, "10.0.0.1", 29500)
    assert argv[argv.index("--nproc-per-node") + 1] == "3"


@given(st.lists(st.integers(1, 8), min_size=1, max_size=12))
def test_every_rank_lives_on_exactly_one_node(counts: list[int]) -> None:
    base = spec(len(counts), 1, distributed={"num_workers": len(counts), "membership": "window"})
    world = base.model_copy(
        update={"distributed": base.gang.model_copy(update={"node_procs": counts})}
    )
    plan = rank_plan(world)
    assert plan.world_size == sum(counts)
    for node in plan.nodes:
        assert len(node.ranks) == counts[node.node_rank]
        assert all(plan.node_of(r) == node.node_rank for r in node.ranks)
