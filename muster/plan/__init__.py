"""Pure launch planning: the rank plan, the torchrun command, and each path's environment."""

from muster.plan.env import (
    MESH_GANGS,
    MESH_MAX_NODES,
    MESH_PREFIX,
    PATH_FIXED_NCCL,
    GangAddressing,
    Shim,
    gang_addressing,
    launch_env,
    mesh_address,
    mesh_gang_of,
)
from muster.plan.ranks import (
    NodePlan,
    RankPlan,
    entrypoint_argv,
    node_procs,
    rank_plan,
    shell_line,
    torchrun_argv,
)

__all__ = [
    "MESH_GANGS",
    "MESH_MAX_NODES",
    "MESH_PREFIX",
    "PATH_FIXED_NCCL",
    "GangAddressing",
    "NodePlan",
    "RankPlan",
    "Shim",
    "entrypoint_argv",
    "gang_addressing",
    "launch_env",
    "mesh_address",
    "mesh_gang_of",
    "node_procs",
    "rank_plan",
    "shell_line",
    "torchrun_argv",
]
