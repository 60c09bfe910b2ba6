"""Migrations bring an empty database to the current schema, on SQLite and PostgreSQL."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from muster.errors import StoreUnavailable
from muster.store import current_revision, head_revision, make_engine, open_database, open_store
from muster.store.engine import SCHEMA_HEAD, alembic_config
from muster.store.models import Base
from tests.scheduler.workers import gang


def test_upgrade_empty_database(db_url: str) -> None:
    db = open_database(db_url)
    try:
        assert current_revision(db.engine) == head_revision()
        tables = set(inspect(db.engine).get_table_names())
        assert {
            "workers",
            "jobs",
            "gang_epochs",
            "members",
            "events",
            "conditions",
            "log_lines",
            "artifacts",
            "settings",
        } <= tables
        assert "probe_results" not in tables, "0003 dropped the unused table"
        with db.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], f"models and migrations disagree: {diff}"
    finally:
        db.dispose()


def test_reopening_is_a_no_op(db_url: str) -> None:
    open_database(db_url).dispose()
    db = open_database(db_url)
    assert current_revision(db.engine) == head_revision()
    db.dispose()


def test_sqlite_runs_in_wal_mode(tmp_path: object) -> None:
    engine = make_engine(f"{tmp_path}/wal.db")
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
    engine.dispose()


def test_upgrade_numbers_existing_log_lines_in_time_order(db_url: str) -> None:
    """A database with lines from before 0003 is followed from the start like a new one."""
    engine = make_engine(db_url)
    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0002")
    now = time.time()
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO log_lines (job_id, origin, rank, seq, time_us, stream, text) "
                "VALUES (:j, :o, :r, :q, :t, 'stdout', :x)"
            ),
            [
                {"j": "old-1", "o": "rank", "r": 1, "q": 1, "t": int(now * 1e6) + 2, "x": "c"},
                {"j": "old-1", "o": "rank", "r": 0, "q": 1, "t": int(now * 1e6), "x": "a"},
                {"j": "old-1", "o": "node", "r": 0, "q": 1, "t": int(now * 1e6) + 1, "x": "b"},
            ],
        )
    engine.dispose()
    store = open_store(db_url)
    try:
        assert current_revision(store.db.engine) == head_revision()
        assert [ln.text for ln in store.logs_after("old-1", 0)] == ["a", "b", "c"]
        job = store.submit_job(gang(1))
        store.append_logs("old-1", [("rank", 0, 2, now, "stdout", "d")])
        assert [ln.text for ln in store.logs_after("old-1", 3)] == ["d"], "new lines follow"
        assert store.logs_after(job.id, 0) == []
    finally:
        store.db.dispose()


def test_the_schema_head_constant_is_alembics_head() -> None:
    assert head_revision() == SCHEMA_HEAD, "a new migration: set engine.SCHEMA_HEAD to it"


def test_a_current_database_opens_without_alembic(tmp_path: Path) -> None:
    """Opening a database already at head (every start but the first) skips alembic and its
    imports; a new one is still migrated."""
    check = (
        "import sys\nfrom muster.store import open_store\n"
        "open_store(sys.argv[1]).db.dispose()\n"
        "print('alembic' in sys.modules)\n"
    )
    path = str(tmp_path / "m.db")
    for expected in ("True", "False", "False"):
        done = subprocess.run(
            [sys.executable, "-c", check, path], capture_output=True, text=True, timeout=60
        )
        assert done.stdout.strip() == expected, done.stderr


def test_opening_a_current_database_does_not_wait_for_a_writer(tmp_path: Path) -> None:
    """Reading the schema's revision takes no write lock: a writer elsewhere (a controller's
    group commit) does not hold up a `muster token` or an agent's start."""
    path = tmp_path / "m.db"
    open_database(str(path)).dispose()
    writer = sqlite3.connect(path, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        open_database(str(path)).dispose()
        assert time.monotonic() - started < 3, "the open waited for the write lock"
    finally:
        writer.execute("ROLLBACK")
        writer.close()


def test_a_file_that_is_no_database_is_named_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are my notes, not a database" * 200)
    with pytest.raises(StoreUnavailable, match="check --db and that the file is muster's"):
        open_database(str(path))
