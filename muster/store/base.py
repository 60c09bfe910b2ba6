"""What every repository shares: the database handle and two helpers."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import select
from sqlalchemy.orm import Session

from muster.errors import NotFound
from muster.store.engine import Database
from muster.store.models import (
    Event,
    Job,
)


def utcnow() -> datetime:
    return datetime.now(UTC)


class LogLineIn(NamedTuple):
    """One captured line as an agent sends it (a plain 6- or 7-sequence in this order will do)."""

    origin: str  # "rank" (a global rank's stdout/stderr) or "node" (torchrun's own lines)
    rank: int  # the global rank, or the node rank for origin "node"
    seq: int  # per (origin, rank), increasing
    time: float  # seconds since the epoch, as time.time() gives
    stream: str  # stdout | stderr
    text: str  # the line; for bytes that are not UTF-8, a display form (see raw_b64)
    raw_b64: str | None = None  # base64 of the exact bytes when they are not UTF-8


class Repository:
    """Holds the database; each public method of a repository is one transaction."""

    def __init__(self, db: Database) -> None:
        self.db = db


def load_job(s: Session, job_id: str, lock: bool = False) -> Job:
    query = select(Job).where(Job.id == job_id)
    if lock:
        query = query.with_for_update()
    job = s.scalars(query).first()
    if job is None:
        raise NotFound(f"job {job_id!r} does not exist; see `muster get jobs`")
    return job


def add_event(
    s: Session,
    kind: str,
    message: str,
    *,
    job: str | None = None,
    worker: str | None = None,
    data: dict[str, Any] | None = None,
) -> None:
    s.add(
        Event(
            job_id=job, worker_id=worker, time=utcnow(), kind=kind, message=message, data=data or {}
        )
    )
