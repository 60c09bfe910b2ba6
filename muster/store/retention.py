"""What retention reads and deletes: jobs that ended before a cutoff, their rows.

Only jobs in a terminal state (succeeded, failed, cancelled) whose ``finished_at`` is before
the cutoff are past retention. Their job rows and events stay (the history of what ran);
their artifact rows and, when asked, their log lines go.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime

from sqlalchemy import delete, func, or_, select
from sqlalchemy.orm import InstrumentedAttribute

from muster.spec.states import JOB_TERMINAL
from muster.store.base import Repository
from muster.store.models import Artifact, Job, LogLine

_TERMINAL = sorted(state.value for state in JOB_TERMINAL)
_CHUNK = 500  # job ids per IN (...)


class RetentionRepository(Repository):
    def jobs_finished_before(self, cutoff: datetime) -> list[Job]:
        """Terminal jobs that finished before ``cutoff`` (UTC), oldest first."""
        with self.db.read() as s:
            query = (
                select(Job)
                .where(Job.state.in_(_TERMINAL), Job.finished_at < cutoff)
                .order_by(Job.finished_at, Job.seq)
            )
            return list(s.scalars(query))

    def bundles_in_use(self, cutoff: datetime) -> set[str]:
        """Bundles of every job not past retention: not terminal, or finished at/after cutoff."""
        with self.db.read() as s:
            live = or_(
                Job.state.not_in(_TERMINAL),
                Job.finished_at.is_(None),
                Job.finished_at >= cutoff,
            )
            query = select(Job.bundle_sha256).where(live, Job.bundle_sha256.is_not(None))
            return {sha for sha in s.scalars(query.distinct()) if sha}

    def count_artifacts(self, job_ids: Sequence[str]) -> int:
        return self._count(Artifact.job_id, job_ids)

    def count_log_lines(self, job_ids: Sequence[str]) -> int:
        return self._count(LogLine.job_id, job_ids)

    def delete_artifacts(self, job_ids: Sequence[str]) -> int:
        """Delete the artifact rows of ``job_ids`` that are terminal; returns how many."""
        return self._delete(Artifact, Artifact.job_id, job_ids)

    def delete_log_lines(self, job_ids: Sequence[str]) -> int:
        """Delete the log lines of ``job_ids`` that are terminal; returns how many."""
        return self._delete(LogLine, LogLine.job_id, job_ids)

    def _count(self, column: InstrumentedAttribute[str], job_ids: Sequence[str]) -> int:
        total = 0
        with self.db.read() as s:
            for chunk in _chunks(job_ids):
                total += int(s.scalar(select(func.count()).where(column.in_(chunk))) or 0)
        return total

    def _delete(
        self,
        model: type[Artifact] | type[LogLine],
        column: InstrumentedAttribute[str],
        job_ids: Sequence[str],
    ) -> int:
        deleted = 0
        for chunk in _chunks(job_ids):
            with self.db.transaction() as s:
                # Checked again inside the deleting transaction: a job that is not terminal
                # keeps its rows whatever the caller passed.
                terminal = select(Job.id).where(Job.id.in_(chunk), Job.state.in_(_TERMINAL))
                result = s.execute(
                    delete(model)
                    .where(column.in_(terminal))
                    .execution_options(synchronize_session=False)
                )
                deleted += max(result.rowcount, 0)  # type: ignore[attr-defined]
        return deleted


def _chunks(items: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start : start + _CHUNK]
