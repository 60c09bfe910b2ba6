"""The per-path environment table of DESIGN.md, row by row."""

from __future__ import annotations

from typing import Any

import pytest

from muster.errors import PlatformError
from muster.plan import (
    GangAddressing,
    Shim,
    device_mtu,
    gang_addressing,
    launch_env,
    mesh_address,
    mesh_mtu,
)
from muster.spec import NetworkCaps, PathClass, WorkerInventory, parse_job

MEMBERS = [
    WorkerInventory(
        id=f"w{i}",
        hostname=f"h{i}",
        advertise_address=f"203.0.113.{10 + i}",
        network=NetworkCaps(
            private_network_id="vpc",
            private_address=f"10.0.0.{i + 1}",
            private_interface="ens5",
            primary_interface="eth0",
        ),
    )
    for i in range(3)
]
SHIM = Shim(library="/opt/muster/libmuster-netshim.so", socks="127.0.0.1:1080")


def job(**extra: Any) -> Any:
    return parse_job(
        {
            "name": "j",
            "entrypoint": "t.py",
            "distributed": {"num_workers": 3, "procs_per_worker": 2, "transport": "auto"},
            **extra,
        }
    )


def env_for(path: PathClass, node: int = 1, **kw: Any) -> dict[str, str]:
    gang = gang_addressing(path, MEMBERS, 29500)
    shim = SHIM if path is PathClass.RELAYED else None
    return launch_env(kw.pop("spec", job()), node, gang, shim=shim, **kw)


TABLE = [
    # path, MASTER_ADDR, MUSTER_NODE_IPS, interface
    (PathClass.PRIVATE, "10.0.0.1", "10.0.0.1,10.0.0.2,10.0.0.3", "ens5"),
    (PathClass.DIRECT, "100.64.0.1", "100.64.0.1,100.64.0.2,100.64.0.3", "muster0"),
    (PathClass.RELAYED, "203.0.113.10", "203.0.113.10,203.0.113.11,203.0.113.12", "eth0"),
]


@pytest.mark.parametrize(("path", "master", "ips", "iface"), TABLE, ids=[t[0].value for t in TABLE])
def test_path_rows(path: PathClass, master: str, ips: str, iface: str) -> None:
    env = env_for(path)
    assert env["MUSTER_GANG_TRANSPORT"] == path.value
    assert env["MASTER_ADDR"] == master
    assert env["PET_RDZV_ENDPOINT"] == f"{master}:29500"
    assert env["MUSTER_NODE_IPS"] == ips
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == iface
    assert env["MUSTER_NODE_RANK"] == "1"
    relayed = path is PathClass.RELAYED
    assert ("LD_PRELOAD" in env) is relayed
    assert ("MUSTER_NETSHIM_PEERS" in env) is relayed
    assert ("MUSTER_NETSHIM_SOCKS" in env) is relayed


def test_relayed_shim_goes_first_and_peers_exclude_self() -> None:
    env = env_for(PathClass.RELAYED, node=1, node_env={"LD_PRELOAD": "/usr/lib/libjemalloc.so"})
    assert env["LD_PRELOAD"] == f"{SHIM.library}:/usr/lib/libjemalloc.so"
    assert env["MUSTER_NETSHIM_PEERS"] == "203.0.113.10,203.0.113.12"
    assert env["MUSTER_NETSHIM_SOCKS"] == "127.0.0.1:1080"


def test_image_ld_preload_kept_on_other_paths() -> None:
    env = env_for(PathClass.DIRECT, node_env={"LD_PRELOAD": "libtcmalloc.so"})
    assert env["LD_PRELOAD"] == "libtcmalloc.so"


def test_relayed_without_shim_is_refused() -> None:
    with pytest.raises(PlatformError):
        launch_env(job(), 0, gang_addressing(PathClass.RELAYED, MEMBERS, 1))


def test_user_nccl_wins_but_path_fixes_four() -> None:
    spec = job(env={"NCCL_DEBUG": "INFO", "NCCL_ALGO": "Ring"})
    image = {
        "NCCL_NET": "IB",
        "NCCL_SOCKET_IFNAME": "ib0",
        "NCCL_IB_DISABLE": "0",
        "NCCL_SOCKET_FAMILY": "AF_INET6",
        "NCCL_DEBUG": "WARN",
    }
    env = env_for(PathClass.DIRECT, spec=spec, node_env=image)
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["NCCL_ALGO"] == "Ring"
    assert (env["NCCL_NET"], env["NCCL_IB_DISABLE"]) == ("Socket", "1")
    assert (env["NCCL_SOCKET_IFNAME"], env["NCCL_SOCKET_FAMILY"]) == ("muster0", "AF_INET")
    private = env_for(PathClass.PRIVATE, spec=spec, node_env=image)
    assert "NCCL_NET" not in private
    assert "NCCL_IB_DISABLE" not in private
    assert private["NCCL_SOCKET_IFNAME"] == "ens5"


def test_omp_threads_default_and_override() -> None:
    assert env_for(PathClass.DIRECT, node_env={"OMP_NUM_THREADS": "32"})["OMP_NUM_THREADS"] == "1"
    assert (
        env_for(PathClass.DIRECT, spec=job(env={"OMP_NUM_THREADS": "4"}))["OMP_NUM_THREADS"] == "4"
    )


def test_node_env_platform_keys_do_not_leak() -> None:
    env = env_for(
        PathClass.DIRECT,
        node_env={"RANK": "7", "PET_NNODES": "9", "MUSTER_X": "1", "PATH": "/usr/bin"},
    )
    assert "RANK" not in env
    assert "PET_NNODES" not in env
    assert "MUSTER_X" not in env
    assert env["PATH"] == "/usr/bin"


def test_output_dir_exported() -> None:
    assert env_for(PathClass.DIRECT, output_dir="/run/j/out")["MUSTER_OUTPUT_DIR"] == "/run/j/out"


def test_single_node_uses_loopback() -> None:
    gang = gang_addressing(PathClass.PRIVATE, MEMBERS[:1], 29500)
    assert gang.addresses == ("127.0.0.1",)
    assert gang.interfaces == ("lo",)


def test_ipv6_master_is_bracketed() -> None:
    members = [
        m.model_copy(update={"advertise_address": f"2001:db8::{i + 1}"})
        for i, m in enumerate(MEMBERS)
    ]
    env = launch_env(job(), 0, gang_addressing(PathClass.RELAYED, members, 29500), shim=SHIM)
    assert env["PET_RDZV_ENDPOINT"] == "[2001:db8::1]:29500"
    assert env["NCCL_SOCKET_FAMILY"] == "AF_INET6"


def test_mesh_addresses() -> None:
    assert [mesh_address(r) for r in (0, 1, 254, 255)] == [
        "100.64.0.1",
        "100.64.0.2",
        "100.64.0.255",
        "100.64.1.0",
    ]


def test_the_agents_interface_is_what_the_ranks_bind_and_secrets_never_reach_them() -> None:
    """`muster agent --interface ens7` reaches NCCL and gloo; with no interface known
    (a NAT's address) nothing is invented (the literal eth0 fallback is gone)."""
    spec = parse_job({"name": "j", "entrypoint": "t.py", "distributed": {"num_workers": 2}})
    node_env = {
        "MUSTER_TOKEN": "join-secret",
        "MUSTER_API_TOKEN": "api-secret",
        "PATH": "/usr/bin",
    }
    known = GangAddressing(PathClass.PRIVATE, ("10.0.0.1", "10.0.0.2"), ("ens7", "ens7"), 29500)
    env = launch_env(spec, 1, known, node_env=node_env)
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "ens7"
    assert "join-secret" not in env.values()
    assert "api-secret" not in env.values()
    assert env["PATH"] == "/usr/bin"
    unknown = GangAddressing(PathClass.PRIVATE, ("10.0.0.1", "10.0.0.2"), (None, None), 29500)
    env = launch_env(spec, 1, unknown, node_env=node_env)
    assert "NCCL_SOCKET_IFNAME" not in env
    assert "GLOO_SOCKET_IFNAME" not in env


def test_on_the_direct_path_each_rank_binds_its_own_agents_device() -> None:
    """Two agents on one host claim two device names (muster0, muster1): the ranks of each
    member bind the device their own agent made."""
    members = [
        m.model_copy(update={"network": m.network.model_copy(update={"device": f"muster{i}"})})
        for i, m in enumerate(MEMBERS)
    ]
    gang = gang_addressing(PathClass.DIRECT, members, 29500)
    assert gang.interfaces == ("muster0", "muster1", "muster2")
    env = launch_env(job(), 1, gang)
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "muster1"


def test_each_node_is_told_its_own_process_count_in_a_mixed_world() -> None:
    base = parse_job(
        {
            "name": "j",
            "entrypoint": "t.py",
            "distributed": {"num_workers": 3, "membership": "window", "node_procs": [2, 1, 4]},
        }
    )
    counts = [
        env_for(PathClass.PRIVATE, node=n, spec=base)["MUSTER_PROCS_PER_NODE"] for n in range(3)
    ]
    assert counts == ["2", "1", "4"]


def placed(*where: tuple[str, str]) -> list[WorkerInventory]:
    return [
        WorkerInventory(id=f"w{i}", hostname=f"h{i}", provider=provider, region=region)
        for i, (provider, region) in enumerate(where)
    ]


def test_the_direct_paths_packets_are_larger_only_inside_one_declared_region() -> None:
    assert mesh_mtu(placed(("aws", "us-east-1"), ("aws", "us-east-1"))) == 1420
    assert mesh_mtu(placed(("aws", "us-east-1"), ("aws", "us-west-2"))) == 1280
    assert mesh_mtu(placed(("aws", "us-east-1"), ("gcp", "us-east-1"))) == 1280
    # Undeclared hosts may be anywhere: the size that crosses any network.
    assert mesh_mtu(placed(("local", "local"), ("local", "local"))) == 1280
    assert mesh_mtu(placed(("aws", "local"), ("aws", "local"))) == 1280


def test_each_device_fits_its_own_uplink() -> None:
    assert device_mtu(1420, 1500) == 1420
    assert device_mtu(1420, 9001) == 1420  # a jumbo-frame VPC: still WireGuard's default
    assert device_mtu(1420, 1460) == 1380  # a GCP VPC's default MTU
    assert device_mtu(1420, 1300) == 1280  # never below IPv6's minimum
    assert device_mtu(1280, 1500) == 1280
    assert device_mtu(1420, None) == 1280  # an uplink it cannot tell: the safe size
