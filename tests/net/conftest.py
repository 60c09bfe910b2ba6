"""The rig fixture: a fresh set of namespace hosts per test, torn down even when it fails.

Where namespaces cannot be made the tests skip and say why; CI sets
MUSTER_TEST_REQUIRE_NET=1 (it installs what the rig needs), so there they fail instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

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


@pytest.fixture
def rig() -> Iterator[Rig]:
    why = why_unavailable()
    if why:
        unavailable(why)
    with Rig() as made:
        yield made
    left = [ns for ns in list_namespaces() if ns.startswith(f"{made.tag}-")]
    assert not left, f"namespaces left after the test: {left}"
