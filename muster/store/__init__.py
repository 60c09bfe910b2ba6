"""Durable state: SQLAlchemy models, alembic migrations, repositories. SQLite or PostgreSQL."""

from muster.store.engine import (
    Database,
    current_revision,
    data_dir,
    default_url,
    ensure_data_dir,
    head_revision,
    make_engine,
    migrate,
    open_database,
)
from muster.store.records import LogAppendResult, LogLinesRejected, RejectedLine
from muster.store.repo import LogLineIn, Store, utcnow


def open_store(url: str | None = None) -> Store:
    """Open (create, migrate) the store at ``url``: SQLite path/URL or postgresql://..."""
    return Store(open_database(url))


__all__ = [
    "Database",
    "LogAppendResult",
    "LogLineIn",
    "LogLinesRejected",
    "RejectedLine",
    "Store",
    "current_revision",
    "data_dir",
    "default_url",
    "ensure_data_dir",
    "head_revision",
    "make_engine",
    "migrate",
    "open_database",
    "open_store",
    "utcnow",
]
