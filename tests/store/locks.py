"""Holding SQLite's write lock from another connection, as a busy writer would."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def held_write_lock(path: str) -> Iterator[None]:
    """Keep a write transaction open on the SQLite file ``path`` for the ``with`` body."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=10)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO settings (key, value) VALUES ('held', 'by another writer')")
        yield
        conn.execute("ROLLBACK")
    finally:
        conn.close()
