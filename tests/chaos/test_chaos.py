"""Chaos with real processes: what a user notices when an agent hangs, an upload fails, or
someone floods the link endpoint. (A log flood of 4 ranks x 50,000 lines: tests/e2e/
test_jobs.py; an agent SIGKILLed mid-run: tests/e2e/test_failures.py.)"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import httpx
import psutil
import pytest
from websockets.sync.client import connect

from muster.cli.local import LocalCluster
from tests.e2e.helpers import (
    all_lines,
    job_processes,
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


def node_processes(cluster: LocalCluster, job_id: str, agent: str) -> list[str]:
    """The command lines of the job's live processes under ``agent``'s work dir (one that
    exits while it is being looked at is not counted)."""
    found = []
    for p in job_processes(cluster, job_id):
        try:
            if f"/{agent}/" in (p.cwd() + "/"):
                found.append(" ".join(p.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []


def test_a_hung_agents_ranks_end_while_it_is_still_stopped(tmp_path: Path) -> None:
    """SIGSTOP an agent mid-run: the job fails after the heartbeat timeout, and the member's
    watchdog ends that agent's ranks although the agent itself cannot (it is stopped)."""
    with LocalCluster(agents=2, heartbeat_timeout=4, heartbeat_interval=1) as cluster:
        api = cluster.client()
        job_id = submit(api, write_job(tmp_path / "j", "hung", SLEEPER))
        wait_state(api, job_id, {"running"}, timeout=90)
        # The watchdogs start a few seconds after torchrun: wait for agent-1's (bounded).
        agent = cluster.procs["agent-1"]
        deadline = time.monotonic() + 60
        while not any(
            "muster.agent.reaper" in " ".join(child.cmdline()) for child in _children(agent.pid)
        ):
            assert time.monotonic() < deadline, "agent-1 started no watchdog in 60 s"
            time.sleep(0.2)
        assert node_processes(cluster, job_id, "agent-1")
        os.kill(agent.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            job = wait_state(api, job_id, timeout=30)
            assert job["state"] == "failed"
            assert "node1 (worker agent-1) was lost" in job["root_cause"]
            # Heartbeat timeout (4 s) + the watchdog's poll + the grace: well under 30 s.
            deadline = stopped_at + 30
            while node_processes(cluster, job_id, "agent-1") and time.monotonic() < deadline:
                time.sleep(0.2)
            left = node_processes(cluster, job_id, "agent-1")
            assert left == [], f"still running while the agent is stopped: {left}"
            assert agent.poll() is None  # the agent itself is still there, stopped
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        wait_no_processes(cluster, job_id, timeout=30)


def test_an_upload_that_fails_fails_the_job_naming_node_and_file(tmp_path: Path) -> None:
    big_output = """
import os
out = os.environ["MUSTER_OUTPUT_DIR"]
if os.environ["RANK"] == "2":
    with open(os.path.join(out, "weights.bin"), "wb") as fh:
        fh.write(os.urandom(2 << 20))
with open(os.path.join(out, f"ok-{os.environ['RANK']}.txt"), "w") as fh:
    fh.write("fine")
"""
    with LocalCluster(agents=2, server_args=["--max-artifact-mb", "1"]) as cluster:
        api = cluster.client()
        job_id = submit(api, write_job(tmp_path / "j", "upload", big_output))
        job = wait_state(api, job_id, timeout=120)
        assert job["state"] == "failed"
        cause = job["root_cause"]
        assert "node1 (worker agent-1) could not upload 1 output file(s)" in cause, cause
        assert "weights.bin" in cause
        assert "--max-artifact-mb" in cause
        # The file stays with the agent for a person to fetch.
        kept = list((cluster.data_dir or Path()).glob(f"agent-1/{job_id}/node1/**/weights.bin"))
        assert kept, "the output that could not be uploaded was not kept"


def test_pre_auth_garbage_at_volume_leaves_the_listener_serving(tmp_path: Path) -> None:
    with LocalCluster(agents=2) as cluster:
        url = cluster.url.replace("http", "ws") + "/v1/agents/link"
        started = time.monotonic()
        refused = 0
        for i in range(120):
            outcome: BaseException | None = None
            try:
                with connect(url, max_size=None, open_timeout=10) as ws:
                    ws.recv(timeout=10)  # the CHALLENGE
                    try:
                        if i % 3 == 0:
                            ws.send(b"\x00" * (1 << 20))  # 1 MiB before authenticating
                        elif i % 3 == 1:
                            ws.send(os.urandom(200))
                        else:
                            ws.send("not even binary")
                        ws.recv(timeout=10)
                    except Exception as exc:
                        outcome = exc
            except Exception as exc:  # closing a connection the server already cut
                outcome = outcome or exc
            assert outcome is not None, "the controller answered a frame before AUTH"
            text = f"{outcome} {outcome.__cause__}"
            if i % 3 == 0:
                # Refused by the WebSocket layer at the 4 KiB cap (1009), or the connection
                # cut while the client was still writing it: never read whole and handed
                # to the handshake (which would say 4401).
                cut = isinstance(outcome.__cause__, BrokenPipeError | ConnectionResetError)
                assert "1009" in text or cut, text
                assert "4401" not in text, text
            else:
                assert "4401" in text or "1000" in text, text
            refused += 1
        # Raw bytes that are not even HTTP, and connections that say nothing at all.
        for _ in range(30):
            with socket.create_connection(("127.0.0.1", cluster.port), timeout=5) as raw:
                raw.sendall(os.urandom(4096))
        assert refused == 120
        assert time.monotonic() - started < 120
        metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
        match = re.search(r'^muster_frames_refused_total\{reason="auth"\} (\S+)$', metrics, re.M)
        assert match is not None
        assert float(match.group(1)) >= 80  # the oversized ones may close below the app
        # The honest agents were never disturbed, and the listener still serves.
        api = cluster.client()
        job_id = submit(api, write_job(tmp_path / "ok", "after", "print('fine')\n"))
        assert wait_state(api, job_id)["state"] == "succeeded"


COUNTER = """
import os, time
rank = int(os.environ["RANK"])
for i in range(150):
    print(f"rank={rank} line={i}", flush=True)
    time.sleep(0.1)
"""


def test_controller_killed_mid_run_and_restarted_the_job_goes_on(tmp_path: Path) -> None:
    with LocalCluster(agents=2, agent_args=["--persist"]) as cluster:
        api = cluster.client()
        job_id = submit(api, write_job(tmp_path / "j", "survivor", COUNTER))
        wait_state(api, job_id, {"running"}, timeout=90)
        time.sleep(3)
        cluster.stop("server", signal.SIGKILL)
        time.sleep(2)  # the ranks go on printing while no controller listens
        cluster.start_server()
        job = wait_state(api, job_id, timeout=120)
        assert job["state"] == "succeeded", job["root_cause"]
        lines = [ln for ln in all_lines(api, job_id) if ln["origin"] == "rank"]
        for rank in range(4):
            mine = [ln["text"] for ln in lines if ln["rank"] == rank]
            assert mine == [f"rank={rank} line={i}" for i in range(150)], rank
        wait_no_processes(cluster, job_id)


def test_a_member_that_does_not_dial_back_fails_the_job_after_the_grace(tmp_path: Path) -> None:
    with LocalCluster(
        agents=2, agent_args=["--persist"], heartbeat_timeout=4, heartbeat_interval=1
    ) as cluster:
        api = cluster.client()
        job_id = submit(api, write_job(tmp_path / "j", "orphan", SLEEPER))
        wait_state(api, job_id, {"running"}, timeout=90)
        cluster.stop("server", signal.SIGKILL)
        cluster.stop("agent-1", signal.SIGKILL)
        cluster.start_server()
        started = time.monotonic()
        job = wait_state(api, job_id, timeout=60)
        waited = time.monotonic() - started
        assert job["state"] == "failed"
        assert "node1 (worker agent-1) did not dial back within the grace" in job["root_cause"]
        # the grace is 3 heartbeat timeouts, plus the server's start and a busy runner
        assert waited < 3 * 4 + 20, waited
        # agent-0 came back and was told to stop its member; agent-1's ranks died with it.
        wait_no_processes(cluster, job_id, timeout=40)


def test_an_agent_notices_a_wedged_controller_and_dials_back(tmp_path: Path) -> None:
    """SIGSTOP the controller: the agent drops the silent link within its heartbeat timeout
    (it does not wait on TCP), and once the controller runs again it is back, although
    its first re-dial may meet 'already connected' (a persist agent does not exit on it)."""
    with LocalCluster(
        agents=1, agent_args=["--persist"], heartbeat_timeout=4, heartbeat_interval=1
    ) as cluster:
        server = cluster.procs["server"]
        os.kill(server.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            log = cluster.log("agent-0")
            while "no frame from the controller" not in log.read_text():
                assert time.monotonic() - stopped_at < 30, log.read_text()[-2000:]
                time.sleep(0.2)
            noticed = time.monotonic() - stopped_at
            assert noticed < 4 + 15, noticed  # the heartbeat timeout, and room for a busy loop
        finally:
            os.kill(server.pid, signal.SIGCONT)
        cluster.wait_for_workers(1, timeout=90)
        assert cluster.procs["agent-0"].poll() is None
        api = cluster.client()
        job_id = submit(
            api,
            write_job(
                tmp_path / "j",
                "after",
                "print('fine')\n",
                distributed={"num_workers": 1, "procs_per_worker": 1, "backend": "gloo"},
            ),
        )
        assert wait_state(api, job_id)["state"] == "succeeded"
