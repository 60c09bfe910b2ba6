"""Shared fixtures: fresh databases on both engines (SQLite file, real PostgreSQL server)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import settings

from tests.pg import PostgresServer, start_postgres

# No per-example deadline: an example that takes 2 ms idle can take 300 ms on a busy CI
# runner, and Hypothesis would fail it as "unreliable timings". Tests that need a bound say so.
settings.register_profile("muster", deadline=None)
settings.load_profile("muster")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`make test` runs two pytest-xdist workers (--dist loadgroup). The namespace-rig tests
    go to one of them, one after another: each builds hosts, routers and WireGuard devices
    and mostly waits on them, so they overlap well with the CPU-bound rest. Two rigs at once
    do not mix: their hosts share the machine's cgroup tree, and an agent starting on one
    sweeps the rank groups of the other's agent of the same name."""
    for item in items:
        if item.nodeid.startswith("tests/net/") or "rig" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("rig"))


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server, why_not = start_postgres()
    if server is None:
        if os.environ.get("MUSTER_TEST_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"PostgreSQL is required here (MUSTER_TEST_REQUIRE_POSTGRES=1): {why_not}")
        pytest.skip(f"PostgreSQL not available: {why_not}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The URL of a new, empty database on each engine."""
    if request.param == "sqlite":
        return str(tmp_path_factory.mktemp("db") / "muster.db")
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return server.create_database(f"t_{uuid.uuid4().hex[:12]}")
