"""Open admission (seed 003): a window job with ``open_admission: true`` takes boxes that walk
in without the join string, and such a link can do nothing but walk in to that job.

Real controller, real `muster join` processes and a raw WebSocket client playing the
attacker: a box that reaches the port but holds no secret.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from muster import wire
from muster.cli.local import LocalCluster
from muster.client import split_token
from muster.spec import WorkerInventory
from muster.spec.worker import WalkIn
from muster.wire import Kind
from tests.e2e.helpers import all_lines, submit, wait_state
from tests.e2e.test_window import muster, wait_window, window_job

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(agents=0, heartbeat_interval=1.0, heartbeat_timeout=5.0) as c:
        yield c


def open_join(cluster: LocalCluster, job: str, host: str) -> subprocess.Popen[bytes]:
    """``muster join --open-admission``: no --token-file, no MUSTER_TOKEN."""
    assert cluster.data_dir is not None
    args = ["join", cluster.url, "--job", job, "--open-admission", "--host", host]
    args += ["--work-dir", str(cluster.data_dir / f"open-{host}")]
    return cluster._spawn(f"open-{host}", args)


async def dial(url: str, worker_id: str, open_job: str) -> tuple[Any, wire.LinkCodec | None]:
    """A raw open-admission handshake; (socket, codec) when admitted, (close code, None)
    when the controller closed the link instead."""
    ws = await connect(url.replace("http://", "ws://") + "/v1/agents/link")
    challenge = wire.decode_plain(await ws.recv(), Kind.CHALLENGE)  # type: ignore[arg-type]
    cnonce, anonce = wire.new_nonce(), str(challenge["nonce"])
    body = {"worker_id": worker_id, "nonce": cnonce, "open_job": open_job}
    await ws.send(wire.encode_plain(Kind.AUTH, body))
    try:
        admit = wire.decode_plain(await ws.recv(), Kind.ADMIT)  # type: ignore[arg-type]
    except ConnectionClosed:
        code = ws.close_code
        return code, None
    salt = str(admit["salt"])
    codec = wire.LinkCodec(
        wire.session_key(salt, cnonce, anonce), send=wire.TO_CONTROLLER, receive=wire.TO_AGENT
    )
    welcome = codec.decode(await ws.recv())  # type: ignore[arg-type]
    assert welcome.kind is Kind.WELCOME
    assert wire.proofs_match(str(welcome.body["proof"]), wire.server_proof(salt, cnonce, anonce))
    return ws, codec


def test_boxes_without_the_join_string_walk_in_to_an_open_window_and_train(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    window = {"start": "manual", "quorum": 2, "open_admission": True}
    job = submit(api, window_job(tmp_path, "open", window))
    first = open_join(cluster, job, "box-a")
    second = open_join(cluster, job, "box-b")
    view = wait_window(api, job, "staging", ranks=2)
    assert sorted(m["worker"] for m in view["roster"]) == [f"open-{job}-box-a", f"open-{job}-box-b"]
    started = muster(cluster, "start", job)
    assert started.returncode == 0, started.stderr
    done = wait_state(api, job)
    assert done["state"] == "succeeded", done["root_cause"]
    texts = sorted(ln["text"] for ln in all_lines(api, job) if ln["origin"] == "rank")
    assert texts == ["rank 0 of 2 sum=3", "rank 1 of 2 sum=3"]
    assert first.wait(60) == 0
    assert second.wait(60) == 0
    assert "OPEN ADMISSION" in " ".join(e["message"] for e in api.job(job)["events"])
    server_log = cluster.log("server").read_text()
    assert f"admitted open-{job}-box-a to job {job} without the join secret" in server_log


def test_a_window_without_open_admission_takes_no_box_without_the_join_string(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    job = submit(api, window_job(tmp_path, "closed", {"start": "manual", "quorum": 2}))
    wait_window(api, job, "waiting")
    box = open_join(cluster, job, "box-c")
    assert box.wait(60) == 2
    said = cluster.log("open-box-c").read_text()
    assert f"job {job} has no open join window that admits boxes without the join string" in said
    assert "--token-file" in said
    plain = subprocess.run(  # no join string and no --open-admission: the error says both ways
        [sys.executable, "-m", "muster", "join", cluster.url, "--job", job, "--host", "x"],
        env={k: v for k, v in cluster._env().items() if k != "MUSTER_TOKEN"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert plain.returncode == 2
    assert "--token-file" in plain.stderr
    assert "--open-admission" in plain.stderr
    assert api.window(job)["ranks"] == 0
    api.cancel(job)


def test_an_open_link_may_only_walk_in_to_its_own_job(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    api = cluster.client()
    window = {"start": "manual", "quorum": 2, "open_admission": True}
    open_job = submit(api, window_job(tmp_path, "open2", window))
    other = submit(api, window_job(tmp_path, "other", {"start": "manual", "quorum": 2}))
    wait_window(api, open_job, "waiting")
    wait_window(api, other, "waiting")

    async def attack() -> None:
        # Open admission to a window that does not have it: closed before any session.
        code, codec = await dial(cluster.url, f"open-{other}-evil", other)
        assert (code, codec) == (4401, None)
        # The name of an agent that holds the secret (to take its place): closed too.
        code, codec = await dial(cluster.url, "agent-0", open_job)
        assert (code, codec) == (4401, None)
        # Admitted to the open window, it offers itself to the other job: ERROR, closed.
        ws, codec = await dial(cluster.url, f"open-{open_job}-evil", open_job)
        assert codec is not None
        offer = WorkerInventory(
            id=f"open-{open_job}-evil",
            hostname="evil",
            torch_version="2.13.0",
            torchrun=True,
            join=WalkIn(job=other, host="evil", ranks=1),
        )
        await ws.send(codec.encode(Kind.INVENTORY, {"inventory": offer.model_dump(mode="json")}))
        error = codec.decode(await asyncio.wait_for(ws.recv(), 10))
        assert error.kind is Kind.ERROR
        assert f"admitted to job {open_job}'s window only" in error.body["message"]
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
        # A host part that is not a plain name (a newline for the logs): closed.
        code, codec = await dial(cluster.url, f"open-{open_job}-evil\nhost", open_job)
        assert (code, codec) == (4401, None)
        # A box that holds the secret may not take an open- name either.
        secret, _pin = split_token(cluster.join_token())
        ws = await connect(cluster.url.replace("http://", "ws://") + "/v1/agents/link")
        challenge = wire.decode_plain(await ws.recv(), Kind.CHALLENGE)  # type: ignore[arg-type]
        cnonce, anonce = wire.new_nonce(), str(challenge["nonce"])
        name = f"open-{open_job}-box-d"
        proof = wire.auth_proof(secret, cnonce, anonce, name)
        await ws.send(
            wire.encode_plain(Kind.AUTH, {"worker_id": name, "nonce": cnonce, "proof": proof})
        )
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
        assert ws.close_code == 4401

    asyncio.run(attack())
    assert api.window(other)["ranks"] == 0
    assert api.window(open_job)["ranks"] == 0

    async def lingers() -> Any:
        """An open link that never walks in (sends no INVENTORY)."""
        ws, codec = await dial(cluster.url, f"open-{open_job}-idle", open_job)
        assert codec is not None
        return ws

    async def closed_when_the_window_ends(ws: Any) -> int | None:
        with pytest.raises(ConnectionClosed):  # (it sends nothing, so nothing comes back)
            await asyncio.wait_for(ws.recv(), 20)
        return ws.close_code  # type: ignore[no-any-return]

    # The listener goes on serving honest boxes.
    box = open_join(cluster, open_job, "box-d")
    wait_window(api, open_job, "waiting", ranks=1)

    async def cancel_and_watch() -> int | None:
        idle = await lingers()
        await asyncio.to_thread(api.cancel, open_job)
        return await closed_when_the_window_ends(idle)

    assert asyncio.run(cancel_and_watch()) == 4409  # closed when its window closed
    api.cancel(other)
    assert box.wait(60) == 2  # told the job was cancelled before its world formed
