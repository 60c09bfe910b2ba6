"""The store: every repository over one database. Each method is one transaction."""

from __future__ import annotations

from typing import NamedTuple

from muster.store.base import LogLineIn, load_job, utcnow
from muster.store.jobs import JobRepository, members_in
from muster.store.models import Condition, Event, Job, Member
from muster.store.records import (
    RecordRepository,
    conditions_in,
    event_count_in,
    events_in,
)
from muster.store.retention import RetentionRepository
from muster.store.workers import WorkerRepository
from muster.store.writes import WriteRepository


class JobView(NamedTuple):
    """A job with its members, events and conditions, read in one transaction."""

    job: Job
    members: list[Member]
    events: list[Event]
    conditions: list[Condition]
    events_total: int | None  # with ``events_last``: how many there are in all


class Store(
    WorkerRepository, JobRepository, RecordRepository, RetentionRepository, WriteRepository
):
    """muster's durable state, over SQLite or PostgreSQL."""

    def job_view(self, job_id: str, events_last: int | None = None) -> JobView:
        """What ``muster describe`` and the dashboard show of a job, in one read transaction
        (on SQLite one snapshot: the members and the state agree); ``events_last``: only the
        newest that many events, and their total."""
        with self.db.read() as s:
            return JobView(
                load_job(s, job_id),
                members_in(s, job_id),
                events_in(s, job_id, events_last),
                conditions_in(s, job_id),
                event_count_in(s, job_id) if events_last else None,
            )


__all__ = ["JobView", "LogLineIn", "Store", "utcnow"]
