"""Job spec, worker inventory, lifecycle states and their validation. Pure but for YAML reads."""

from muster.spec.cluster import ClusterFile
from muster.spec.job import Distributed, JobSpec, Rendezvous, Resources, parse_duration
from muster.spec.loader import (
    first_problems,
    load_cluster_file,
    load_inventory_file,
    load_job_file,
    load_stored_job,
    parse_cluster,
    parse_job,
    parse_model,
)
from muster.spec.network import MESH_INTERFACE, NetworkClass, PathClass, Transport
from muster.spec.states import JobState, MemberState, WorkerState
from muster.spec.worker import Gpus, NetworkCaps, WorkerInventory, WorkerView

__all__ = [
    "MESH_INTERFACE",
    "ClusterFile",
    "Distributed",
    "Gpus",
    "JobSpec",
    "JobState",
    "MemberState",
    "NetworkCaps",
    "NetworkClass",
    "PathClass",
    "Rendezvous",
    "Resources",
    "Transport",
    "WorkerInventory",
    "WorkerState",
    "WorkerView",
    "first_problems",
    "load_cluster_file",
    "load_inventory_file",
    "load_job_file",
    "load_stored_job",
    "parse_cluster",
    "parse_duration",
    "parse_job",
    "parse_model",
]
