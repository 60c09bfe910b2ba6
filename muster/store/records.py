"""What a running job leaves behind: events, conditions, log lines, artifacts, probe results."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import and_, not_, or_, select, tuple_
from sqlalchemy.exc import IntegrityError

from muster.store.base import Repository, add_event, utcnow
from muster.store.models import (
    Artifact,
    Condition,
    Event,
    LogLine,
    ProbeResult,
    Setting,
)


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

    def events(self, job_id: str | None = None) -> list[Event]:
        with self.db.transaction() as s:
            query = select(Event).order_by(Event.id)
            if job_id is not None:
                query = query.where(Event.job_id == job_id)
            return list(s.scalars(query))

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
        with self.db.transaction() as s:
            return list(
                s.scalars(
                    select(Condition).where(Condition.job_id == job_id).order_by(Condition.type)
                )
            )

    # ---- logs ----------------------------------------------------------------------------

    def append_logs(self, job_id: str, lines: Sequence[Sequence[Any]]) -> int:
        """Store a batch of one job's lines in one transaction; returns how many were new.

        Each line is a LogLineIn or any sequence in its order (origin, rank, seq, time,
        stream, text). A line already stored (same job, origin, rank, seq) is skipped, so an
        agent may resend a batch it is unsure of. Raises TypeError or ValueError on a line
        of the wrong shape, storing nothing.
        """
        return self.append_logs_by_job({job_id: lines})

    def append_logs_by_job(self, lines_by_job: Mapping[str, Sequence[Sequence[Any]]]) -> int:
        """Several jobs' lines in one transaction. This is the hot path of log ingest, so
        it talks to the driver directly: executemany on SQLite, unnest() on PostgreSQL."""
        batches = [
            (
                job_id,
                [
                    (job_id, str(o), int(r), int(q), int(float(t) * 1e6), str(st), str(x))
                    for o, r, q, t, st, x in lines
                ],
            )
            for job_id, lines in lines_by_job.items()
            if lines
        ]
        if not batches:
            return 0
        stored = 0
        with self.db.transaction() as s:
            conn = s.connection()
            for job_id, rows in batches:
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
        """Lines of one job in (rank, seq) order; ``after`` skips seq <= after."""
        with self.db.transaction() as s:
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
        cursor: dict[str, int],
        *,
        ranks: list[int] | None = None,
        limit: int = 10_000,
    ) -> list[LogLine]:
        """Lines not yet seen: ``cursor`` maps origin+rank ("rank3", "node0") to the last seq.

        With ``ranks``, only those global ranks' own lines (no launcher lines).
        """
        with self.db.transaction() as s:
            query = select(LogLine).where(LogLine.job_id == job_id)
            if ranks is not None:
                query = query.where(LogLine.origin == "rank", LogLine.rank.in_(ranks))
            if cursor:
                seen = [(k[:4], int(k[4:])) for k in cursor]
                newer = [
                    and_(LogLine.origin == o, LogLine.rank == r, LogLine.seq > cursor[f"{o}{r}"])
                    for o, r in seen
                ]
                query = query.where(
                    or_(*newer, not_(tuple_(LogLine.origin, LogLine.rank).in_(seen)))
                )
            query = query.order_by(LogLine.time_us, LogLine.origin, LogLine.rank, LogLine.seq)
            return list(s.scalars(query.limit(limit)))

    # ---- artifacts, probe ----------------------------------------------------------------

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
        with self.db.transaction() as s:
            query = select(Artifact).where(Artifact.job_id == job_id)
            return list(s.scalars(query.order_by(Artifact.node_rank, Artifact.path)))

    def setting(self, key: str, default: Callable[[], str]) -> str:
        """The stored value of ``key``, storing ``default()`` first when there is none.

        Two processes racing to create it agree on whichever stored it first.
        """
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

    def put_setting(self, key: str, value: str) -> None:
        with self.db.transaction() as s:
            s.merge(Setting(key=key, value=value))

    def get_setting(self, key: str) -> str | None:
        with self.db.transaction() as s:
            row = s.get(Setting, key)
            return None if row is None else row.value

    def add_probe_result(self, result: ProbeResult) -> None:
        with self.db.transaction() as s:
            s.add(result)


_SQLITE_INSERT_LINES = (
    "INSERT INTO log_lines (job_id, origin, rank, seq, time_us, stream, text) "
    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
)
_PG_INSERT_LINES = (
    "INSERT INTO log_lines (job_id, origin, rank, seq, time_us, stream, text) "
    "SELECT %s, * FROM unnest(%s::varchar[], %s::int[], %s::bigint[], %s::bigint[], "
    "%s::varchar[], %s::text[]) ON CONFLICT DO NOTHING"
)
