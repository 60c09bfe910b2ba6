"""The rig fixture: a fresh set of namespace hosts per test, torn down even when it fails.

Where namespaces cannot be made the tests skip and say why; CI sets
MUSTER_TEST_REQUIRE_NET=1 (it installs what the rig needs), so there they fail instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.net.rig import Rig, list_namespaces, missing_tools, why_unavailable


def unavailable(why: str) -> None:
    if os.environ.get("MUSTER_TEST_REQUIRE_NET") == "1":
        pytest.fail(f"the network rig is required here (MUSTER_TEST_REQUIRE_NET=1): {why}")
    pytest.skip(why)


def needs(*tools: str) -> None:
    """Skip (or, where required, fail) a test whose tools are not installed."""
    why = missing_tools(*tools)
    if why:
        unavailable(why)


RIG_LOCK = Path(tempfile.gettempdir()) / "muster-test-rig.lock"
RIG_LOCK_WAIT_S = 240.0


@contextlib.contextmanager
def one_rig_at_a_time() -> Iterator[None]:
    """Two rigs at once do not mix (their hosts share the machine's cgroup tree, and an
    agent sweeps the rank groups of any agent of its name). `make test`'s workers keep the
    rig tests to one of them (tests/conftest.py); this lock holds even where they do not."""
    with open(RIG_LOCK, "a") as lock:
        deadline = time.monotonic() + RIG_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"another test held the rig for {RIG_LOCK_WAIT_S:.0f}s")
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def rig() -> Iterator[Rig]:
    why = why_unavailable()
    if why:
        unavailable(why)
    with one_rig_at_a_time(), Rig() as made:
        yield made
    left = [ns for ns in list_namespaces() if ns.startswith(f"{made.tag}-")]
    assert not left, f"namespaces left after the test: {left}"
