"""What a running job leaves behind: events, conditions, log lines, artifacts, settings.

Log lines arrive as (origin, rank, seq, time, stream, text[, raw_b64]): ``raw_b64``, when
present and not None, is base64 of the line's exact bytes (the agent sends it for a line
that is not UTF-8; ``text`` is then a display form). The store keeps every line losslessly:
clean UTF-8 text without NUL goes in ``log_lines.text``; any other line (NUL, which
PostgreSQL text refuses, bytes that are not UTF-8, or a str holding lone surrogates) also
keeps its exact bytes in ``log_lines.raw`` and shows U+FFFD in ``text``. See ``LogLine``
for reading them back.

A job's lines get increasing ``ingest_id``s as they are stored; the writers of one job are
serialized (SQLite: the write lock; PostgreSQL: a transaction-scoped advisory lock on the
job), so a reader sees a job's lines as a prefix in ingest order and ``logs_after(after=N)``
misses and repeats nothing.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Select, and_, false, func, or_, select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from muster.errors import BadRequest, StoreUnavailable
from muster.store.base import Repository, add_event, utcnow
from muster.store.models import (
    Artifact,
    Condition,
    Event,
    LogLine,
    Setting,
)

LEASE_KEY = "controller_lease"  # settings row: who runs the controller on this database

ORIGINS = ("rank", "node")
STREAMS = ("stdout", "stderr")
MAX_JOB_ID = 80  # log_lines.job_id is VARCHAR(80)
_INT32, _INT64 = 2**31, 2**63

#: One row of log_lines as the insert statements take it (job first, ingest id last).
Row = tuple[str, str, int, int, int, str, str, bytes | None, int]


class LogLinesRejected(BadRequest, ValueError):
    """The store refused log lines: the message names the job, the line and the reason.

    It is also a ValueError so callers written for the older contract (TypeError or
    ValueError on a malformed line) keep catching it.
    """


@dataclass(frozen=True)
class RejectedLine:
    """A line the store could not keep, as it was given, and why."""

    job_id: str
    line: Any
    reason: str


@dataclass
class LogAppendResult:
    """What ``append_logs_salvaging`` did: how many lines were new, which it refused."""

    stored: int = 0
    rejected: list[RejectedLine] = field(default_factory=list)


class _BadLine(Exception):
    """One line that cannot be stored (internal: becomes a RejectedLine or LogLinesRejected)."""


class RecordRepository(Repository):
    # ---- events, conditions --------------------------------------------------------------

    def record_event(
        self,
        kind: str,
        message: str,
        *,
        job: str | None = None,
        worker: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        with self.db.transaction() as s:
            add_event(s, kind, message, job=job, worker=worker, data=data)

    def events(self, job_id: str | None = None, last: int | None = None) -> list[Event]:
        """Events in order (of ``job_id``); with ``last``, only the newest that many."""
        with self.db.read() as s:
            return events_in(s, job_id, last)

    def event_count(self, job_id: str) -> int:
        with self.db.read() as s:
            return event_count_in(s, job_id)

    def window_opened_at(self, job_id: str) -> float | None:
        """When the join window of ``job_id`` opened (epoch seconds), as its WindowOpened
        event says; None when none has, or an epoch was fenced since (a new window)."""
        with self.db.read() as s:
            row = s.execute(
                select(Event.kind, Event.data)
                .where(Event.job_id == job_id, Event.kind.in_(("WindowOpened", "EpochFenced")))
                .order_by(Event.id.desc())
                .limit(1)
            ).first()
        if row is None or row[0] != "WindowOpened":
            return None
        opened = (row[1] or {}).get("opened_at")
        return float(opened) if isinstance(opened, (int, float)) else None

    def set_condition(
        self, job_id: str, type_: str, status: bool | None, reason: str, message: str
    ) -> None:
        text = "Unknown" if status is None else str(status)
        with self.db.transaction() as s:
            row = s.get(Condition, (job_id, type_))
            if row is None:
                s.add(
                    Condition(
                        job_id=job_id,
                        type=type_,
                        status=text,
                        reason=reason,
                        message=message,
                        last_transition=utcnow(),
                    )
                )
            else:
                if row.status != text:
                    row.last_transition = utcnow()
                row.status, row.reason, row.message = text, reason, message

    def conditions(self, job_id: str) -> list[Condition]:
        with self.db.read() as s:
            return conditions_in(s, job_id)

    # ---- logs ----------------------------------------------------------------------------

    def append_logs(self, job_id: str, lines: Sequence[Sequence[Any]]) -> int:
        """Store a batch of one job's lines in one transaction; returns how many were new.

        Each line is a LogLineIn or any sequence in its order (origin, rank, seq, time,
        stream, text[, raw_b64]). A line already stored (same job, origin, rank, seq) is
        skipped, so an agent may resend a batch it is unsure of. Raises LogLinesRejected
        on a line of the wrong shape, storing nothing.
        """
        return self.append_logs_by_job({job_id: lines})

    def append_logs_by_job(self, lines_by_job: Mapping[str, Sequence[Sequence[Any]]]) -> int:
        """Several jobs' lines in one transaction; all or nothing.

        Raises LogLinesRejected (naming the job, line and reason) when any line is malformed
        or the database refuses the batch; StoreUnavailable when the database is down. This
        is the hot path of log ingest, so it talks to the driver directly: executemany on
        SQLite, unnest() on PostgreSQL.
        """
        batches: dict[str, list[_Clean]] = {}
        for job_id, lines in lines_by_job.items():
            for index, line in enumerate(lines):
                try:
                    batches.setdefault(job_id, []).append(_clean(job_id, line))
                except _BadLine as exc:
                    raise LogLinesRejected(
                        f"job {job_id!r}: log line {index} {_describe(line)} cannot be stored: "
                        f"{exc}; nothing of this batch was stored"
                    ) from None
        try:
            return self._insert_lines(batches)
        except DBAPIError as exc:
            raise LogLinesRejected(
                f"the database refused the log lines of job(s) {', '.join(map(repr, batches))}: "
                f"{_db_reason(exc)}; nothing of this batch was stored; "
                "append_logs_salvaging stores what it can"
            ) from exc

    def append_logs_salvaging(
        self, lines_by_job: Mapping[str, Sequence[Sequence[Any]]]
    ) -> LogAppendResult:
        """Store every line that can be stored; return how many were new and the rest, with why.

        For an ingest loop that must never stall on one poison line: malformed lines are
        set aside first; the others go in one transaction, and if the database still
        refuses it, per job and then in halves until the lines it refuses are found. Each
        job with refused lines gets a ``LogLinesRejected`` event (what `muster describe`
        shows). Raises only StoreUnavailable (the database is down: retry the whole batch
        later; nothing refused is lost).
        """
        result = LogAppendResult()
        batches: dict[str, list[_Clean]] = {}
        for job_id, lines in lines_by_job.items():
            for line in lines:
                try:
                    batches.setdefault(job_id, []).append(_clean(job_id, line))
                except _BadLine as exc:
                    result.rejected.append(RejectedLine(str(job_id), line, str(exc)))
        try:
            result.stored = self._insert_lines(batches)
        except DBAPIError:
            for job_id, cleaned in batches.items():
                result.stored += self._insert_bisecting(job_id, cleaned, result.rejected)
        if result.rejected:
            self._record_rejections(result.rejected)
        return result

    def _insert_bisecting(
        self, job_id: str, lines: list[_Clean], rejected: list[RejectedLine]
    ) -> int:
        """Store ``lines`` in ever smaller transactions; refused single lines go to ``rejected``."""
        try:
            return self._insert_lines({job_id: lines})
        except DBAPIError as exc:  # not OperationalError: the transaction raised that as
            # StoreUnavailable, which goes up to the caller
            if len(lines) == 1:
                rejected.append(RejectedLine(job_id, lines[0].given, _db_reason(exc)))
                return 0
        half = len(lines) // 2
        return self._insert_bisecting(job_id, lines[:half], rejected) + self._insert_bisecting(
            job_id, lines[half:], rejected
        )

    def _record_rejections(self, rejected: list[RejectedLine]) -> None:
        by_job: dict[str, list[RejectedLine]] = {}
        for r in rejected:
            by_job.setdefault(r.job_id, []).append(r)
        with self.db.transaction() as s:
            for job_id, lines in by_job.items():
                if len(job_id) > MAX_JOB_ID or "\x00" in job_id:
                    continue  # no job can have that id: nothing to attach the event to
                first = lines[0]
                add_event(
                    s,
                    "LogLinesRejected",
                    f"{len(lines)} log line(s) could not be stored; the first, "
                    f"{_describe(first.line)}: {first.reason}".replace("\x00", "\\0"),
                    job=job_id,
                    data={"count": len(lines)},
                )

    def _insert_lines(self, batches: Mapping[str, list[_Clean]]) -> int:
        """One transaction: number each job's new lines after its last, insert, count new."""
        batches = {job: lines for job, lines in batches.items() if lines}
        if not batches:
            return 0
        stored = 0
        with self.db.transaction() as s:
            conn = s.connection()
            for job_id in sorted(batches):  # one lock order, so two ingesters never deadlock
                rows = _numbered(job_id, batches[job_id], _last_ingest_id(conn, job_id))
                if self.db.dialect == "postgresql":
                    columns = list(zip(*rows, strict=True))
                    result = conn.exec_driver_sql(
                        _PG_INSERT_LINES, (job_id, *(list(c) for c in columns[1:]))
                    )
                else:
                    result = conn.exec_driver_sql(_SQLITE_INSERT_LINES, rows)
                stored += max(result.rowcount, 0)
        return stored

    def logs(
        self,
        job_id: str,
        *,
        rank: int | None = None,
        origin: str = "rank",
        after: int = 0,
        limit: int | None = None,
    ) -> list[LogLine]:
        """Lines of one job in (time, rank, seq) order; ``after`` skips seq <= after."""
        with self.db.read() as s:
            query = select(LogLine).where(LogLine.job_id == job_id, LogLine.origin == origin)
            if rank is not None:
                query = query.where(LogLine.rank == rank)
            if after:
                query = query.where(LogLine.seq > after)
            query = query.order_by(LogLine.time_us, LogLine.rank, LogLine.seq)
            if limit is not None:
                query = query.limit(limit)
            return list(s.scalars(query))

    def logs_after(
        self,
        job_id: str,
        after: int,
        *,
        ranks: Sequence[int] | None = None,
        origin: str | None = None,
        limit: int = 10_000,
        runs: Sequence[tuple[int, int]] | None = None,
        launcher: int | None = None,
    ) -> list[LogLine]:
        """Lines stored after the line whose ``ingest_id`` is ``after`` (0: from the start).

        In ingest order, at most ``limit``. The next call's ``after`` is the last line's
        ``ingest_id`` (or the same ``after`` when none came): no line is missed or repeated,
        whatever the number of ranks. Filters (see ``_log_filter``): ``ranks`` (or ``runs``
        of them, inclusive ranges) keep those global ranks' own lines; ``origin="node"``
        only launcher lines (of the nodes in ``ranks``/``runs``, when given); ``launcher``
        adds that node's launcher lines to the ranks'.
        """
        _check_cursor("logs_after", after)
        with self.db.read() as s:
            query = select(LogLine).where(LogLine.job_id == job_id, LogLine.ingest_id > after)
            query = _log_filter(query, _runs(ranks, runs), origin, launcher)
            return list(s.scalars(query.order_by(LogLine.ingest_id).limit(limit)))

    def logs_before(
        self,
        job_id: str,
        before: int | None,
        *,
        ranks: Sequence[int] | None = None,
        origin: str | None = None,
        limit: int = 10_000,
        runs: Sequence[tuple[int, int]] | None = None,
        launcher: int | None = None,
    ) -> list[LogLine]:
        """The last ``limit`` lines stored before the line whose ``ingest_id`` is ``before``
        (None: the job's newest lines), in ingest order: a page further back, for a reader
        that scrolls up (the dashboard) or starts at the tail. Filters as ``logs_after``."""
        if before is not None:
            _check_cursor("logs_before", before)
        with self.db.read() as s:
            query = select(LogLine).where(LogLine.job_id == job_id)
            if before is not None:
                query = query.where(LogLine.ingest_id < before)
            query = _log_filter(query, _runs(ranks, runs), origin, launcher)
            newest_first = s.scalars(query.order_by(LogLine.ingest_id.desc()).limit(limit))
            return list(newest_first)[::-1]

    # ---- artifacts, settings -------------------------------------------------------------

    def add_artifact(self, job_id: str, node_rank: int, path: str, size: int, sha256: str) -> None:
        with self.db.transaction() as s:
            s.merge(
                Artifact(
                    job_id=job_id,
                    node_rank=node_rank,
                    path=path,
                    size=size,
                    sha256=sha256,
                    stored_at=utcnow(),
                )
            )

    def artifacts(self, job_id: str) -> list[Artifact]:
        with self.db.read() as s:
            query = select(Artifact).where(Artifact.job_id == job_id)
            return list(s.scalars(query.order_by(Artifact.node_rank, Artifact.path)))

    def setting(self, key: str, default: Callable[[], str]) -> str:
        """The stored value of ``key``, storing ``default()`` first when there is none.

        Two processes racing to create it agree on whichever stored it first.
        """
        value = self.get_setting(key)
        if value is not None:
            return value
        try:
            with self.db.transaction() as s:
                row = s.get(Setting, key)
                if row is None:
                    row = Setting(key=key, value=default())
                    s.add(row)
                return row.value
        except IntegrityError:
            value = self.get_setting(key)
            if value is None:
                raise
            return value

    def setting_group(self, make: Callable[[], dict[str, str]]) -> dict[str, str]:
        """Values that only make sense together (a certificate and its key): stored in one
        transaction from ``make()`` unless every one of them is there already."""
        for _attempt in range(2):
            try:
                with self.db.transaction() as s:
                    fresh = make()
                    rows = {k: s.get(Setting, k) for k in fresh}
                    if all(row is not None for row in rows.values()):
                        return {k: row.value for k, row in rows.items() if row is not None}
                    for key, value in fresh.items():
                        s.merge(Setting(key=key, value=value))
                    return fresh
            except IntegrityError:
                continue  # another process stored them first: read theirs
        raise StoreUnavailable("could not store the settings; try again")

    def acquire_lease(
        self,
        holder: str,
        *,
        now: float,
        ttl: float,
        stale: Callable[[dict[str, Any]], bool],
        info: Mapping[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Take (or renew) the controller lease: one ``muster server`` per database.

        Returns None when ``holder`` holds it now, or the current holder's record when
        another live controller does (its lease not expired, and ``stale`` says it is
        alive). Taken in one transaction, so two starting controllers cannot both win.
        """
        record = {**(info or {}), "holder": holder, "expires": now + ttl, "since": now}
        for _attempt in range(2):
            try:
                with self.db.transaction() as s:
                    row = s.get(Setting, LEASE_KEY, with_for_update=True)
                    if row is None:
                        s.add(Setting(key=LEASE_KEY, value=json.dumps(record)))
                        return None
                    current = json.loads(row.value)
                    if (
                        current.get("holder") != holder
                        and float(current.get("expires", 0)) > now
                        and not stale(current)
                    ):
                        return dict(current)
                    if current.get("holder") == holder:
                        record["since"] = float(current.get("since", now))
                    row.value = json.dumps(record)
                    return None
            except IntegrityError:
                continue
        raise StoreUnavailable("could not take the controller lease; try again")

    def release_lease(self, holder: str) -> None:
        """Give the lease up (a clean stop), if ``holder`` still holds it."""
        with self.db.transaction() as s:
            row = s.get(Setting, LEASE_KEY, with_for_update=True)
            if row is not None and json.loads(row.value).get("holder") == holder:
                s.delete(row)

    def put_settings(self, values: Mapping[str, str]) -> None:
        """Store several values in one transaction."""
        with self.db.transaction() as s:
            for key, value in values.items():
                s.merge(Setting(key=key, value=value))

    def put_setting(self, key: str, value: str) -> None:
        with self.db.transaction() as s:
            s.merge(Setting(key=key, value=value))

    def get_setting(self, key: str) -> str | None:
        with self.db.read() as s:
            row = s.get(Setting, key)
            return None if row is None else row.value


@dataclass(frozen=True)
class _Clean:
    """A line checked and ready to insert, with what it was given (for a rejection)."""

    origin: str
    rank: int
    seq: int
    time_us: int
    stream: str
    text: str
    raw: bytes | None
    given: Any


def _clean(job_id: object, line: Any) -> _Clean:
    """Check one line and split it into the stored text and, when needed, exact bytes."""
    if not isinstance(job_id, str) or not 0 < len(job_id) <= MAX_JOB_ID or "\x00" in job_id:
        raise _BadLine(f"job id {job_id!r} is not a job id")
    if isinstance(line, (str, bytes)) or not isinstance(line, Sequence):
        raise _BadLine("a line is a list (origin, rank, seq, time, stream, text[, raw_b64])")
    if len(line) not in (6, 7):
        raise _BadLine(
            f"a line has 6 or 7 fields (origin, rank, seq, time, stream, text[, raw_b64]), "
            f"not {len(line)}"
        )
    origin, rank, seq, when, stream, text = line[:6]
    raw_b64 = line[6] if len(line) == 7 else None
    if origin not in ORIGINS:
        raise _BadLine(f"origin {origin!r} is not one of {', '.join(ORIGINS)}")
    if stream not in STREAMS:
        raise _BadLine(f"stream {stream!r} is not one of {', '.join(STREAMS)}")
    rank_n, seq_n = _integer("rank", rank, _INT32), _integer("seq", seq, _INT64)
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        raise _BadLine(f"time {when!r} is not seconds since the epoch")
    time_us = int(when * 1e6)
    if not -_INT64 <= time_us < _INT64:
        raise _BadLine(f"time {when!r} is out of range")
    if not isinstance(text, str):
        raise _BadLine(f"text is {type(text).__name__}, not a string")
    if raw_b64 is not None:
        if not isinstance(raw_b64, str):
            raise _BadLine(f"raw_b64 is {type(raw_b64).__name__}, not a base64 string")
        try:
            data = base64.b64decode(raw_b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise _BadLine(f"raw_b64 is not base64: {exc}") from None
    else:
        exact = _text_bytes(text)
        if exact is None:
            return _Clean(origin, rank_n, seq_n, time_us, stream, text, None, line)
        data = exact
    stored, raw = _split_bytes(data)
    return _Clean(origin, rank_n, seq_n, time_us, stream, stored, raw, line)


def _text_bytes(text: str) -> bytes | None:
    """None when ``text`` is clean (UTF-8 encodable, no NUL), else its exact bytes.

    Lone surrogates are taken as Python's surrogateescape writes undecodable bytes.
    """
    if "\x00" not in text:
        try:
            text.encode("utf-8")
            return None
        except UnicodeEncodeError:
            pass
    try:
        return text.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="surrogatepass")


def _split_bytes(data: bytes) -> tuple[str, bytes | None]:
    """(text for the text column, exact bytes or None when the text gives them back)."""
    try:
        text = data.decode("utf-8")
        if "\x00" not in text:
            return text, None
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
    return text.replace("\x00", "\ufffd"), data


def _integer(name: str, value: Any, bound: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
        raise _BadLine(f"{name} {value!r} is not an integer in 0..{bound - 1}")
    return value


def _numbered(job_id: str, lines: list[_Clean], last: int) -> list[Row]:
    """Rows in (time, origin, rank, seq) order, numbered after the job's ``last`` ingest id."""
    ordered = sorted(lines, key=lambda c: (c.time_us, c.origin, c.rank, c.seq))
    return [
        (job_id, c.origin, c.rank, c.seq, c.time_us, c.stream, c.text, c.raw, last + i)
        for i, c in enumerate(ordered, start=1)
    ]


def _last_ingest_id(conn: Connection, job_id: str) -> int:
    """The job's highest ingest id, holding (PostgreSQL) the job's ingest lock till commit."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (job_id,))
        query = "SELECT coalesce(max(ingest_id), 0) FROM log_lines WHERE job_id = %s"
    else:
        query = "SELECT coalesce(max(ingest_id), 0) FROM log_lines WHERE job_id = ?"
    return int(conn.exec_driver_sql(query, (job_id,)).scalar_one())


def _describe(line: Any) -> str:
    try:
        return f"(origin {line[0]!r}, rank {line[1]!r}, seq {line[2]!r})"
    except (TypeError, IndexError, KeyError):
        return f"{line!r:.80}"


def _db_reason(exc: DBAPIError) -> str:
    return str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else type(exc).__name__


_SQLITE_INSERT_LINES = (
    "INSERT INTO log_lines (job_id, origin, rank, seq, time_us, stream, text, raw, ingest_id) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
)
_PG_INSERT_LINES = (
    "INSERT INTO log_lines (job_id, origin, rank, seq, time_us, stream, text, raw, ingest_id) "
    "SELECT %s, * FROM unnest(%s::varchar[], %s::int[], %s::bigint[], %s::bigint[], "
    "%s::varchar[], %s::text[], %s::bytea[], %s::bigint[]) ON CONFLICT DO NOTHING"
)


def _check_cursor(what: str, cursor: object) -> None:
    if isinstance(cursor, bool) or not isinstance(cursor, int):
        raise TypeError(
            f"{what} takes the ingest_id of a line (an int, 0 at first), "
            f"not {type(cursor).__name__}"
        )


def rank_runs(ranks: Sequence[int]) -> list[tuple[int, int]]:
    """Ranks as inclusive runs of consecutive numbers: [0, 1, 2, 7] -> [(0, 2), (7, 7)]."""
    runs: list[tuple[int, int]] = []
    for rank in sorted(set(ranks)):
        if runs and runs[-1][1] == rank - 1:
            runs[-1] = (runs[-1][0], rank)
        else:
            runs.append((rank, rank))
    return runs


def _runs(
    ranks: Sequence[int] | None, runs: Sequence[tuple[int, int]] | None
) -> list[tuple[int, int]] | None:
    if ranks is not None:
        return rank_runs(ranks) + list(runs or [])
    return None if runs is None else list(runs)


def _log_filter(
    query: Select[Any],
    runs: list[tuple[int, int]] | None,
    origin: str | None,
    launcher: int | None = None,
) -> Select[Any]:
    """Only ``origin``'s lines (runs given and no origin: the ranks' own), of the ranks (or,
    for origin "node", nodes) in ``runs``, plus node ``launcher``'s launcher lines. Ranks go
    to the database as inclusive runs, so a thousand ranks are one BETWEEN, not a thousand
    bound values."""
    kept: Any = None
    if runs is not None:
        kept = or_(*(LogLine.rank.between(lo, hi) for lo, hi in runs)) if runs else false()
    if origin is None and runs is not None:
        origin = "rank"
    if origin is not None:
        kept = LogLine.origin == origin if kept is None else and_(LogLine.origin == origin, kept)
    if launcher is not None:
        own = and_(LogLine.origin == "node", LogLine.rank == launcher)
        kept = own if kept is None else or_(kept, own)
    return query if kept is None else query.where(kept)


# Reads inside a transaction of the caller's (one snapshot for several of them).


def events_in(s: Session, job_id: str | None = None, last: int | None = None) -> list[Event]:
    query = select(Event)
    if job_id is not None:
        query = query.where(Event.job_id == job_id)
    if last is None:
        return list(s.scalars(query.order_by(Event.id)))
    return list(s.scalars(query.order_by(Event.id.desc()).limit(last)))[::-1]


def event_count_in(s: Session, job_id: str) -> int:
    counted = s.scalar(select(func.count()).select_from(Event).where(Event.job_id == job_id))
    return int(counted or 0)


def conditions_in(s: Session, job_id: str) -> list[Condition]:
    return list(
        s.scalars(select(Condition).where(Condition.job_id == job_id).order_by(Condition.type))
    )
