"""The durable tables. Every change to them ships as an alembic migration (store/migrations).

Times are UTC, stored as timezone-aware timestamps. Specs and inventories are JSON copies of
the pydantic models, so an old row can always be read back by the model that wrote it.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Integer primary keys that autoincrement on both engines (SQLite only does so for INTEGER).
AutoId = BigInteger().with_variant(Integer(), "sqlite")


class Prose(TypeDecorator[str]):
    """TEXT for the words muster writes for people (root causes, reasons, event messages),
    which can quote a rank's last lines. PostgreSQL's text cannot hold NUL (the group
    commit failed, and the writes of that step with it: a job's FAILED among them) and
    SQLite's text functions stop at one: a NUL is written as the two characters \\0. (Log
    lines are stored losslessly elsewhere: ``log_lines``.)"""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        if value is not None and "\x00" in value:
            return value.replace("\x00", "\\0")
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSON,
        datetime: DateTime(timezone=True),
    }


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    advertise_address: Mapped[str | None] = mapped_column(String(255))
    inventory: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16), index=True)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), index=True)
    joined_at: Mapped[datetime]
    last_seen: Mapped[datetime]


class Job(Base):
    __tablename__ = "jobs"

    seq: Mapped[int] = mapped_column(AutoId, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(80), unique=True)
    name: Mapped[str] = mapped_column(String(63), index=True)
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16), index=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    path_class: Mapped[str | None] = mapped_column(String(16))
    why_pending: Mapped[str | None] = mapped_column(Prose)
    root_cause: Mapped[str | None] = mapped_column(Prose)
    bundle_sha256: Mapped[str | None] = mapped_column(String(64))
    submitted_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class GangEpoch(Base):
    """One attempt at running a job's gang with a fixed member set."""

    __tablename__ = "gang_epochs"
    __table_args__ = (UniqueConstraint("job_id", "number"),)

    id: Mapped[int] = mapped_column(AutoId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    path_class: Mapped[str] = mapped_column(String(16))
    master_addr: Mapped[str | None] = mapped_column(String(255))
    master_port: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime]


class Member(Base):
    """Node rank r of one gang epoch, on one worker."""

    __tablename__ = "members"
    __table_args__ = (
        UniqueConstraint("epoch_id", "node_rank"),
        UniqueConstraint("epoch_id", "worker_id"),
    )

    id: Mapped[int] = mapped_column(AutoId, primary_key=True, autoincrement=True)
    epoch_id: Mapped[int] = mapped_column(ForeignKey("gang_epochs.id"), index=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    node_rank: Mapped[int] = mapped_column(Integer)
    worker_id: Mapped[str] = mapped_column(ForeignKey("workers.id"), index=True)
    state: Mapped[str] = mapped_column(String(16))
    exit_code: Mapped[int | None] = mapped_column(Integer)
    signal: Mapped[str | None] = mapped_column(String(16))
    advertise_address: Mapped[str | None] = mapped_column(String(255))
    path_address: Mapped[str | None] = mapped_column(String(255))
    assigned_at: Mapped[datetime | None]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_job_time", "job_id", "id"),)

    id: Mapped[int] = mapped_column(AutoId, primary_key=True, autoincrement=True)
    job_id: Mapped[str | None] = mapped_column(String(80))
    worker_id: Mapped[str | None] = mapped_column(String(128))
    time: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Prose)
    data: Mapped[dict[str, Any]]


class Condition(Base):
    """Kubernetes-style conditions: GangReady, NetworkQualified, NetworkDegraded, ..."""

    __tablename__ = "conditions"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    type: Mapped[str] = mapped_column(String(64), primary_key=True)
    status: Mapped[str] = mapped_column(String(8))  # True | False | Unknown
    reason: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Prose)
    last_transition: Mapped[datetime]


class LogLine(Base):
    """One line a rank (origin 'rank') or a node's launcher (origin 'node') wrote.

    (job, origin, rank, seq) is the key, so a resent batch never duplicates a line. The time
    is microseconds since the epoch (UTC): this is the table that grows fastest.

    Lossless text: column ``text`` holds the line as clean UTF-8 text. A line that is not
    (it holds NUL, which PostgreSQL text refuses, or bytes that are not UTF-8) also keeps its
    exact bytes in ``raw``; ``text`` then holds a display form (U+FFFD for each NUL or bad
    byte). Read ``text`` (the line, NUL included; U+FFFD only for bytes that are not UTF-8),
    ``data`` (the exact bytes) or ``raw_b64`` (base64 of the bytes when ``text`` cannot give
    them back, else None).

    ``ingest_id`` numbers a job's lines in the order they were stored (1, 2, ...; gaps
    allowed); a reader that remembers the last one it saw misses and repeats nothing, since
    a job's lines are stored one transaction at a time (see records.py).
    """

    __tablename__ = "log_lines"
    # One B-tree in key order on SQLite instead of a rowid table plus a key index.
    __table_args__ = (
        Index("ix_log_lines_job_ingest", "job_id", "ingest_id"),
        {"sqlite_with_rowid": False},
    )

    job_id: Mapped[str] = mapped_column(String(80), primary_key=True)
    origin: Mapped[str] = mapped_column(String(8), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    time_us: Mapped[int] = mapped_column(BigInteger)
    stream: Mapped[str] = mapped_column(String(8))
    stored_text: Mapped[str] = mapped_column("text", Text)
    raw: Mapped[bytes | None] = mapped_column(LargeBinary)
    ingest_id: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))

    @property
    def time(self) -> datetime:
        return datetime.fromtimestamp(self.time_us / 1e6, tz=UTC)

    @property
    def text(self) -> str:
        """The line as text: exact unless its bytes are not UTF-8 (then U+FFFD for those)."""
        if self.raw is None:
            return self.stored_text
        return self.raw.decode("utf-8", errors="replace")

    @property
    def data(self) -> bytes:
        """The line's exact bytes, as the rank wrote them (without the newline)."""
        return self.stored_text.encode() if self.raw is None else self.raw

    @property
    def raw_b64(self) -> str | None:
        """Base64 of the exact bytes when ``text`` cannot give them back, else None."""
        if self.raw is None:
            return None
        try:
            self.raw.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(self.raw).decode("ascii")
        return None


class Artifact(Base):
    __tablename__ = "artifacts"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    node_rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str] = mapped_column(String(1024), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    stored_at: Mapped[datetime]


class Setting(Base):
    """Controller-wide values that must survive a restart (the join token, ...)."""

    __tablename__ = "settings"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
