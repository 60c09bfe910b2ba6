"""The multi-host rig itself: each shape is what it claims, and real agents run a job on it."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from muster.net import firewall
from tests.net.conftest import needs
from tests.net.rig import Rig, rank_group

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


def ddp_example(tmp_path: Path) -> Path:
    """examples/ddp with a 1 s probe sample (the default, up to 10 s, measures; these tests
    only need the probe to prove the path)."""
    job_dir = tmp_path / "ddp"
    shutil.copytree(ROOT / "examples/ddp", job_dir)
    job = yaml.safe_load((job_dir / "job.yaml").read_text())
    job["distributed"]["probe_seconds"] = 1
    (job_dir / "job.yaml").write_text(yaml.safe_dump(job))
    return job_dir / "job.yaml"


def test_real_agents_on_rig_hosts_run_a_two_node_job(rig: Rig, tmp_path: Path) -> None:
    h1, h2 = rig.one_region(2)
    ctl = rig.start_cluster((h1, h2))
    workers = {w["id"]: w for w in rig.api("workers")}
    assert workers["h1"]["advertise_address"] == h1.address
    assert workers["h2"]["advertise_address"] == h2.address

    job_id = rig.muster(ctl, "submit", str(ddp_example(tmp_path))).strip()
    job = rig.wait_done(job_id, timeout=180)
    assert job["state"] == "succeeded", job["root_cause"]
    members = {m["node_rank"]: m for m in job["members"]}
    assert {members[0]["worker"], members[1]["worker"]} == {"h1", "h2"}
    # The probe proved the private path before the command started.
    probe = next(e for e in job["events"] if e["kind"] == "Probe")
    assert probe["data"]["path"] == "private"
    assert [(p["a"], p["b"]) for p in probe["data"]["pairs"]] == [(0, 1)]
    assert probe["data"]["pairs"][0]["via"] == "eth0"  # the private interface, read back
    assert probe["data"]["pairs"][0]["endpoint"] is None
    assert probe["data"]["slowest"]["tcpGbps"] > 0.1  # a veth: many Gbit/s
    described = rig.muster(ctl, "describe", job_id)
    assert "condition NetworkQualified=True (ProbePassed)" in described, described
    assert "node0-node1" in described, described
    # Node 0's rendezvous address is its host's address on the rig, not loopback.
    node0 = rig.hosts[members[0]["worker"]]
    published = [e for e in job["events"] if e["kind"] == "RendezvousPublished"]
    assert published, job["events"]
    assert node0.address in published[0]["message"], published
    checked = [e for e in job["events"] if e["kind"] == "RendezvousCheck"]
    assert checked, "every member dialled node 0's port before any rank started"
    lines = rig.api("logs", job_id)["lines"]  # ~100 lines: one page
    for rank in range(4):
        mine = [ln["text"] for ln in lines if ln["origin"] == "rank" and ln["rank"] == rank]
        assert "all_reduce sum=10 expected=10 ok" in mine, f"rank {rank}: {mine[:5]}"


def test_a_private_path_the_probe_cannot_cross_is_placed_again_as_direct(
    rig: Rig, tmp_path: Path
) -> None:
    """h2 drops every TCP connection from h1 on the private network: the probe finds it
    before any rank starts, the epoch is fenced, and the gang is placed again on the direct
    path (WireGuard over UDP, which h2 lets through) where it runs to the end."""
    needs("nft", "wg", "wireguard-go")
    h1, h2 = rig.one_region(2)
    rig.nft(
        h2,
        "table ip rig_block {\n"
        f"  chain input {{ type filter hook input priority -10; ip saddr {h1.address} "
        "meta l4proto tcp drop; }\n"
        "}\n",
    )
    ctl = rig.start_cluster((h1, h2))
    job_id = rig.muster(ctl, "submit", str(ddp_example(tmp_path))).strip()
    job = rig.wait_done(job_id, timeout=240)
    assert job["state"] == "succeeded", job["root_cause"]
    fenced = [e for e in job["events"] if e["kind"] == "EpochFenced"]
    assert len(fenced) == 1, job["events"]
    assert fenced[0]["data"] == {
        "epoch": 1,
        "path": "private",
        "reason": "ProbeFailed",
        "apart": [["h1", "h2"]],
    }
    assert "the probe failed from node" in fenced[0]["message"]
    assert re.search(r"0 of \d+ connections", fenced[0]["message"]), fenced[0]["message"]
    placed = [e["data"] for e in job["events"] if e["kind"] == "Placed"]
    assert [(p["epoch"], p["path"]) for p in placed] == [(1, "private"), (2, "direct")]
    probe = [e["data"] for e in job["events"] if e["kind"] == "Probe"]
    assert [p["path"] for p in probe] == ["direct"]
    described = rig.muster(ctl, "describe", job_id)
    assert "condition NetworkQualified=True (ProbePassed)" in described, described
    assert "condition GangReady=True (NetworkReady)" in described, described
    # Every rank ran once, in epoch 2, over muster0.
    lines = rig.api("logs", job_id)["lines"]
    for rank in range(4):
        mine = [ln["text"] for ln in lines if ln["origin"] == "rank" and ln["rank"] == rank]
        assert mine.count("all_reduce sum=10 expected=10 ok") == 1, f"rank {rank}: {mine[:5]}"


def test_a_rendezvous_port_the_members_cannot_reach_fences_the_epoch_before_any_rank_starts(
    rig: Rig, tmp_path: Path
) -> None:
    """Both hosts drop TCP to port 29555 arriving on the private network, and the job fixes
    its rendezvous there. The probe passes (its own ports are open), but node 1 cannot dial
    the port node 0 holds: the epoch is fenced before any torchrun starts, naming the member,
    the port and the fix, and the gang is queued to be placed again with the pair apart."""
    needs("nft")
    h1, h2 = rig.one_region(2)
    for host in (h1, h2):
        rig.nft(
            host,
            "table ip rig_block {\n  chain input { type filter hook input priority -10; "
            'iifname "eth0" tcp dport 29555 drop; }\n}\n',
        )
    ctl = rig.start_cluster((h1, h2))
    job_file = ddp_example(tmp_path)
    job = yaml.safe_load(job_file.read_text())
    job["distributed"]["rendezvous"] = {"port": 29555}
    job_file.write_text(yaml.safe_dump(job))
    job_id = rig.muster(ctl, "submit", str(job_file)).strip()
    deadline = time.monotonic() + 90
    while True:
        job = rig.api("job", job_id)
        fenced = [e for e in job["events"] if e["kind"] == "EpochFenced"]
        if fenced:
            break
        assert job["state"] not in ("succeeded", "failed", "cancelled"), job
        assert time.monotonic() < deadline, job["events"]
        time.sleep(0.5)
    assert fenced[0]["data"]["reason"] == "MasterUnreachable", fenced
    assert fenced[0]["data"]["apart"] == [["h1", "h2"]], fenced
    assert re.search(
        r"node1 \(worker h[12]\) cannot reach node0's rendezvous at 10\.\S+:29555 \(worker "
        r"h[12]\): no answer within 10s \(a firewall drops it, or no route\); let TCP port 29555",
        fenced[0]["message"],
    ), fenced[0]["message"]
    # Up to the fence (epoch 2, on the direct path, may be quick to assign by the time the
    # events are read): no member was assigned, and no rank printed a line.
    fenced_at = datetime.fromisoformat(fenced[0]["time"]).timestamp()
    kinds = [
        e["kind"]
        for e in job["events"]
        if datetime.fromisoformat(e["time"]).timestamp() <= fenced_at
    ]
    assert "RendezvousCheck" in kinds
    assert "Assigned" not in kinds, "no member of epoch 1 was assigned: torchrun never started"
    lines = rig.api("logs", job_id)["lines"]
    assert not [ln for ln in lines if ln["origin"] == "rank" and ln["time"] <= fenced_at]
    rig.api("cancel", job_id)


HOLD = """
import os, time, torch.distributed as dist
dist.init_process_group("gloo")
print("ready", flush=True)
deadline = time.monotonic() + 120  # until the test has looked (it writes RELEASE), bounded
while not os.path.exists(os.environ["RELEASE"]) and time.monotonic() < deadline:
    time.sleep(0.2)
dist.barrier()
print("held ok", flush=True)
dist.destroy_process_group()
os._exit(0)  # not the interpreter's teardown: gloo sometimes aborts there (torch#190489)
"""

CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
    print("connected")
except OSError as exc:
    print(f"refused {type(exc).__name__}")
"""


def test_the_rendezvous_port_takes_members_only_and_no_rule_outlives_the_job(
    rig: Rig, tmp_path: Path
) -> None:
    """A 2-node gang on h1 and h2; h3 sits on the same private network. While the gang runs,
    h2 reaches node 0's rendezvous port and h3 does not (its packets are counted, none
    delivered); nor does h3 reach the ports the ranks' gloo listens on (on either node).
    After the job no rule and no rank group is left. A table left by a crashed agent on h3
    is swept when its agent starts."""
    needs("nft")
    h1, h2, h3 = rig.one_region(3)
    stale = firewall.table_name(rig.agent_key(h3))
    rig.nft(
        h3,
        f"table inet {stale} {{\n  chain input {{ type filter hook input priority 0; "
        "tcp dport 1 drop; }\n}\n",
    )
    ctl = rig.start_cluster((h1, h2, h3))
    assert stale not in rig.run(h3, "nft", "list", "tables").stdout

    job_dir = tmp_path / "hold"
    job_dir.mkdir()
    (job_dir / "train.py").write_text(HOLD)
    (job_dir / "job.yaml").write_text(
        f"name: hold\nentrypoint: train.py\nenv: {{RELEASE: '{tmp_path / 'release'}'}}\n"
        "distributed: {num_workers: 2, procs_per_worker: 1, backend: gloo, probe_seconds: 1}\n"
    )
    job_id = rig.muster(ctl, "submit", str(job_dir / "job.yaml")).strip()
    deadline = time.monotonic() + 120
    while True:  # until both ranks are in the gang (the c10d store is up on node 0)
        job = rig.api("job", job_id)
        assert job["state"] in ("queued", "placing", "networking", "rendezvous", "running"), job
        lines = rig.api("logs", job_id)["lines"]
        if sum(1 for ln in lines if ln["origin"] == "rank" and ln["text"] == "ready") == 2:
            break
        assert time.monotonic() < deadline, job
        time.sleep(0.5)
    members = {m["node_rank"]: m["worker"] for m in job["members"]}
    node0, node1 = rig.hosts[members[0]], rig.hosts[members[1]]
    assert h3.name not in members.values()
    published = next(e for e in job["events"] if e["kind"] == "RendezvousPublished")
    port = int(published["data"]["port"])
    probe = tmp_path / "connect.py"
    probe.write_text(CONNECT)
    listening = rig.run(node0, "ss", "-ltnp").stdout
    got = rig.muster_python(node1, str(probe), node0.address, str(port)).strip()
    assert got == "connected", (port, listening, job["events"])
    outsider = rig.muster_python(h3, str(probe), node0.address, str(port)).strip()
    assert outsider.startswith("refused"), outsider
    ruleset = rig.run(
        node0, "nft", "list", "table", "inet", firewall.table_name(rig.agent_key(node0))
    )
    dropped = [ln for ln in ruleset.stdout.splitlines() if f"tcp dport {port}" in ln]
    assert dropped, ruleset.stdout
    assert "counter packets 0 " not in dropped[0], ruleset.stdout
    # The ranks' own ports (gloo's listeners, on ephemeral ports nobody names in advance):
    # the ranks run in a cgroup of their member, and h3's connections to them are dropped.
    groups = []
    for host in (node0, node1):
        group = rank_group(rig.agent_key(host), job_id)
        groups.append(group)
        pids = set(rig.run(host, "cat", f"{group}/cgroup.procs").stdout.split())
        ports = [
            (addr, p)
            for addr, p, pid in re.findall(
                r"LISTEN\s+\d+\s+\d+\s+(\S+):(\d+)\s+\S+\s+users:\(\(\"[^\"]*\",pid=(\d+)",
                rig.run(host, "ss", "-ltnpH").stdout,
            )
            if pid in pids and int(p) != port and not addr.startswith("127.")
        ]
        assert ports, rig.run(host, "ss", "-ltnp").stdout
        for _, rank_port in ports:
            outsider = rig.muster_python(h3, str(probe), host.address, rank_port).strip()
            assert outsider.startswith("refused"), (host.name, rank_port, outsider)
        ruleset = rig.run(
            host, "nft", "list", "table", "inet", firewall.table_name(rig.agent_key(host))
        )
        by_group = [ln for ln in ruleset.stdout.splitlines() if "socket cgroupv2" in ln]
        assert by_group, ruleset.stdout
        assert "counter packets 0 " not in by_group[0], ruleset.stdout

    (tmp_path / "release").write_text("")
    job = rig.wait_done(job_id, timeout=120)
    assert job["state"] == "succeeded", job["root_cause"]
    # The agents drop rules and groups just after the member's last report: bounded wait.
    deadline = time.monotonic() + 30
    while any(
        "muster_" in rig.run(host, "nft", "list", "tables").stdout for host in (h1, h2, h3)
    ) or any(rig.run(node0, "test", "-e", g, check=False).returncode == 0 for g in groups):
        assert time.monotonic() < deadline, "a rule or a rank group outlived the job"
        time.sleep(0.2)
