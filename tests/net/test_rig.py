"""The multi-host rig itself: each shape is what it claims, and real agents run a job on it."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.net.conftest import needs
from tests.net.rig import Rig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def test_one_region_hosts_reach_each_other_by_name_with_private_mounts(rig: Rig) -> None:
    h1, h2 = rig.one_region(2)
    assert rig.reaches(h1, h2.address)
    assert rig.reaches(h2, h1.address)
    assert rig.reaches(h1, "h2")  # each host's /etc/hosts names the others
    # Each host has its own /run/wireguard (wireguard-go's sockets would collide otherwise).
    rig.run(h1, "touch", "/run/wireguard/muster0.sock")
    assert rig.run(h1, "ls", "/run/wireguard").stdout.split() == ["muster0.sock"]
    assert rig.run(h2, "ls", "/run/wireguard").stdout.split() == []
    assert not Path("/run/wireguard/muster0.sock").exists()  # nor the machine's own
    # The hosts see only their own interfaces: lo and eth0.
    links = rig.run(h1, "ip", "-o", "link", "show").stdout
    assert sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()) == [
        "eth0",
        "lo",
    ]


def test_two_regions_are_joined_by_a_router(rig: Rig) -> None:
    h1, h2 = rig.two_regions(2)
    assert h1.address.startswith("10.77.1.")
    assert h2.address.startswith("10.77.2.")
    assert rig.reaches(h1, h2.address)
    route = rig.run(h1, "ip", "route", "get", h2.address).stdout
    assert "via 10.77.1.1" in route, route


def test_hosts_behind_nats_reach_the_controller_but_not_each_other(rig: Rig) -> None:
    needs("nft")
    h1, h2 = rig.behind_nats(2)
    ctl = rig.hosts["ctl"]
    assert rig.reaches(h1, ctl.address)
    assert rig.reaches(h2, ctl.address)
    assert not rig.reaches(h1, h2.address)
    assert not rig.reaches(h2, h1.address)
    # Nothing comes in that the host did not open: ctl cannot reach a host's private address,
    # nor open a connection to its NAT's public one.
    assert not rig.reaches(ctl, h1.address)
    # The controller sees h1 as its NAT router's public address (masquerade).
    server = subprocess.Popen(
        ctl_argv := ctl.argv(
            [
                "python3",
                "-c",
                "import socket; s = socket.create_server(('0.0.0.0', 7071)); "
                "c, peer = s.accept(); print(peer[0], flush=True)",
            ]
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            dialled = rig.run(
                h1,
                "python3",
                "-c",
                f"import socket; socket.create_connection(('{ctl.address}', 7071), 1)",
                check=False,
            )
            if dialled.returncode == 0:
                break
            time.sleep(0.1)
        out, _ = server.communicate(timeout=10)
    finally:
        server.kill()
    assert out.strip() == "203.0.113.101", (ctl_argv, out)


def test_container_only_host_has_no_tun_and_no_net_admin(rig: Rig) -> None:
    h1, h2 = rig.one_region(2, container_only=["h2"])
    veth = ("ip", "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
    refused = rig.run(h2, *veth, check=False)
    assert refused.returncode != 0
    assert "not permitted" in refused.stderr.lower()
    assert rig.run(h2, "test", "-e", "/dev/net/tun", check=False).returncode != 0
    # The ordinary host can do both (a TUN device is what wireguard-go makes).
    assert rig.run(h1, *veth, check=False).returncode == 0
    if Path("/dev/net/tun").exists():
        tun = rig.run(h1, "ip", "tuntap", "add", "dev", "probe2", "mode", "tun", check=False)
        assert tun.returncode == 0, tun.stderr
    # The container-only host still talks on the network.
    assert rig.reaches(h2, h1.address)


def test_real_agents_on_rig_hosts_run_a_two_node_job(rig: Rig) -> None:
    h1, h2 = rig.one_region(2)
    ctl = rig.start_cluster((h1, h2))
    workers = {w["id"]: w for w in rig.api("workers")}
    assert workers["h1"]["advertise_address"] == h1.address
    assert workers["h2"]["advertise_address"] == h2.address

    job_id = rig.muster(ctl, "submit", str(ROOT / "examples/ddp/job.yaml")).strip()
    job = rig.wait_done(job_id, timeout=180)
    assert job["state"] == "succeeded", job["root_cause"]
    members = {m["node_rank"]: m for m in job["members"]}
    assert {members[0]["worker"], members[1]["worker"]} == {"h1", "h2"}
    # The probe proved the private path before the command started.
    probe = next(e for e in job["events"] if e["kind"] == "Probe")
    assert probe["data"]["path"] == "private"
    assert [(p["a"], p["b"]) for p in probe["data"]["pairs"]] == [(0, 1)]
    assert probe["data"]["slowest"]["tcpGbps"] > 0.1  # a veth: many Gbit/s
    described = rig.muster(ctl, "describe", job_id)
    assert "condition NetworkQualified=True (ProbePassed)" in described, described
    assert "node0-node1" in described, described
    # Node 0's rendezvous address is its host's address on the rig, not loopback.
    node0 = rig.hosts[members[0]["worker"]]
    published = [e for e in job["events"] if e["kind"] == "RendezvousPublished"]
    assert published, job["events"]
    assert node0.address in published[0]["message"], published
    lines = rig.api("logs", job_id)["lines"]  # ~100 lines: one page
    for rank in range(4):
        mine = [ln["text"] for ln in lines if ln["origin"] == "rank" and ln["rank"] == rank]
        assert "all_reduce sum=10 expected=10 ok" in mine, f"rank {rank}: {mine[:5]}"


def test_a_private_path_the_probe_cannot_cross_fails_before_the_command(rig: Rig) -> None:
    """h2 drops every TCP connection from h1: the probe finds it, names the pair, and no
    rank ever starts."""
    needs("nft")
    h1, h2 = rig.one_region(2)
    rig.nft(
        h2,
        "table ip rig_block {\n"
        f"  chain input {{ type filter hook input priority -10; ip saddr {h1.address} "
        "meta l4proto tcp drop; }\n"
        "}\n",
    )
    ctl = rig.start_cluster((h1, h2))
    job_id = rig.muster(ctl, "submit", str(ROOT / "examples/ddp/job.yaml")).strip()
    job = rig.wait_done(job_id, timeout=120)
    assert job["state"] == "failed"
    assert "the probe failed from node" in job["root_cause"], job["root_cause"]
    assert "0 of 3 connections" in job["root_cause"], job["root_cause"]
    assert not [ln for ln in rig.api("logs", job_id)["lines"] if ln["origin"] == "rank"]
