"""Lost hosts, hostile frames and a controller restart, with real processes."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import update
from websockets.sync.client import ClientConnection, connect

from muster import wire
from muster.cli.local import LocalCluster
from muster.client import split_token
from muster.controller.links import MAX_REFUSED_FRAMES
from muster.spec import parse_job
from muster.store import open_store
from muster.store.models import Job
from muster.wire import Kind
from tests.e2e.helpers import (
    all_lines,
    submit,
    wait_no_processes,
    wait_state,
    write_job,
)

pytestmark = pytest.mark.timeout(600)

SLEEPER = """
import os, time
print(f"rank {os.environ['RANK']} running", flush=True)
time.sleep(600)
"""


def wait_running(cluster: LocalCluster, job_id: str) -> None:
    wait_state(cluster.client(), job_id, {"running"}, timeout=90)


def test_agent_killed_mid_run_fails_the_job_as_lost(tmp_path: Path) -> None:
    with LocalCluster(agents=2) as cluster:
        api = cluster.client()
        job_id = submit(api, write_job(tmp_path / "j", "lost", SLEEPER))
        wait_running(cluster, job_id)
        cluster.stop("agent-1", signal.SIGKILL)
        job = wait_state(api, job_id, timeout=30)
        assert job["state"] == "failed"
        assert "node1 (worker agent-1) was lost" in job["root_cause"]
        # torchrun dies with its agent (PDEATHSIG) and node0 is told to stop: nothing survives.
        wait_no_processes(cluster, job_id, timeout=40)


def test_stopped_agent_is_lost_after_the_heartbeat_timeout(tmp_path: Path) -> None:
    with LocalCluster(agents=2, heartbeat_timeout=4, heartbeat_interval=1) as cluster:
        api = cluster.client()
        job_id = submit(api, write_job(tmp_path / "j", "stopped", SLEEPER))
        wait_running(cluster, job_id)
        agent = cluster.procs["agent-1"]
        os.kill(agent.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            job = wait_state(api, job_id, timeout=30)
            waited = time.monotonic() - stopped_at
            assert job["state"] == "failed"
            assert "no heartbeat" in job["root_cause"], job["root_cause"]
            # The 4 s timeout, less up to a heartbeat interval, plus room for a busy machine.
            assert 2 <= waited < 25, waited
        finally:
            os.kill(agent.pid, signal.SIGCONT)


def authenticate(ws: ClientConnection, worker_id: str, token: str) -> tuple[str, str]:
    """Answer the controller's challenge as ``worker_id``; returns (our nonce, its nonce)."""
    anonce = str(wire.decode_plain(ws.recv(), Kind.CHALLENGE)["nonce"])
    cnonce = wire.new_nonce()
    proof = wire.auth_proof(token, cnonce, anonce, worker_id)
    ws.send(wire.encode_plain(Kind.AUTH, {"worker_id": worker_id, "nonce": cnonce, "proof": proof}))
    return cnonce, anonce


def open_link(ws: ClientConnection, worker_id: str, token: str) -> wire.LinkCodec:
    """Authenticate as ``worker_id`` and take the WELCOME; returns the link's codec."""
    cnonce, anonce = authenticate(ws, worker_id, token)
    codec = wire.LinkCodec(
        wire.session_key(token, cnonce, anonce), send=wire.TO_CONTROLLER, receive=wire.TO_AGENT
    )
    assert codec.decode(ws.recv(timeout=10)).kind is Kind.WELCOME
    return codec


def drain(ws: ClientConnection) -> None:
    """Read until the controller closes the link (the close raises)."""
    for _ in range(100):
        ws.recv(timeout=10)


def metric(cluster: LocalCluster, name: str, reason: str) -> float:
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    match = re.search(rf'^{name}_total{{reason="{reason}"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_hostile_frames_are_refused_and_counted(tmp_path: Path) -> None:
    with LocalCluster(agents=2) as cluster:
        url = cluster.url.replace("http", "ws") + "/v1/agents/link"
        token, _pin = split_token(cluster.join_token())

        # A wrong token: the link is closed, nothing is registered.
        with connect(url) as ws:
            authenticate(ws, "intruder", "not-the-token")
            with pytest.raises(Exception, match="4401"):
                ws.recv(timeout=10)
        assert metric(cluster, "muster_frames_refused", "auth") == 1

        # An honest link, then a replayed, a forged and a malformed frame: all refused,
        # and the link still answers the next honest heartbeat.
        with connect(url) as ws:
            codec = open_link(ws, "probe", token)
            beat = codec.encode(Kind.HEARTBEAT, {"time": 1})
            ws.send(beat)
            assert codec.decode(ws.recv(timeout=10)).kind is Kind.HEARTBEAT_ACK
            ws.send(beat)  # replayed
            forged = bytearray(codec.encode(Kind.HEARTBEAT, {"time": 2}))
            forged[-1] ^= 0xFF
            ws.send(bytes(forged))
            ws.send(b"\x01\x63garbage")  # malformed
            ws.send(codec.encode(Kind.INVENTORY, {"inventory": {"gpus": "many"}}))  # bad body
            ws.send(codec.encode(Kind.HEARTBEAT, {"time": 3}))
            assert codec.decode(ws.recv(timeout=10)).kind is Kind.HEARTBEAT_ACK
        for reason, count in (("replayed", 1), ("forged", 1), ("malformed", 2)):
            assert metric(cluster, "muster_frames_refused", reason) == count, reason

        # A link that keeps sending refused frames is closed after the cap; the listener
        # serves on (the job below still runs).
        with connect(url) as ws:
            open_link(ws, "pest", token)
            for _ in range(MAX_REFUSED_FRAMES + 10):
                try:
                    ws.send(b"\x01\x63garbage")
                except Exception:
                    break
            with pytest.raises(Exception, match="1008"):
                drain(ws)
        # (the server logs the reason once the link is down: after the client saw the close)
        deadline = time.monotonic() + 10
        while "closed after 1024 refused frames" not in cluster.log("server").read_text():
            assert time.monotonic() < deadline, cluster.log("server").read_text()[-2000:]
            time.sleep(0.1)

        # Honest agents were never disturbed: a job still runs.
        api = cluster.client()
        job_id = submit(api, write_job(tmp_path / "ok", "after", "print('fine')\n"))
        assert wait_state(api, job_id)["state"] == "succeeded"

        # A worker that was not placed in the job cannot write into its logs.
        with connect(url) as ws:
            codec = open_link(ws, "probe", token)
            forged_line = ["rank", 0, 999_999, time.time(), "stdout", "planted by probe"]
            ws.send(codec.encode(Kind.LOGS, {"job": job_id, "batch": 1, "lines": [forged_line]}))
            assert codec.decode(ws.recv(timeout=10)).kind is Kind.LOGS_ACK
        assert metric(cluster, "muster_frames_refused", "foreign") == 1
        assert not any("planted" in line["text"] for line in all_lines(api, job_id))


def test_controller_restart_keeps_history_and_persistent_agents_return(tmp_path: Path) -> None:
    cluster = LocalCluster(agents=2, agent_args=["--persist"])
    with cluster:
        api = cluster.client()
        script = (
            "import os\nprint('hello from', os.environ['RANK'])\n"
            "open(os.environ['MUSTER_OUTPUT_DIR'] + '/out.txt', 'w').write('x')\n"
        )
        job_id = submit(api, write_job(tmp_path / "j", "before", script))
        assert wait_state(api, job_id)["state"] == "succeeded"
        lines_before = all_lines(api, job_id)
        arts_before = api.artifacts(job_id)

        cluster.stop("server")
        cluster.start_server()  # same port, same data dir, same database
        job = api.job(job_id)
        assert job["state"] == "succeeded"
        assert all_lines(api, job_id) == lines_before
        assert api.artifacts(job_id) == arts_before
        assert len(arts_before) == 2

        cluster.wait_for_workers(2, timeout=60)  # --persist agents dial again

        # A job caught running by a restart goes on once its agents dial back, and its
        # logs continue with no gap and no duplicate.
        caught = submit(api, write_job(tmp_path / "c", "caught", COUNTER))
        wait_running(cluster, caught)
        time.sleep(2)
        cluster.stop("server")
        cluster.start_server()
        job = wait_state(api, caught, timeout=120)
        assert job["state"] == "succeeded", job["root_cause"]
        assert_counted(all_lines(api, caught))
        assert "AwaitingMembers" in [e["kind"] for e in job["events"]]
        wait_no_processes(cluster, caught)
        again = submit(api, write_job(tmp_path / "k", "after", "print('again')\n"))
        assert wait_state(api, again)["state"] == "succeeded"
        wait_no_processes(cluster, again)


COUNTER = """
import os, time
rank = int(os.environ["RANK"])
for i in range(120):
    print(f"rank={rank} line={i}", flush=True)
    time.sleep(0.1)
"""


def assert_counted(lines: list[dict[str, object]]) -> None:
    """Every COUNTER line of every rank, once, in order."""
    for rank in range(4):
        mine = [ln["text"] for ln in lines if ln["origin"] == "rank" and ln["rank"] == rank]
        assert mine == [f"rank={rank} line={i}" for i in range(120)], rank


def test_tls_with_a_pinned_certificate(tmp_path: Path) -> None:
    with LocalCluster(agents=2, tls=True) as cluster:
        assert cluster.url.startswith("https://")
        join = cluster.join_token()
        secret, _, pin = join.partition(".")
        assert pin.startswith("sha256:")
        assert len(pin) == len("sha256:") + 64

        # The API wants the token over TLS; agents (already connected) pinned the cert.
        anonymous = httpx.get(f"{cluster.url}/v1/jobs", verify=False, timeout=10)
        assert anonymous.status_code == 401
        api = cluster.client()
        job_id = submit(api, write_job(tmp_path / "j", "tls", "print('over tls')\n"))
        assert wait_state(api, job_id)["state"] == "succeeded"

        # An agent given another fingerprint refuses to talk to this controller.
        wrong = f"{secret}.sha256:{'0' * 64}"
        agent = cluster.start_agent("agent-x", join=wrong)
        assert agent.wait(timeout=60) == 1
        assert "refusing to talk to it" in cluster.log("agent-x").read_text()


def test_a_stored_spec_this_version_refuses_fails_that_job_and_the_queue_goes_on(
    tmp_path: Path,
) -> None:
    """A queued job whose stored spec this version no longer accepts (an older muster's, or
    past a bound added since: a timeout of 2**40 s) is failed with the field named, and the
    job behind it is still placed and runs."""
    with LocalCluster(agents=1, agent_args=["--persist"]) as cluster:
        assert cluster.data_dir is not None
        api = cluster.client()
        cluster.stop("server")
        store = open_store(str(cluster.data_dir / "muster.db"))
        try:
            old = store.submit_job(parse_job({"name": "old", "entrypoint": "t.py"}))
            with store.db.transaction() as s:
                s.execute(
                    update(Job).where(Job.id == old.id).values(spec={**old.spec, "timeout": 2**40})
                )
        finally:
            store.db.dispose()
        cluster.start_server()
        cluster.wait_for_workers(1, timeout=60)
        good = submit(
            api,
            write_job(tmp_path / "g", "good", "print('fine')\n", distributed={"num_workers": 1}),
        )
        assert wait_state(api, good)["state"] == "succeeded"
        job = wait_state(api, old.id, timeout=30)
        assert job["state"] == "failed"
        said = " ".join(e["message"] for e in job["events"])
        assert "the stored spec no longer validates (timeout: " in said, said
