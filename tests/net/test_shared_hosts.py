"""Two direct-path gangs on the same two hosts (two agents per host): each agent takes a device
name of its own, both jobs run at once, and neither gang's processes can open a connection
into the other's network, on the far host or on their own."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from muster.net import firewall
from muster.net.wireguard import kernel_wireguard
from tests.net.conftest import needs
from tests.net.rig import Host, Rig, rank_group
from tests.net.test_direct import wait_no_device_left

pytestmark = pytest.mark.timeout(300)

HOLD = """
import os, time, torch.distributed as dist
dist.init_process_group("gloo")
print("ready", os.environ["GLOO_SOCKET_IFNAME"], os.environ["MASTER_ADDR"], flush=True)
deadline = time.monotonic() + 150  # until the test has looked (it writes RELEASE), bounded
while not os.path.exists(os.environ["RELEASE"]) and time.monotonic() < deadline:
    time.sleep(0.2)
dist.barrier()
print("held ok", flush=True)
os._exit(0)  # not the interpreter's teardown: gloo sometimes aborts there (torch#190489)
"""

# Connect to ADDR:PORT from inside the cgroup GROUP (as one of that gang's ranks would).
CONNECT_FROM = (
    'echo 0 > "$1/cgroup.procs" && exec python3 -c "'
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()\n"
    "    print('connected')\n"
    "except OSError as exc:\n"
    "    print('refused', type(exc).__name__)\n"
    '" "$2" "$3"'
)


def submit(rig: Rig, ctl: Host, tmp_path: Path, name: str, release: str = "release") -> str:
    job_dir = tmp_path / name
    job_dir.mkdir()
    (job_dir / "train.py").write_text(HOLD)
    (job_dir / "job.yaml").write_text(
        f"name: {name}\nentrypoint: train.py\ntimeout: 5m\n"
        f"env: {{RELEASE: '{tmp_path / release}'}}\n"
        "distributed: {num_workers: 2, procs_per_worker: 1, backend: gloo, probe_seconds: 0}\n"
    )
    return rig.muster(ctl, "submit", str(job_dir / "job.yaml")).strip()


def submit_and_wait_ready(
    rig: Rig, ctl: Host, tmp_path: Path, name: str, release: str = "release"
) -> dict[str, Any]:
    job_id = submit(rig, ctl, tmp_path, name, release)
    return wait_ready(rig, job_id)


def wait_ready(rig: Rig, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 150
    while True:
        job = rig.api("job", job_id)
        assert job["state"] not in ("succeeded", "failed", "cancelled"), job["events"]
        lines = rig.api("logs", job_id)["lines"]
        ready = [ln["text"] for ln in lines if ln["origin"] == "rank" and "ready" in ln["text"]]
        if len(ready) == 2:
            job["ready"] = ready
            return job
        assert time.monotonic() < deadline, job["events"]
        time.sleep(0.5)


def gang_a_then_second_agents(
    rig: Rig, hosts: tuple[Host, Host], tmp_path: Path, release: str = "release"
) -> tuple[Host, dict[str, Any]]:
    """The controller, an agent "<host>a" on each host running gang A (ready), then a second
    agent "<host>b" on each host, idle: the controller's host and gang A."""
    ctl = rig.hosts["ctl"]
    rig.start_controller(ctl)
    for host in hosts:
        rig.start_agent(host, worker=f"{host.name}a")
    rig.wait_for_workers([f"{h.name}a" for h in hosts])
    gang_a = submit_and_wait_ready(rig, ctl, tmp_path, "ga", release)
    for host in hosts:  # the second agent on each host, for the second gang
        rig.start_agent(host, worker=f"{host.name}b")
    rig.wait_for_workers([f"{h.name}b" for h in hosts])
    return ctl, gang_a


def connect_from(rig: Rig, host: Host, group: str, addr: str, port: int | str) -> str:
    done = rig.run(host, "sh", "-c", CONNECT_FROM, "connect", group, addr, str(port))
    return done.stdout.strip()


def gloo_ports(rig: Rig, host: Host, group: str) -> list[tuple[str, str]]:
    """(address, port) of every TCP listener of the processes in ``group`` on ``host``."""
    pids = set(rig.run(host, "cat", f"{group}/cgroup.procs").stdout.split())
    listening = rig.run(host, "ss", "-ltnpH").stdout
    return [
        (addr, port)
        for addr, port, pid in re.findall(
            r"LISTEN\s+\d+\s+\d+\s+(\S+):(\d+)\s+\S+\s+users:\(\(\"[^\"]*\",pid=(\d+)", listening
        )
        if pid in pids and addr.startswith("100.64.")
    ]


def test_two_direct_gangs_on_shared_hosts_cannot_reach_each_other(rig: Rig, tmp_path: Path) -> None:
    needs("wg", "wireguard-go", "nft")
    h1, h2 = rig.two_regions(2)
    ctl, gang_a = gang_a_then_second_agents(rig, (h1, h2), tmp_path)
    gang_b = submit_and_wait_ready(rig, ctl, tmp_path, "gb")

    # Each agent claimed a device name of its own on its host, and its ranks bind it.
    devices = {w["id"]: w["network"]["device"] for w in rig.api("workers")}
    assert devices == {"h1a": "muster0", "h2a": "muster0", "h1b": "muster1", "h2b": "muster1"}
    assert all(" muster0 " in text for text in gang_a["ready"]), gang_a["ready"]
    assert all(" muster1 " in text for text in gang_b["ready"]), gang_b["ready"]
    for host in (h1, h2):
        links = rig.run(host, "ip", "-o", "link", "show").stdout
        assert "muster0" in links
        assert "muster1" in links

    a_members = {m["worker"]: m for m in gang_a["members"]}
    a_group = {h.name: rank_group(rig.agent_key(h, f"{h.name}a"), gang_a["id"]) for h in (h1, h2)}
    b_group = {h.name: rank_group(rig.agent_key(h, f"{h.name}b"), gang_b["id"]) for h in (h1, h2)}
    a_addr = {h.name: a_members[f"{h.name}a"]["path_address"] for h in (h1, h2)}
    a_port = int(
        next(e for e in gang_a["events"] if e["kind"] == "RendezvousPublished")["data"]["port"]
    )
    a_node0 = next(host for host in (h1, h2) if a_members[f"{host.name}a"]["node_rank"] == 0)
    other = h2 if a_node0 is h1 else h1

    # One of gang A's own processes reaches its rendezvous port across the mesh...
    got = connect_from(rig, other, a_group[other.name], a_addr[a_node0.name], a_port)
    assert got == "connected", got
    # ...a process of gang B on the same host does not: not the rendezvous port, not a rank's
    # gloo listener, on the far host or on its own host.
    got = connect_from(rig, other, b_group[other.name], a_addr[a_node0.name], a_port)
    assert got.startswith("refused"), got
    # (the c10d store listens on every address: not over the loopback of its own host either)
    got = connect_from(rig, a_node0, b_group[a_node0.name], "127.0.0.1", a_port)
    assert got.startswith("refused"), got
    for target in (h1, h2):
        listeners = gloo_ports(rig, target, a_group[target.name])
        assert listeners, rig.run(target, "ss", "-ltnp").stdout
        for addr, port in listeners:
            for source in (h1, h2):
                got = connect_from(rig, source, b_group[source.name], addr, port)
                assert got.startswith("refused"), (source.name, addr, port, got)
    # The ranks cannot forge the probe's mark nor change the rules: no CAP_NET_ADMIN, no
    # CAP_NET_RAW, although the agent (root here) has both.
    for host in (h1, h2):
        for pid in rig.run(host, "cat", f"{a_group[host.name]}/cgroup.procs").stdout.split():
            status = rig.run(host, "cat", f"/proc/{pid}/status", check=False).stdout
            effective = re.search(r"CapEff:\s+([0-9a-f]+)", status)
            if effective is None:  # it ended meanwhile
                continue
            assert int(effective.group(1), 16) & (1 << 12 | 1 << 13) == 0, status
    for host in (h1, h2):  # what was dropped was counted on gang A's agents
        table = firewall.table_name(rig.agent_key(host, f"{host.name}a"))
        rules = rig.run(host, "nft", "list", "chain", "inet", table, "output").stdout
        dropped = [ln for ln in rules.splitlines() if "daddr 100.64." in ln]
        assert dropped, rules
        assert "counter packets 0 " not in dropped[0], rules

    (tmp_path / "release").write_text("")
    for job in (gang_a, gang_b):
        done = rig.wait_done(job["id"], timeout=120)
        assert done["state"] == "succeeded", (done["root_cause"], done["events"])
    wait_no_device_left(rig, (h1, h2), timeout=30)
    deadline = time.monotonic() + 30
    groups = [*a_group.values(), *b_group.values()]
    while any("muster_" in rig.run(h, "nft", "list", "tables").stdout for h in (h1, h2)) or any(
        rig.run(h1, "test", "-e", g, check=False).returncode == 0 for g in groups
    ):
        assert time.monotonic() < deadline, "a rule or a rank group outlived the jobs"
        time.sleep(0.2)


def test_a_host_running_a_private_gang_gives_the_next_gang_the_direct_path(
    rig: Rig, tmp_path: Path
) -> None:
    """On one private network, two agents per host: gang A takes the private path on h1 and
    h2; gang B, on the same hosts' other agents, cannot (the rules tell members by address,
    and the hosts' addresses are A's): it is placed on the direct path, and both succeed."""
    needs("wg", "wireguard-go", "nft")
    h1, h2 = rig.one_region(2)
    ctl, gang_a = gang_a_then_second_agents(rig, (h1, h2), tmp_path)
    gang_b = submit_and_wait_ready(rig, ctl, tmp_path, "gb")
    assert gang_a["path_class"] == "private"
    assert gang_b["path_class"] == "direct"
    assert {m["worker"] for m in gang_b["members"]} == {"h1b", "h2b"}
    (tmp_path / "release").write_text("")
    for job in (gang_a, gang_b):
        done = rig.wait_done(job["id"], timeout=120)
        assert done["state"] == "succeeded", (done["root_cause"], done["events"])


def test_a_gang_that_only_the_private_path_could_carry_waits_with_ipcollision_then_runs(
    rig: Rig, tmp_path: Path
) -> None:
    """Container-only hosts (no device: private path or nothing), two agents each: gang B
    cannot share gang A's addresses, so it waits, saying IPCollision in its reason and its
    GangReady condition; once A ends it is placed on the private path and runs."""
    h1, h2 = rig.one_region(2, container_only=["h1", "h2"])
    ctl, gang_a = gang_a_then_second_agents(rig, (h1, h2), tmp_path, "release-a")
    b_id = submit(rig, ctl, tmp_path, "gb", "release-b")
    deadline = time.monotonic() + 60
    while True:
        job_b = rig.api("job", b_id)
        ready = [c for c in job_b["conditions"] if c["type"] == "GangReady"]
        if ready and "IPCollision" in (job_b["why_pending"] or ""):
            break
        assert job_b["state"] == "queued", job_b
        assert time.monotonic() < deadline, job_b
        time.sleep(0.5)
    assert ready[0]["status"] is False or ready[0]["status"] == "False", ready
    assert ready[0]["reason"] == "IPCollision"
    assert "2 idle worker(s) on a private network share an address" in ready[0]["message"]
    (tmp_path / "release-a").write_text("")
    assert rig.wait_done(gang_a["id"], timeout=120)["state"] == "succeeded"
    job_b = wait_ready(rig, b_id)
    assert job_b["path_class"] == "private"
    (tmp_path / "release-b").write_text("")
    done = rig.wait_done(b_id, timeout=120)
    assert done["state"] == "succeeded", (done["root_cause"], done["events"])


def test_an_agent_killed_mid_run_leaves_nothing_running_and_its_next_start_sweeps_the_rest(
    rig: Rig, tmp_path: Path
) -> None:
    """SIGKILL h2's agent while its direct member runs: wireguard-go and torchrun die with it
    (parent-death signals), so its device and its ranks go at once; the job fails for the
    lost member. What only the agent could remove (its nftables table, its ranks' cgroup) is
    swept when the agent starts again."""
    needs("wg", "wireguard-go", "nft")
    h1, h2 = rig.two_regions(2)
    ctl = rig.hosts["ctl"]
    rig.start_controller(ctl, "--heartbeat-timeout", "4", "--heartbeat-interval", "1")
    agents = {host.name: rig.start_agent(host) for host in (h1, h2)}
    rig.wait_for_workers(["h1", "h2"])
    job = submit_and_wait_ready(rig, ctl, tmp_path, "crash")
    group = rank_group(rig.agent_key(h2), job["id"])
    table = firewall.table_name(rig.agent_key(h2))
    assert rig.run(h2, "cat", f"{group}/cgroup.procs").stdout.split()  # ranks run there
    assert table in rig.run(h2, "nft", "list", "tables").stdout
    assert "muster0" in rig.run(h2, "ip", "-o", "link", "show").stdout

    # A kernel WireGuard device has no process to die with the agent (it stays until the
    # next NET_SETUP replaces it); wireguard-go's goes with it.
    userspace = not kernel_wireguard()
    agents["h2"].kill()
    agents["h2"].wait(10)
    deadline = time.monotonic() + 30
    while True:
        links = rig.run(h2, "ip", "-o", "link", "show").stdout
        left = rig.run(h2, "cat", f"{group}/cgroup.procs", check=False).stdout.split()
        if ("muster0" not in links or not userspace) and not left:
            break
        assert time.monotonic() < deadline, (links, left)
        time.sleep(0.2)
    done = rig.wait_done(job["id"], timeout=60)
    assert done["state"] == "failed"
    assert "node" in done["root_cause"]
    assert "h2" in done["root_cause"], done["root_cause"]
    # The crash left the table and the (empty) group: the next start sweeps both.
    assert table in rig.run(h2, "nft", "list", "tables").stdout
    rig.start_agent(h2)
    rig.wait_for_workers(["h2"])
    deadline = time.monotonic() + 30
    while (
        table in rig.run(h2, "nft", "list", "tables").stdout
        or rig.run(h2, "test", "-e", group, check=False).returncode == 0
    ):
        assert time.monotonic() < deadline, "the restarted agent left the crashed run's rules"
        time.sleep(0.2)
    if userspace:
        wait_no_device_left(rig, (h1, h2), timeout=30)
