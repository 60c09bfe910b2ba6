"""The environment every rank's torchrun starts with, per gang path (seed 000, DESIGN.md).

Layers, later wins:
  1. the node's own environment (the image's), minus variables muster or torchrun own;
  2. the job's ``env`` (validation already refused the platform-owned keys);
  3. ``OMP_NUM_THREADS=1`` unless the job sets it;
  4. what the path fixes: addressing, interfaces, NCCL_NET / NCCL_SOCKET_IFNAME /
     NCCL_SOCKET_FAMILY / NCCL_IB_DISABLE, and on a relayed path the shim in LD_PRELOAD
     ahead of the image's own.

The user's other NCCL_* values (NCCL_DEBUG, NCCL_ALGO, ...) pass through untouched.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from muster.errors import PlatformError
from muster.plan.ranks import node_procs
from muster.spec.job import JobSpec
from muster.spec.network import PathClass
from muster.spec.rules import PLATFORM_ENV, PLATFORM_ENV_PREFIXES
from muster.spec.worker import UNDECLARED, WorkerInventory

#: First address of the direct path's mesh range (100.64.0.0/10). Gang g (an index the
#: controller allocates among its running direct gangs, so gangs sharing a host never share
#: addresses) owns the /22 at base + g * 1024; its node r is base + g * 1024 + 1 + r.
MESH_BASE = (100 << 24) | (64 << 16)
MESH_PREFIX = 22
MESH_GANG_SIZE = 1 << (32 - MESH_PREFIX)
MESH_GANGS = 1 << (MESH_PREFIX - 10)  # 4,096 direct gangs at once
MESH_MAX_NODES = MESH_GANG_SIZE - 2
#: The direct path's packet size (the WireGuard device's MTU). 1280 (IPv6's minimum) crosses
#: any provider's network and the internet unfragmented (DESIGN.md); inside one declared
#: provider region the usual 1500-byte path carries WireGuard's own default, 1420 (1500 less
#: the 80 bytes of an IPv6 WireGuard header), about 10% more payload per packet. Each agent
#: lowers it further to what its uplink carries (its MTU less 80).
MESH_MTU = 1280
MESH_MTU_REGION = 1420
WIREGUARD_OVERHEAD = 80

#: NCCL variables the path fixes; a job's own value for them is refused at submission.
PATH_FIXED_NCCL = ("NCCL_NET", "NCCL_SOCKET_IFNAME", "NCCL_SOCKET_FAMILY", "NCCL_IB_DISABLE")
#: Where a member's ranks serve their flight recorder (muster.train.flight reads the same name).
DIAG_DIR_ENV = "MUSTER_DIAG_DIR"
#: torch's flight-recorder buffer sizes (the generic name, and NCCL's older one).
FLIGHT_RECORDER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def flight_recorder_on(env: Mapping[str, str]) -> bool:
    """The ranks record their collectives: a flight-recorder buffer of at least one entry."""
    for key in FLIGHT_RECORDER_ENV:
        value = env.get(key, "").strip()
        if value.isdigit() and int(value) > 0:
            return True
    return False


@dataclass(frozen=True)
class GangAddressing:
    """Where each node of a placed gang is reached on its path, and on which interface."""

    path: PathClass
    addresses: tuple[str, ...]  # indexed by node rank
    interfaces: tuple[str | None, ...]  # the interface each node's ranks bind to, if known
    master_port: int

    @property
    def master_addr(self) -> str:
        return self.addresses[0]


@dataclass(frozen=True)
class Shim:
    """The relayed path's preloaded library and the member's local SOCKS endpoint."""

    library: str
    socks: str  # host:port on the member itself


def mesh_address(node_rank: int, gang: int = 0) -> str:
    """The direct path's address of node ``node_rank`` of mesh gang ``gang``."""
    if not 0 <= gang < MESH_GANGS or not 0 <= node_rank < MESH_MAX_NODES:
        raise ValueError(f"no mesh address for node {node_rank} of mesh gang {gang}")
    value = MESH_BASE + gang * MESH_GANG_SIZE + 1 + node_rank
    return ".".join(str((value >> shift) & 0xFF) for shift in (24, 16, 8, 0))


def mesh_gang_of(address: str) -> int:
    """The mesh gang index an address of the direct path belongs to."""
    value = int(ipaddress.IPv4Address(address)) - MESH_BASE
    if not 0 <= value < MESH_GANGS * MESH_GANG_SIZE:
        raise ValueError(f"{address} is not in the direct path's mesh range (100.64.0.0/10)")
    return value // MESH_GANG_SIZE


def mesh_mtu(members: Sequence[WorkerInventory]) -> int:
    """The largest MTU a direct gang's devices may take: WireGuard's 1420 when every member
    declared one and the same provider region (``muster agent --provider --region``), else
    1280. Undeclared ("local") hosts may be anywhere, so they get 1280."""
    places = {(m.provider, m.region) for m in members}
    if len(places) == 1 and UNDECLARED not in next(iter(places)):
        return MESH_MTU_REGION
    return MESH_MTU


def device_mtu(offered: int, uplink_mtu: int | None) -> int:
    """What an agent's device takes of the gang's ``offered`` MTU: no more than its uplink
    carries once WireGuard's header is added (a GCP VPC's 1460 gives 1380), never below
    1280 (the smallest an IPv6 path may have; WireGuard's own floor). An uplink it cannot
    tell (None) gets 1280."""
    if uplink_mtu is None or uplink_mtu <= 0:
        return MESH_MTU
    return max(MESH_MTU, min(offered, uplink_mtu - WIREGUARD_OVERHEAD))


def gang_addressing(
    path: PathClass, members: Sequence[WorkerInventory], master_port: int, mesh: int = 0
) -> GangAddressing:
    """Addresses and interfaces of a gang whose node r is ``members[r]`` (``mesh``: its
    mesh gang index on the direct path).

    A gang of one needs no network: its rendezvous stays on the loopback interface.
    """
    if len(members) == 1:
        return GangAddressing(path, ("127.0.0.1",), ("lo",), master_port)
    if path is PathClass.PRIVATE:
        addresses = tuple(m.network.private_address or m.advertise_address or "" for m in members)
        interfaces = tuple(m.network.private_interface for m in members)
    elif path is PathClass.DIRECT:
        addresses = tuple(mesh_address(r, mesh) for r in range(len(members)))
        interfaces = tuple(m.network.device for m in members)  # each agent's own device
    else:
        addresses = tuple(m.advertise_address or "" for m in members)
        interfaces = tuple(m.network.primary_interface for m in members)
    return GangAddressing(path, addresses, interfaces, master_port)


def _owned_by_platform(key: str) -> bool:
    return key in PLATFORM_ENV or key.startswith(PLATFORM_ENV_PREFIXES)


def launch_env(
    spec: JobSpec,
    node_rank: int,
    gang: GangAddressing,
    *,
    node_env: Mapping[str, str] | None = None,
    shim: Shim | None = None,
    output_dir: str | None = None,
) -> dict[str, str]:
    """The environment node ``node_rank`` starts torchrun with."""
    base = dict(node_env or {})
    image_preload = base.get("LD_PRELOAD", "")
    env = {k: v for k, v in base.items() if not _owned_by_platform(k)}
    env.update(spec.env)
    if "OMP_NUM_THREADS" not in spec.env:
        env["OMP_NUM_THREADS"] = "1"

    master = f"{_host(gang.master_addr)}:{gang.master_port}"
    interface = gang.interfaces[node_rank]
    env.update(
        {
            "MUSTER_GANG_TRANSPORT": gang.path.value,
            "MUSTER_JOB": spec.name,
            "MUSTER_NODE_RANK": str(node_rank),
            "MUSTER_NUM_NODES": str(spec.gang.num_workers),
            "MUSTER_PROCS_PER_NODE": str(node_procs(spec)[node_rank]),
            "MUSTER_NODE_IPS": ",".join(gang.addresses),
            "MASTER_ADDR": gang.master_addr,
            "MASTER_PORT": str(gang.master_port),
            "PET_RDZV_ENDPOINT": master,
            "NCCL_SOCKET_FAMILY": "AF_INET6" if ":" in gang.master_addr else "AF_INET",
        }
    )
    # The path fixes the interface when it knows it (`muster agent --interface`, or the one
    # holding the address); otherwise the machine's own setting, or torch's choice, stands.
    if interface:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = interface
    if gang.path is PathClass.PRIVATE:
        env.pop("NCCL_NET", None)
        env.pop("NCCL_IB_DISABLE", None)
    else:
        env["NCCL_NET"] = "Socket"
        env["NCCL_IB_DISABLE"] = "1"
    if output_dir is not None:
        env["MUSTER_OUTPUT_DIR"] = output_dir

    if gang.path is PathClass.RELAYED:
        if shim is None:
            raise PlatformError("a relayed gang needs the shim's library and SOCKS endpoint")
        own = gang.addresses[node_rank]
        env["LD_PRELOAD"] = ":".join(p for p in (shim.library, image_preload) if p)
        env["MUSTER_NETSHIM_PEERS"] = ",".join(a for a in gang.addresses if a != own)
        env["MUSTER_NETSHIM_SOCKS"] = shim.socks
    return env


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address
