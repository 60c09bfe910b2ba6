"""The relayed path end to end: two container-only hosts (no TUN, no CAP_NET_ADMIN) in two
routed regions that cannot open TCP to each other, two meshed `muster relay`s on the
controller's host, and a 2x2 gloo job with `transport: auto` that runs through them: every
byte between the members crosses a relay, encrypted, with the shim preloaded in the ranks."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.net.conftest import needs
from tests.net.rig import Host, Rig

pytestmark = pytest.mark.timeout(300)
RELAY_PORTS = (7101, 7102)


ENV_PROBE_TRAIN = """
import os, time, torch, torch.distributed as dist
keys = ("MASTER_ADDR", "MUSTER_GANG_TRANSPORT", "MUSTER_NODE_IPS", "NCCL_NET")
print("env " + " ".join(f"{k}={os.environ.get(k, '-')}" for k in keys), flush=True)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(1 << 18)
for step in range(40):
    dist.all_reduce(t)
    t.fill_(1.0)
    if rank == 0 and step % 10 == 0:
        print(f"step {step}", flush=True)
    time.sleep(0.1)
done = torch.ones(1) * (rank + 1)
dist.all_reduce(done)
print(f"trained sum={int(done.item())} expected={world * (world + 1) // 2}", flush=True)
dist.destroy_process_group()
os._exit(0)
"""


def relayed_cluster(rig: Rig, count: int) -> tuple[list[Host], Host, list[subprocess.Popen[bytes]]]:
    """``count`` container-only hosts in two routed regions that the router keeps apart,
    two meshed relays on ctl, the controller (knowing them) and an agent on each host."""
    hosts = rig.two_regions(count, container_only=[f"h{i}" for i in range(1, count + 1)])
    # The router between the regions carries nothing between the hosts (the hosts, being
    # container-only, could not set such rules themselves); every host still reaches ctl.
    rules = " ".join(
        f"ip saddr {a.address} ip daddr {b.address} drop;"
        for a in hosts
        for b in hosts
        if a is not b
    )
    rig.nft(
        rig.hosts["r1"],
        "table ip rig_block {\n  chain forward { type filter hook forward priority -10; "
        f"{rules} }}\n}}\n",
    )
    ctl = rig.hosts["ctl"]
    secret = rig.root / "relay.secret"
    secret.write_text(secrets.token_hex(32))
    os.chmod(secret, 0o600)
    relays = []
    for port, other in zip(RELAY_PORTS, reversed(RELAY_PORTS), strict=True):
        argv = [
            sys.executable, "-m", "muster", "relay",
            "--listen", f"{ctl.address}:{port}", "--peer", f"{ctl.address}:{other}",
            "--name", f"relay{port}", "--secret-file", str(secret),
        ]  # fmt: skip
        relays.append(rig.spawn(ctl, f"relay{port}", *argv))
    flags = [a for port in RELAY_PORTS for a in ("--relay", f"{ctl.address}:{port}")]
    rig.start_controller(ctl, *flags, "--relay-secret-file", str(secret))
    for host in hosts:
        rig.start_agent(host)
    rig.wait_for_workers([h.name for h in hosts])
    return hosts, ctl, relays


def submit(rig: Rig, ctl: Host, root: Path, script: str, nodes: int, procs: int) -> str:
    root.mkdir()
    (root / "train.py").write_text(script)
    (root / "job.yaml").write_text(
        "name: relayed\nentrypoint: train.py\ntimeout: 5m\ndistributed: {num_workers: "
        f"{nodes}, procs_per_worker: {procs}, backend: gloo, transport: auto, "
        "probe_seconds: 1}\n"
    )
    return rig.muster(ctl, "submit", str(root / "job.yaml")).strip()


def test_a_gloo_job_trains_relayed_between_hosts_that_cannot_reach_each_other(
    rig: Rig, tmp_path: Path
) -> None:
    """Three container-only hosts the router keeps apart, 2 ranks each, `transport: auto`:
    the gang is placed relayed (and says why), the probe measures each pair through the
    relays, the ranks train with the shim preloaded; once training is under way the relay
    every member sends through is killed, and the job finishes with every step done and no
    connection broken. The relays metered what each member sent (`muster usage`)."""
    hosts, ctl, relays = relayed_cluster(rig, 3)
    h1, h2, _h3 = hosts
    assert not rig.reaches(h1, h2.address)
    job_id = submit(rig, ctl, tmp_path / "train", ENV_PROBE_TRAIN, 3, 2)
    deadline = time.monotonic() + 120
    while True:
        lines = rig.api("logs", job_id)["lines"]
        if any(ln["text"] == "step 10" for ln in lines):
            break
        job = rig.api("job", job_id)
        assert job["state"] not in ("failed", "cancelled", "succeeded"), job["root_cause"]
        assert time.monotonic() < deadline, rig.log_tails()
        time.sleep(0.3)
    relays[0].kill()  # the first relay: the one every member sends through
    job = rig.wait_done(job_id)
    assert job["state"] == "succeeded", (job["root_cause"], job["events"], rig.log_tails())
    assert job["path_class"] == "relayed"
    why = next(e for e in job["events"] if e["kind"] == "RelayedPath")["message"]
    assert "h1 (container-only), h2 (container-only), h3 (container-only) cannot join" in why
    assert "the members share no private network" in why
    assert "RelayedPath" in rig.muster(ctl, "describe", job_id)
    probe = next(e for e in job["events"] if e["kind"] == "Probe")["data"]
    assert probe["path"] == "relayed", probe
    assert len(probe["pairs"]) == 3, probe
    assert all(p["via"] == "relayed" and p["tcpGbps"] > 0.01 for p in probe["pairs"]), probe
    ready = next(e for e in job["events"] if e["kind"] == "NetworkReady")
    assert ready["data"]["path"] == "relayed"

    lines = rig.api("logs", job_id)["lines"]
    envs = {ln["rank"]: ln["text"] for ln in lines if ln["text"].startswith("env ")}
    assert sorted(envs) == list(range(6)), lines
    for rank, text in envs.items():
        env = dict(item.split("=", 1) for item in text.split()[1:])
        assert env["MUSTER_GANG_TRANSPORT"] == "relayed", (rank, env)
        assert env["NCCL_NET"] == "Socket"
        assert sorted(env["MUSTER_NODE_IPS"].split(",")) == sorted(h.address for h in hosts)
        assert env["MASTER_ADDR"] in {h.address for h in hosts}
    trained = [ln["text"] for ln in lines if ln["text"].startswith("trained")]
    assert trained == ["trained sum=21 expected=21"] * 6, lines
    assert [ln["text"] for ln in lines if ln["text"].startswith("step")][-1] == "step 30"
    # Every member lost its link to the killed relay mid-run, and went on through the other.
    for host in hosts:
        said = rig.log(host, "agent").read_text()
        assert f"relay {ctl.address}:{RELAY_PORTS[0]}: " in said, said[-2000:]
        assert "relayed endpoint up" in said

    # Still nothing between the hosts; what went through the relays was metered (the
    # controller reads the relays every 5 s).
    assert not rig.reaches(h1, h2.address)
    deadline = time.monotonic() + 30
    usage = rig.api("usage", job_id)
    while not all(m["relayed_bytes"] > 0 for m in usage["members"]):
        assert time.monotonic() < deadline, usage
        time.sleep(1)
        usage = rig.api("usage", job_id)
    assert [m["node"] for m in usage["members"]] == [0, 1, 2]
    assert f"job {job_id} (relayed):" in rig.muster(ctl, "usage", job_id)


def test_a_direct_pair_that_loses_its_path_goes_on_through_the_relays(
    rig: Rig, tmp_path: Path
) -> None:
    """A direct gang (hosts that can make devices, in two regions) with relays known to the
    controller: once training runs, the router drops all UDP between the regions (WireGuard
    can no longer cross), yet TCP to the relays still flows. Within the agents'
    --path-timeout the job is NetworkDegraded, the agents divert the pair's WireGuard
    packets through the relays, and training goes on to the end on the same connections."""
    needs("wg", "wireguard-go", "nft")
    h1, h2 = rig.two_regions(2)
    ctl = rig.hosts["ctl"]
    secret = rig.root / "relay.secret"
    secret.write_text(secrets.token_hex(32))
    os.chmod(secret, 0o600)
    for port, other in zip(RELAY_PORTS, reversed(RELAY_PORTS), strict=True):
        argv = [
            sys.executable, "-m", "muster", "relay",
            "--listen", f"{ctl.address}:{port}", "--peer", f"{ctl.address}:{other}",
            "--secret-file", str(secret),
        ]  # fmt: skip
        rig.spawn(ctl, f"relay{port}", *argv)
    flags = [a for port in RELAY_PORTS for a in ("--relay", f"{ctl.address}:{port}")]
    rig.start_controller(ctl, *flags, "--relay-secret-file", str(secret))
    for host in (h1, h2):
        rig.start_agent(host, "--path-timeout", "5")
    rig.wait_for_workers(["h1", "h2"])
    release = tmp_path / "release"
    script = (
        "import os, time, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t, step, stop = torch.ones(1 << 16), 0, torch.zeros(1)\n"
        "while True:\n"
        # Every rank stops at the same step: one that saw the release while the other had not
        # went to the barrier against the other's all_reduce and both hung (the flake blamed on
        # the relays for a while: on them the ranks' skew is longer, so the race was likelier).
        f"    stop.fill_(float(os.path.exists({str(release)!r})))\n"
        "    dist.all_reduce(stop, op=dist.ReduceOp.MAX)\n"
        "    if stop.item():\n"
        "        break\n"
        "    dist.all_reduce(t)\n"
        "    step += 1\n"
        "    if step % 20 == 0 and dist.get_rank() == 0:\n"
        "        print(f'step {step}', flush=True)\n"
        "    time.sleep(0.05)\n"
        "dist.barrier()\n"
        "print('done', flush=True)\n"
        "os._exit(0)\n"
    )
    root = tmp_path / "direct"
    root.mkdir()
    (root / "train.py").write_text(script)
    (root / "job.yaml").write_text(
        "name: fallback\nentrypoint: train.py\ntimeout: 5m\n"
        "distributed: {num_workers: 2, procs_per_worker: 1, backend: gloo, probe_seconds: 1}\n"
    )
    job_id = rig.muster(ctl, "submit", str(root / "job.yaml")).strip()

    def steps() -> int:
        lines = rig.api("logs", job_id)["lines"]
        done = [int(ln["text"].split()[1]) for ln in lines if ln["text"].startswith("step ")]
        return max(done, default=0)

    deadline = time.monotonic() + 120
    while steps() < 20:
        job = rig.api("job", job_id)
        assert job["state"] not in ("failed", "cancelled", "succeeded"), job["root_cause"]
        assert time.monotonic() < deadline, rig.log_tails()
        time.sleep(0.5)
    assert rig.api("job", job_id)["path_class"] == "direct"
    rig.nft(
        rig.hosts["r1"],
        "table ip rig_block {\n"
        "  chain forward { type filter hook forward priority -10; meta l4proto udp drop; }\n"
        "}\n",
    )
    deadline = time.monotonic() + 60
    while True:
        job = rig.api("job", job_id)
        degraded = {c["type"]: c for c in job["conditions"]}.get("NetworkDegraded")
        if degraded and degraded["status"] == "True":
            break
        assert time.monotonic() < deadline, (job["conditions"], rig.log_tails())
        time.sleep(0.5)
    before = steps()
    deadline = time.monotonic() + 60
    while steps() < before + 40:  # training goes on: through the relays now
        assert rig.api("job", job_id)["state"] == "running", rig.log_tails()
        assert time.monotonic() < deadline, rig.log_tails()
        time.sleep(0.5)
    release.write_text("")
    # (a pass ends within seconds of the release: fail sooner than the default)
    job = rig.wait_done(job_id, timeout=45)
    assert job["state"] == "succeeded", (job["root_cause"], rig.log_tails())
    said = rig.log(h1, "agent").read_text() + rig.log(h2, "agent").read_text()
    assert "through the relays now" in said, said[-3000:]
