"""Migrations bring an empty database to the current schema, on SQLite and PostgreSQL."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from muster.store import current_revision, head_revision, make_engine, open_database
from muster.store.models import Base


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
            "probe_results",
        } <= tables
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
