"""`muster join --ssh` through a real OpenSSH server on loopback, with the guarded join
sshd recipe (forwarding to the controller's port only, no shell): a walk-in that reaches
the controller only through the tunnel trains in the same world as one that dials directly."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from muster.cli.local import LocalCluster
from tests.e2e.helpers import all_lines, submit, wait_state
from tests.e2e.test_window import wait_window, walk_in, window_job
from tests.sshd import Sshd, sshd_or_skip

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(agents=0, heartbeat_interval=1.0, heartbeat_timeout=5.0) as c:
        yield c


@pytest.fixture(scope="module")
def sshd(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    server = sshd_or_skip(tmp_path_factory.mktemp("sshd"), cluster.port)
    yield server
    server.stop()


def ssh_flags(sshd: Sshd, *, key: Path | None = None) -> list[str]:
    flags = ["--ssh", f"root@127.0.0.1:{sshd.port}", "--ssh-identity", str(key or sshd.key)]
    for option in sshd.client_options:
        flags += ["--ssh-option", option]
    return flags


def test_a_walk_in_through_the_guarded_tunnel_trains_with_a_direct_one(
    cluster: LocalCluster, sshd: Sshd, tmp_path: Path
) -> None:
    api = cluster.client()
    job = submit(api, window_job(tmp_path, "tunnel", {"join_timeout": "10m"}))
    direct = walk_in(cluster, job, "near")
    wait_window(api, job, "waiting", ranks=1)
    # The positional address is the controller as the ssh host sees it.
    tunneled = walk_in(cluster, job, "far", *ssh_flags(sshd))
    done = wait_state(api, job, timeout=180)
    assert done["state"] == "succeeded", done["root_cause"]
    texts = [ln["text"] for ln in all_lines(api, job) if ln["origin"] == "rank"]
    assert sorted(t for t in texts if t.startswith("rank")) == [
        f"rank {r} of 2 sum=3" for r in range(2)
    ]
    assert direct.wait(60) == 0
    assert tunneled.wait(60) == 0
    log = cluster.log("join-far").read_text()
    assert f"connected to http://127.0.0.1:{cluster.port} " not in log  # it never dialled direct
    assert "connected to http://127.0.0.1:" in log
    assert "Accepted publickey" in sshd.log.read_text()


def test_the_guarded_key_forwards_to_nothing_else_and_runs_no_command(
    cluster: LocalCluster, sshd: Sshd
) -> None:
    base = [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-i",
        str(sshd.key),
        "-p",
        str(sshd.port),
        *(f"-o{o}" for o in sshd.client_options),
        "root@127.0.0.1",
    ]
    shell = subprocess.run([*base, "echo", "escaped"], capture_output=True, text=True, timeout=30)
    assert "escaped" not in shell.stdout
    assert shell.returncode != 0
    # A forward anywhere but the controller's port is refused by the server.
    other = subprocess.run(
        [*base[:-1], "-W", "127.0.0.1:22", base[-1]],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert other.returncode != 0
    assert "prohibited" in other.stderr or "open failed" in other.stderr


def test_a_key_the_server_does_not_know_fails_at_once_without_a_prompt(
    cluster: LocalCluster, sshd: Sshd, tmp_path: Path
) -> None:
    stranger = tmp_path / "stranger_ed25519"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)],
        check=True,
        capture_output=True,
    )
    api = cluster.client()
    job = submit(api, window_job(tmp_path, "stranger", {"start": "manual"}))
    box = walk_in(cluster, job, "stranger", *ssh_flags(sshd, key=stranger))
    assert box.wait(60) == 1
    log = cluster.log("join-stranger").read_text()
    assert "ssh to root@127.0.0.1" in log
    assert "Permission denied" in log
    assert api.window(job)["ranks"] == 0
    api.cancel(job)
