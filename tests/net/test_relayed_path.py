"""The relayed path end to end: two container-only hosts (no TUN, no CAP_NET_ADMIN) in two
routed regions that cannot open TCP to each other, two meshed `muster relay`s on the
controller's host, and a 2x2 gloo job with `transport: auto` that runs through them: every
byte between the members crosses a relay, encrypted, with the shim preloaded in the ranks."""

from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path

import pytest

from tests.net.rig import Rig
from tests.net.test_direct import ENV_PROBE

pytestmark = pytest.mark.timeout(300)
RELAY_PORTS = (7101, 7102)


def test_a_gloo_job_runs_relayed_between_container_only_hosts_that_cannot_reach_each_other(
    rig: Rig, tmp_path: Path
) -> None:
    h1, h2 = rig.two_regions(2, container_only=["h1", "h2"])
    # The router between the regions carries nothing between h1 and h2 (the hosts, being
    # container-only, could not set such rules themselves); both still reach ctl.
    rig.nft(
        rig.hosts["r1"],
        "table ip rig_block {\n  chain forward { type filter hook forward priority -10; "
        f"ip saddr {h1.address} ip daddr {h2.address} drop; "
        f"ip saddr {h2.address} ip daddr {h1.address} drop; }}\n}}\n",
    )
    assert not rig.reaches(h1, h2.address)
    ctl = rig.hosts["ctl"]
    secret = rig.root / "relay.secret"
    secret.write_text(secrets.token_hex(32))
    os.chmod(secret, 0o600)
    for port, other in zip(RELAY_PORTS, reversed(RELAY_PORTS), strict=True):
        rig.spawn(
            ctl, f"relay{port}", sys.executable, "-m", "muster", "relay",
            "--listen", f"{ctl.address}:{port}", "--peer", f"{ctl.address}:{other}",
            "--name", f"relay{port}", "--secret-file", str(secret),
        )  # fmt: skip
    relays = [a for port in RELAY_PORTS for a in ("--relay", f"{ctl.address}:{port}")]
    rig.start_controller(ctl, *relays, "--relay-secret-file", str(secret))
    for host in (h1, h2):
        rig.start_agent(host)
    rig.wait_for_workers(["h1", "h2"])

    job_dir = tmp_path / "relayed"
    job_dir.mkdir()
    (job_dir / "train.py").write_text(ENV_PROBE)
    (job_dir / "job.yaml").write_text(
        "name: relayed\nentrypoint: train.py\ntimeout: 5m\n"
        "distributed: {num_workers: 2, procs_per_worker: 2, backend: gloo, transport: auto}\n"
    )
    job_id = rig.muster(ctl, "submit", str(job_dir / "job.yaml")).strip()
    job = rig.wait_done(job_id)
    assert job["state"] == "succeeded", (job["root_cause"], job["events"], rig.log_tails())
    assert job["path_class"] == "relayed"
    ready = next(e for e in job["events"] if e["kind"] == "NetworkReady")
    assert ready["data"]["path"] == "relayed"
    lines = rig.api("logs", job_id)["lines"]
    envs = {ln["rank"]: ln["text"] for ln in lines if ln["text"].startswith("env ")}
    assert sorted(envs) == [0, 1, 2, 3], lines
    addresses = f"{h1.address},{h2.address}"
    for rank, text in envs.items():
        env = dict(item.split("=", 1) for item in text.split()[1:])
        assert env["MUSTER_GANG_TRANSPORT"] == "relayed", (rank, env)
        assert env["NCCL_NET"] == "Socket"
        assert env["MUSTER_NODE_IPS"] in (addresses, f"{h2.address},{h1.address}"), env
        assert env["MASTER_ADDR"] in (h1.address, h2.address)
    sums = [ln["text"] for ln in lines if ln["text"].startswith("sum=")]
    assert sums == ["sum=10 expected=10"] * 4, lines
    # Still nothing between the two hosts: the job went through the relays, which metered
    # what each member sent (the controller reads them every 10 s).
    assert not rig.reaches(h1, h2.address)
    deadline = time.monotonic() + 30
    usage = rig.api("usage", job_id)
    while not all(m["relayed_bytes"] > 0 for m in usage["members"]):
        assert time.monotonic() < deadline, usage
        time.sleep(1)
        usage = rig.api("usage", job_id)
    assert usage["path_class"] == "relayed"
    assert [m["node"] for m in usage["members"]] == [0, 1]
    shown = rig.muster(ctl, "usage", job_id)
    assert f"job {job_id} (relayed):" in shown, shown
    deadline = time.monotonic() + 10
    relay_log = ""
    while "relayed endpoint closed" not in relay_log and time.monotonic() < deadline:
        relay_log = rig.log(h1, "agent").read_text() + rig.log(h2, "agent").read_text()
        time.sleep(0.5)
    assert "relayed endpoint up" in relay_log
