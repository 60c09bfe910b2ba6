"""Printing rank plans and placements the same way for every verb."""

from __future__ import annotations

from rich.console import Console

from muster.plan import rank_plan, shell_line, torchrun_argv
from muster.spec.job import JobSpec


def summary(spec: JobSpec) -> str:
    gang = spec.gang
    plan = rank_plan(spec)
    per_node = (
        f"x {plan.procs_per_node} proc(s)"
        if plan.uniform
        else "(" + " + ".join(str(len(n.ranks)) for n in plan.nodes) + " procs)"
    )
    return (
        f"job {spec.name}: {plan.num_nodes} node(s) {per_node} = "
        f"world size {plan.world_size}, backend {spec.backend}, "
        f"device {spec.resources.effective_device}, network {gang.network}, "
        f"transport {gang.transport}"
    )


def ranks_text(ranks: range) -> str:
    return str(ranks.start) if len(ranks) == 1 else f"{ranks.start}-{ranks.stop - 1}"


def commands(spec: JobSpec, master_addr: str, master_port: str) -> list[tuple[str, str, str]]:
    """(node label, rank range, shell command) for every node."""
    return [
        (
            node.label,
            ranks_text(node.ranks),
            shell_line(torchrun_argv(spec, node.node_rank, master_addr, master_port)),
        )
        for node in rank_plan(spec).nodes
    ]


def print_commands(console: Console, rows: list[tuple[str, str, str]]) -> None:
    """One block per node, the command on its own line so it can be copied whole."""
    for label, ranks, line in rows:
        console.print(f"[bold]{label}[/] (ranks {ranks}):")
        console.print(f"  {line}", markup=False)
