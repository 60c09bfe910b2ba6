"""One controller per database: a second one refuses and names the holder."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from muster.cli.local import LocalCluster
from muster.controller.app import ControllerConfig, create_app
from muster.controller.lease import ControllerLease
from muster.controller.tls import controller_certificate
from muster.errors import UserError
from muster.store import Store, open_store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    st = open_store(str(tmp_path / "muster.db"))
    yield st
    st.db.dispose()


def test_a_second_controller_on_the_same_database_refuses(store: Store, tmp_path: Path) -> None:
    create_app(ControllerConfig(store=store, artifacts=tmp_path / "a", port=7070))
    other = ControllerLease(store, 7071)
    other.pid = os.getpid() + 1  # another process of this host, alive as far as it knows
    other.holder = f"{other.host} pid {other.pid} port 7071"
    with pytest.raises(UserError, match=r"another muster server holds this database: .* port 7070"):
        other.acquire()


def test_a_killed_controllers_lease_is_taken_over_at_once(store: Store) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = ControllerLease(store, 7070)
    gone.pid, gone.holder = dead.pid, f"{gone.host} pid {dead.pid} port 7070"
    gone.acquire()
    ControllerLease(store, 7071).acquire()  # no wait for the 30 s expiry


def test_the_lease_expires_when_not_renewed(store: Store) -> None:
    far = ControllerLease(store, 7070)
    far.host, far.holder = "elsewhere", "elsewhere pid 1 port 7070"
    assert (
        store.acquire_lease(far.holder, now=time.time() - 60, ttl=30, stale=lambda _: False) is None
    )
    ControllerLease(store, 7071).acquire()


def test_certificate_and_key_are_made_together(store: Store) -> None:
    cert, key = controller_certificate(store)
    assert "BEGIN CERTIFICATE" in cert
    assert "PRIVATE KEY" in key
    assert controller_certificate(store) == (cert, key)


def test_muster_server_refuses_to_start_on_a_held_database(tmp_path: Path) -> None:
    with LocalCluster(agents=0) as cluster:
        env = {**os.environ, "MUSTER_DATA_DIR": str(cluster.data_dir)}
        done = subprocess.run(
            [sys.executable, "-m", "muster", "server", "--port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )
        assert done.returncode == 2
        assert "another muster server holds this database" in done.stderr
        assert f"port {cluster.port}" in done.stderr
