"""The store: every repository over one database. Each method is one transaction."""

from __future__ import annotations

from muster.store.base import LogLineIn, utcnow
from muster.store.jobs import JobRepository
from muster.store.records import RecordRepository
from muster.store.retention import RetentionRepository
from muster.store.workers import WorkerRepository
from muster.store.writes import WriteRepository


class Store(
    WorkerRepository, JobRepository, RecordRepository, RetentionRepository, WriteRepository
):
    """muster's durable state, over SQLite or PostgreSQL."""


__all__ = ["LogLineIn", "Store", "utcnow"]
