"""The direct path end to end: real agents on hosts in two routed regions (no shared private
network) build a WireGuard mesh with wireguard-go, and a 2x2 gloo job runs over it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.net.conftest import needs
from tests.net.rig import Host, Rig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)

ENV_PROBE = """
import os, socket, torch.distributed as dist
keys = ("MASTER_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_NET",
        "NCCL_IB_DISABLE", "MUSTER_GANG_TRANSPORT", "MUSTER_NODE_IPS")
mtu = open(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/mtu").read().strip()
print("env " + " ".join(f"{k}={os.environ.get(k, '-')}" for k in keys) + f" mtu={mtu}",
      flush=True)
dist.init_process_group("gloo")
t = torch_tensor = __import__("torch").ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
n = dist.get_world_size()
print(f"sum={int(t.item())} expected={n * (n + 1) // 2}", flush=True)
dist.destroy_process_group()
os._exit(0)  # not the interpreter's teardown: gloo sometimes aborts there (torch#190489)
"""


def wide_job(tmp_path: Path, name: str, distributed: str) -> str:
    """A job file running ENV_PROBE with a 4 MiB all_reduce (full-size packets every way)
    on ``distributed`` (the YAML mapping's body); its path."""
    job_dir = tmp_path / name
    job_dir.mkdir()
    (job_dir / "train.py").write_text(
        ENV_PROBE.replace("ones(1)", "ones(2**20)").replace("int(t.item())", "int(t[0].item())")
    )
    (job_dir / "job.yaml").write_text(
        f"name: {name}\nentrypoint: train.py\ntimeout: 5m\ndistributed: {{{distributed}}}\n"
    )
    return str(job_dir / "job.yaml")


def wait_no_device_left(rig: Rig, hosts: tuple[Host, ...], timeout: float = 15) -> None:
    """Until nothing of a gang's network is left on ``hosts`` (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            for host in hosts:
                no_device_left(rig, host)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def no_device_left(rig: Rig, host: Host) -> None:
    links = rig.run(host, "ip", "-o", "link", "show").stdout
    assert "muster" not in links, links  # muster0, muster1, ...: every agent's device
    assert rig.run(host, "wg", "show", "interfaces").stdout.strip() == ""
    assert rig.run(host, "ls", "/run/wireguard").stdout.strip() == ""


def test_a_gloo_job_runs_over_the_direct_path_between_two_regions(rig: Rig, tmp_path: Path) -> None:
    needs("wg", "wireguard-go")
    h1, h2 = rig.two_regions(2)
    ctl = rig.start_cluster((h1, h2))

    job_dir = tmp_path / "direct"
    job_dir.mkdir()
    (job_dir / "train.py").write_text(ENV_PROBE)
    (job_dir / "job.yaml").write_text(
        "name: direct\nentrypoint: train.py\ntimeout: 5m\n"
        "distributed: {num_workers: 2, procs_per_worker: 2, backend: gloo, probe_seconds: 1}\n"
    )
    job_id = rig.muster(ctl, "submit", str(job_dir / "job.yaml")).strip()
    job = rig.wait_done(job_id)
    assert job["state"] == "succeeded", (job["root_cause"], job["events"])
    assert job["path_class"] == "direct"
    kinds = [e["kind"] for e in job["events"]]
    assert kinds.index("NetworkReady") < kinds.index("Probe") < kinds.index("RendezvousPublished")
    probe = next(e for e in job["events"] if e["kind"] == "Probe")
    assert probe["data"]["path"] == "direct"
    assert probe["data"]["slowest"]["tcpGbps"] > 0.01, probe  # wireguard-go: ~0.5 Gbit/s here
    assert probe["data"]["slowest"]["rttMs"] > 0
    # The path as the data plane saw it: out by muster0, to the peer's UDP endpoint.
    (pair,) = probe["data"]["pairs"]
    assert pair["via"] == "muster0", pair
    assert pair["endpoint"].split(":")[0] in (h1.address, h2.address), pair
    conditions = {c["type"]: c for c in job["conditions"]}
    assert conditions["NetworkQualified"]["status"] == "True"
    assert conditions["NetworkQualified"]["reason"] == "ProbePassed"

    lines = rig.api("logs", job_id)["lines"]
    envs = {ln["rank"]: ln["text"] for ln in lines if ln["text"].startswith("env ")}
    assert sorted(envs) == [0, 1, 2, 3], lines
    node0 = {m["node_rank"]: m for m in job["members"]}[0]
    for rank, text in envs.items():
        env = dict(item.split("=", 1) for item in text.split()[1:])
        assert env["MASTER_ADDR"] == "100.64.0.1", (rank, env)
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "muster0"
        assert env["NCCL_NET"] == "Socket"
        assert env["NCCL_IB_DISABLE"] == "1"
        assert env["MUSTER_GANG_TRANSPORT"] == "direct"
        assert env["MUSTER_NODE_IPS"] == "100.64.0.1,100.64.0.2"
        assert env["mtu"] == "1280", env  # hosts that declared no region: safe anywhere
    sums = [ln["text"] for ln in lines if ln["text"].startswith("sum=")]
    assert sums == ["sum=10 expected=10"] * 4, lines
    assert node0["worker"] in ("h1", "h2")

    # Nothing of the gang's network is left on either host once the job is over.
    wait_no_device_left(rig, (h1, h2))


def test_hosts_in_one_declared_region_use_wireguards_larger_packets(
    rig: Rig, tmp_path: Path
) -> None:
    """Three routed hosts that declare one provider region: a device takes WireGuard's 1420
    bytes over a 1500-byte link, less on a link that carries less (1460, a GCP VPC's size:
    1380), and no more than its agent's --direct-mtu; a 4 MiB all_reduce crosses between the
    three sizes."""
    needs("wg", "wireguard-go")
    h1, h2, h3 = rig.two_regions(3)
    rig.run(h2, "ip", "link", "set", next(iter(h2.addresses)), "mtu", "1460")
    ctl = rig.hosts["ctl"]
    rig.start_controller(ctl)
    where = ("--provider", "rig", "--region", "lab-1")
    rig.start_agent(h1, *where)
    rig.start_agent(h2, *where)
    rig.start_agent(h3, *where, "--direct-mtu", "1300")
    rig.wait_for_workers(["h1", "h2", "h3"])
    workers = {w["id"]: w for w in rig.api("workers")}
    assert (workers["h1"]["provider"], workers["h1"]["region"]) == ("rig", "lab-1"), workers
    table = rig.muster(ctl, "get", "workers")
    assert table.count("rig/lab-1") == 3, table
    spec = (
        "num_workers: 3, procs_per_worker: 1, backend: gloo, probe_seconds: 1, network: colocated"
    )
    job_id = rig.muster(ctl, "submit", wide_job(tmp_path, "region", spec)).strip()
    job = rig.wait_done(job_id)
    assert job["state"] == "succeeded", (job["root_cause"], job["events"])
    assert job["path_class"] == "direct"
    lines = rig.api("logs", job_id)["lines"]
    worker_of = {m["node_rank"]: m["worker"] for m in job["members"]}
    mtus = {
        worker_of[ln["rank"]]: ln["text"].rpartition("mtu=")[2]
        for ln in lines
        if ln["text"].startswith("env ")
    }
    assert mtus == {"h1": "1420", "h2": "1380", "h3": "1300"}, lines
    # ... and the job says so, node by node, where `muster describe` shows it
    ready = next(e for e in job["events"] if e["kind"] == "NetworkReady")
    said = {worker_of[node]: mtu for node, mtu in enumerate(ready["data"]["mtu"])}
    assert said == {"h1": 1420, "h2": 1380, "h3": 1300}, ready
    sums = [ln["text"] for ln in lines if ln["text"].startswith("sum=")]
    assert sums == ["sum=6 expected=6"] * 3, lines
    wait_no_device_left(rig, (h1, h2, h3))


def test_a_region_whose_path_carries_less_than_its_links_say_is_placed_again_at_1280(
    rig: Rig, tmp_path: Path
) -> None:
    """Two hosts in one declared region take 1420-byte devices, but the router between them
    silently drops what is larger than 1400 bytes (a tunnel underneath, ICMP filtered): the
    handshake, the probe's connections and its 1-byte echoes pass, its full-size echo is
    lost, even with no throughput sample (probe_seconds 0). The epoch is fenced and the
    next one runs at 1280, with nobody kept apart; the job's collectives never hang on it."""
    needs("wg", "wireguard-go", "nft")
    h1, h2 = rig.two_regions(2)
    rig.nft(
        rig.hosts["r1"],
        "table ip rig_narrow {\n"
        "  chain forward { type filter hook forward priority -10;\n"
        "    meta l4proto udp meta length > 1400 drop; }\n"
        "}\n",
    )
    ctl = rig.hosts["ctl"]
    rig.start_controller(ctl)
    for host in (h1, h2):
        rig.start_agent(host, "--provider", "rig", "--region", "lab-1")
    rig.wait_for_workers(["h1", "h2"])
    spec = "num_workers: 2, procs_per_worker: 1, backend: gloo, probe_seconds: 0"
    job_id = rig.muster(ctl, "submit", wide_job(tmp_path, "narrow", spec)).strip()
    job = rig.wait_done(job_id)
    assert job["state"] == "succeeded", (job["root_cause"], job["events"])
    assert job["path_class"] == "direct"
    events = job["events"]
    readies = [e["data"]["mtu"] for e in events if e["kind"] == "NetworkReady"]
    assert readies == [[1420, 1420], [1280, 1280]], events
    (fenced,) = [e for e in events if e["kind"] == "EpochFenced"]
    assert fenced["data"]["mtu"] == 1280, fenced
    assert fenced["data"]["apart"] == [], fenced
    assert "(their devices' MTU: 1420 and 1420)" in fenced["message"], fenced
    assert "16 KiB did not come back" in fenced["message"], fenced
    lines = rig.api("logs", job_id)["lines"]
    assert {ln["text"].rpartition("mtu=")[2] for ln in lines if ln["text"].startswith("env ")} == {
        "1280"
    }, lines
    sums = [ln["text"] for ln in lines if ln["text"].startswith("sum=")]
    assert sums == ["sum=3 expected=3"] * 2, lines
    wait_no_device_left(rig, (h1, h2))


def test_a_container_only_host_is_never_placed_on_the_direct_path(rig: Rig, tmp_path: Path) -> None:
    """It reports that it cannot make a device; a gang that only the direct path could
    carry waits with the reason instead of failing on it."""
    needs("wg", "wireguard-go")
    h1, h2 = rig.two_regions(2, container_only=["h2"])  # no CAP_NET_ADMIN, no /dev/net/tun
    ctl = rig.start_cluster((h1, h2))
    network = {w["id"]: w["network"] for w in rig.api("workers")}
    assert network["h1"]["can_create_device"] is True
    assert network["h1"]["container_only"] is False
    assert network["h2"]["can_create_device"] is False
    assert network["h2"]["container_only"] is True

    job_dir = tmp_path / "waits"
    job_dir.mkdir()
    (job_dir / "train.py").write_text("print('never')\n")
    (job_dir / "job.yaml").write_text(
        "name: waits\nentrypoint: train.py\n"
        "distributed: {num_workers: 2, procs_per_worker: 1, backend: gloo}\n"
    )
    job_id = rig.muster(ctl, "submit", str(job_dir / "job.yaml")).strip()
    deadline = time.monotonic() + 20
    job = rig.api("job", job_id)
    while not job["why_pending"]:
        assert time.monotonic() < deadline, job
        time.sleep(0.5)
        job = rig.api("job", job_id)
    time.sleep(2)
    job = rig.api("job", job_id)
    assert job["state"] == "queued", job
    # Only h1 could join a direct gang: the reason says so.
    assert "a private or direct path" in job["why_pending"], job["why_pending"]
    assert "1 on direct path" in job["why_pending"], job["why_pending"]
    rig.api("cancel", job_id)


def test_a_three_node_job_runs_direct_across_two_nats(rig: Rig, tmp_path: Path) -> None:
    """h1 and h2 each behind a NAT router that drops what they did not open, h3 on a public
    address: every pair reaches the other only because each member learnt its public UDP
    endpoint from the controller's reflector and both sides sent at once."""
    needs("wg", "wireguard-go", "nft")
    h1, h2, h3 = rig.behind_nats(2, public=1)
    assert not rig.reaches(h1, h2.address)
    # Nothing unsolicited gets through a NAT router, not even to the router itself.
    assert not rig.reaches(h3, "203.0.113.101")
    assert rig.reaches(h1, h3.address)
    ctl = rig.start_cluster((h1, h2, h3))

    job_dir = tmp_path / "nat"
    job_dir.mkdir()
    (job_dir / "train.py").write_text(ENV_PROBE)
    (job_dir / "job.yaml").write_text(
        "name: nat\nentrypoint: train.py\ntimeout: 5m\n"
        "distributed: {num_workers: 3, procs_per_worker: 1, backend: gloo, probe_seconds: 1}\n"
    )
    job_id = rig.muster(ctl, "submit", str(job_dir / "job.yaml")).strip()
    job = rig.wait_done(job_id)
    assert job["state"] == "succeeded", (job["root_cause"], job["events"])
    assert job["path_class"] == "direct"
    lines = rig.api("logs", job_id)["lines"]
    sums = [ln["text"] for ln in lines if ln["text"].startswith("sum=")]
    assert sums == ["sum=6 expected=6"] * 3, lines
    # Every pair's traffic went out by muster0 to the WireGuard endpoint the reflector gave:
    # the NAT'd members' routers' public addresses.
    probe = next(e for e in job["events"] if e["kind"] == "Probe")
    assert len(probe["data"]["pairs"]) == 3
    for pair in probe["data"]["pairs"]:
        assert pair["via"] == "muster0", pair
        assert pair["endpoint"].startswith("203.0.113."), pair
    # The NAT'd members were reached at their routers' public addresses.
    for host, public in ((h1, "203.0.113.101"), (h2, "203.0.113.102")):
        log = rig.log(host, "agent").read_text()
        assert f"seen outside as {public}:" in log, log[-2000:]


def test_a_pair_with_no_direct_path_is_fenced_and_kept_apart(rig: Rig, tmp_path: Path) -> None:
    """The router between the regions drops UDP: the devices get their peers, no handshake
    ever comes, and the epoch is fenced before its command starts, naming the silent peer.
    With only that pair in the pool the job waits in the queue saying why; no device is
    left behind, and a cancel ends it."""
    needs("wg", "wireguard-go", "nft")
    h1, h2 = rig.two_regions(2)
    router = rig.hosts["r1"]
    rig.nft(
        router,
        "table ip rig_block {\n"
        "  chain forward { type filter hook forward priority -10; meta l4proto udp drop; }\n"
        "}\n",
    )
    ctl = rig.start_cluster((h1, h2), "--handshake-timeout", "8")

    job_dir = tmp_path / "blocked"
    job_dir.mkdir()
    (job_dir / "train.py").write_text("print('never')\n")
    (job_dir / "job.yaml").write_text(
        "name: blocked\nentrypoint: train.py\n"
        "distributed: {num_workers: 2, procs_per_worker: 1, backend: gloo}\n"
    )
    job_id = rig.muster(ctl, "submit", str(job_dir / "job.yaml")).strip()
    deadline = time.monotonic() + 120
    while True:
        job = rig.api("job", job_id)
        if job["state"] == "queued" and "kept apart" in (job.get("why_pending") or ""):
            break
        assert time.monotonic() < deadline, job
        time.sleep(1)
    fenced = [e for e in job["events"] if e["kind"] == "EpochFenced"]
    assert fenced, job["events"]
    assert fenced[0]["data"]["apart"] == [["h1", "h2"]]
    assert (
        "could not set up the direct path: no WireGuard handshake within 8s" in fenced[0]["message"]
    )
    assert "100.64.0." in fenced[0]["message"]
    assert "h1 and h2 not on the direct path" in job["why_pending"]
    assert not [ln for ln in rig.api("logs", job_id)["lines"] if ln["origin"] == "rank"]
    wait_no_device_left(rig, (h1, h2))
    rig.muster(ctl, "cancel", job_id)
    assert rig.api("job", job_id)["state"] == "cancelled"


def _condition(job: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in job["conditions"] if c["type"] == kind), None)


def test_a_running_pair_that_loses_its_path_marks_the_job_degraded_until_it_is_back(
    rig: Rig, tmp_path: Path
) -> None:
    """A 2-node gloo job all_reduces over the direct path; the router between the regions
    starts dropping UDP: within the agents' --path-timeout the job's NetworkDegraded
    condition turns true, naming the pair, and training waits rather than fails; once UDP
    flows again the condition turns false and the job ends well."""
    needs("wg", "wireguard-go", "nft")
    h1, h2 = rig.two_regions(2)
    router = rig.hosts["r1"]
    ctl = rig.hosts["ctl"]
    rig.start_controller(ctl)
    for host in (h1, h2):
        rig.start_agent(host, "--path-timeout", "6")
    rig.wait_for_workers(["h1", "h2"])

    release = tmp_path / "release"
    job_dir = tmp_path / "loop"
    job_dir.mkdir()
    (job_dir / "train.py").write_text(
        "import os, time, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print('ready', flush=True)\n"
        "t, stop = torch.ones(1), torch.zeros(1)\n"
        "while True:\n"  # every rank stops at the same step (else barrier meets all_reduce)
        f"    stop.fill_(float(os.path.exists({str(release)!r})))\n"
        "    dist.all_reduce(stop, op=dist.ReduceOp.MAX)\n"
        "    if stop.item():\n"
        "        break\n"
        "    dist.all_reduce(t)\n"
        "    time.sleep(0.05)\n"
        "dist.barrier()\n"
        "print('done', flush=True)\n"
        "os._exit(0)\n"
    )
    (job_dir / "job.yaml").write_text(
        "name: loop\nentrypoint: train.py\ntimeout: 5m\n"
        "distributed: {num_workers: 2, procs_per_worker: 1, backend: gloo, probe_seconds: 1}\n"
    )
    job_id = rig.muster(ctl, "submit", str(job_dir / "job.yaml")).strip()

    def until(check: Any, what: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            job = rig.api("job", job_id)
            if check(job):
                return job
            assert job["state"] not in ("succeeded", "failed", "cancelled"), job["events"]
            assert time.monotonic() < deadline, f"{what}: {job['conditions']} {job['events']}"
            time.sleep(0.5)

    def ready(job: dict[str, Any]) -> bool:
        lines = rig.api("logs", job_id)["lines"]
        return sum(1 for ln in lines if ln["origin"] == "rank" and ln["text"] == "ready") == 2

    until(ready, "both ranks in the gang", 120)
    rig.nft(
        router,
        "table ip rig_block {\n"
        "  chain forward { type filter hook forward priority -10; meta l4proto udp drop; }\n"
        "}\n",
    )
    job = until(
        lambda j: (_condition(j, "NetworkDegraded") or {}).get("status") == "True",
        "NetworkDegraded after UDP stopped",
        45,
    )
    degraded = _condition(job, "NetworkDegraded")
    assert degraded is not None
    assert degraded["reason"] == "DirectPathLost"
    assert "hears nothing from node" in degraded["message"]
    assert job["state"] == "running"
    rig.run(router, "nft", "delete", "table", "ip", "rig_block")
    job = until(
        lambda j: (_condition(j, "NetworkDegraded") or {}).get("status") == "False",
        "NetworkDegraded cleared after UDP flowed again",
        120,
    )
    restored = _condition(job, "NetworkDegraded")
    assert restored is not None
    assert restored["reason"] == "DirectPathRestored"
    release.write_text("")
    job = rig.wait_done(job_id, timeout=120)
    assert job["state"] == "succeeded", (job["root_cause"], job["events"])
    kinds = [e["kind"] for e in job["events"]]
    assert kinds.index("NetworkDegraded") < kinds.index("NetworkRestored")


def test_a_member_left_behind_on_a_fenced_epoch_cannot_reach_the_next_one(
    rig: Rig, tmp_path: Path
) -> None:
    """h2's agent freezes while its epoch's network is up: the controller loses it, fences
    the epoch and places the gang again on h1 and h3 with fresh keys. h2's device, left
    behind, still holds the old epoch's peer; aimed even at h1's new endpoint, its packets
    arrive at h1 (counted) and none is delivered: h1's device knows only the new keys."""
    needs("wg", "wireguard-go", "nft")
    h1, h2, h3 = rig.two_regions(3)
    ctl = rig.hosts["ctl"]
    rig.start_controller(ctl, "--heartbeat-timeout", "4", "--heartbeat-interval", "1")
    agents = {host.name: rig.start_agent(host) for host in (h1, h2, h3)}
    rig.wait_for_workers(["h1", "h2", "h3"])

    job_dir = tmp_path / "fenced"
    job_dir.mkdir()
    go = tmp_path / "go"  # the hosts share this file system: the ranks wait for the checks
    (job_dir / "train.py").write_text(
        "import os, time, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "deadline = time.monotonic() + 60\n"
        f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.2)\n"
        "dist.barrier()\n"
        "os._exit(0)\n"
    )
    (job_dir / "job.yaml").write_text(
        "name: fenced\nentrypoint: train.py\ntimeout: 5m\n"
        "distributed: {num_workers: 2, procs_per_worker: 1, backend: gloo, "
        "probe_seconds: 10}\n"
    )
    job_id = rig.muster(ctl, "submit", str(job_dir / "job.yaml")).strip()
    deadline = time.monotonic() + 90
    while not rig.run(h2, "wg", "show", "muster0", "peers", check=False).stdout.strip():
        assert time.monotonic() < deadline, rig.api("job", job_id)["events"]
        time.sleep(0.1)
    old_peer = rig.run(h2, "wg", "show", "muster0", "peers").stdout.split()[0]
    h1_old_key = rig.run(h1, "wg", "show", "muster0", "public-key").stdout.strip()
    h2_key = rig.run(h2, "wg", "show", "muster0", "public-key").stdout.strip()
    assert old_peer == h1_old_key
    os.kill(agents["h2"].pid, signal.SIGSTOP)  # wireguard-go (its own process) runs on
    try:
        deadline = time.monotonic() + 120
        while True:
            job = rig.api("job", job_id)
            placed = [e["data"] for e in job["events"] if e["kind"] == "Placed"]
            ready = [
                e
                for e in job["events"]
                if e["kind"] == "NetworkReady" and e["data"].get("epoch") == 2
            ]
            if len(placed) == 2 and ready:
                break
            assert job["state"] not in ("succeeded", "failed", "cancelled"), job["events"]
            assert time.monotonic() < deadline, job["events"]
            time.sleep(0.5)
        assert placed[1]["workers"] == ["h1", "h3"]
        fenced = next(e for e in job["events"] if e["kind"] == "EpochFenced")
        # h2 was lost; or, had it already said its probe endpoint was up, the probe from h1
        # to it failed first. Either way the epoch is fenced for h2's sake.
        assert (
            "node1 (worker h2) was lost before any rank started" in fenced["message"]
            or "the probe failed" in fenced["message"]
        ), fenced["message"]
        assert "h2" in fenced["message"]
        # h1's new device: a new key pair, and only h3 as its peer (not h2's key).
        assert rig.run(h1, "wg", "show", "muster0", "public-key").stdout.strip() != h1_old_key
        new_peers = rig.run(h1, "wg", "show", "muster0", "peers").stdout.split()
        assert len(new_peers) == 1
        assert h2_key not in new_peers
        new_port = rig.run(h1, "wg", "show", "muster0", "listen-port").stdout.strip()
        # Aim h2's stale peer at h1's new endpoint, and count what reaches h1 from h2.
        rig.nft(
            h1,
            "table ip rig_count {\n"
            "  chain input { type filter hook input priority -20; "
            f"ip saddr {h2.address} udp dport {new_port} counter; }}\n"
            "}\n",
        )
        rig.run(
            h2, "wg", "set", "muster0", "peer", old_peer, "endpoint", f"{h1.address}:{new_port}"
        )
        # wireguard-go retries a handshake only every 5 s (REKEY_TIMEOUT), and one to the old
        # endpoint may have just gone out: ping until h1 has counted h2's packets (bounded).
        deadline = time.monotonic() + 30
        while True:
            ping = rig.run(
                h2, "ping", "-c", "2", "-W", "1", "-I", "muster0", "100.64.0.1", check=False
            )
            assert ping.returncode != 0
            assert " 0 received" in ping.stdout, ping.stdout
            counted = rig.run(h1, "nft", "list", "table", "ip", "rig_count").stdout
            packets = int(counted.split("counter packets ")[1].split()[0])
            if packets > 0:  # they arrived...
                break
            assert time.monotonic() < deadline, counted
        assert rig.run(h1, "wg", "show", "muster0", "peers").stdout.split() == new_peers
        transfer = rig.run(h1, "wg", "show", "muster0", "transfer").stdout
        assert h2_key not in transfer  # ...and none was taken in
    finally:
        go.touch()
        os.kill(agents["h2"].pid, signal.SIGCONT)
    job = rig.wait_done(job_id, timeout=180)
    assert job["state"] == "succeeded", (job["root_cause"], job["events"])
