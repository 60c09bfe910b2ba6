"""Log ingest: agents' LOGS frames into the store, batched, acked, and only from members.

A LOGS frame carries one batch of one job's lines. Frames wait in a bounded queue (a flood
slows the agents' links, and so their acks, instead of growing without end); the ingest task
stores whatever has queued up in one transaction, then acks each frame so the agent drops
its copy. A frame naming a job its worker was not placed in is acked, dropped and counted
as refused ("foreign"): an authenticated agent cannot write into another job's logs.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from muster.controller.links import Link
from muster.controller.metrics import Metrics
from muster.errors import StoreUnavailable
from muster.store import Store
from muster.wire import Kind

log = logging.getLogger("muster.controller")
REMEMBERED_JOBS = 4096
LINK_MOST_QUEUED = 64  # LOGS frames of one link waiting to be stored (agents keep <= 32)


class LogIngest:
    def __init__(self, store: Store, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics
        # Unbounded here, bounded by the agents: each has at most MAX_UNACKED batches in
        # flight. A put never blocks the link's reader, so heartbeats go on being read
        # while the database is slow.
        self._queue: asyncio.Queue[tuple[Link, str, Any, Any]] = asyncio.Queue()
        # Who may send a job's lines: the workers placed in it (any epoch), newest jobs.
        self._senders: OrderedDict[str, set[str]] = OrderedDict()

    async def put(self, link: Link, body: dict[str, Any]) -> None:
        if link.logs_queued >= LINK_MOST_QUEUED:  # past what an honest agent keeps in flight
            self.metrics.frames_refused.labels("flood").inc()
            return
        link.logs_queued += 1
        self._queue.put_nowait((link, str(body.get("job")), body.get("lines"), body.get("batch")))

    def note_senders(self, job_id: str, workers: list[str]) -> None:
        self._senders.setdefault(job_id, set()).update(workers)
        self._senders.move_to_end(job_id)
        while len(self._senders) > REMEMBERED_JOBS:
            self._senders.popitem(last=False)

    async def _may_log(self, job_id: str, worker_id: str) -> bool:
        """Whether the worker was placed in the job (members are read when not remembered)."""
        if worker_id not in self._senders.get(job_id, ()):
            members = await asyncio.to_thread(self.store.members, job_id)
            self.note_senders(job_id, [m.worker_id for m in members])
        return worker_id in self._senders[job_id]

    async def run(self, most: int = 40_000) -> None:
        """Store queued frames: whatever has queued up (up to ``most`` lines) goes in one
        transaction, then each frame is acked. Runs for the controller's life: a batch that
        fails is logged with its traceback and counted in
        muster_internal_errors_total{loop="ingest"}, and the loop goes on."""
        while True:
            frames = [await self._queue.get()]
            count = len(frames[0][2] or [])
            while count < most and not self._queue.empty():
                frames.append(self._queue.get_nowait())
                count += len(frames[-1][2] or [])
            for link, *_rest in frames:
                link.logs_queued -= 1
            attempt = 0
            while True:
                try:
                    await self._store(frames)
                    break
                except asyncio.CancelledError:
                    raise
                except StoreUnavailable as exc:
                    # The database is down: these frames wait (unacked, so the agents hold
                    # their copies and capture slows) and are tried again; nothing is lost.
                    self.metrics.internal_errors.labels("ingest").inc()
                    attempt += 1
                    log.warning("storing log lines: %s (attempt %d; trying again)", exc, attempt)
                    await asyncio.sleep(min(2.0**attempt, 10.0))
                except Exception:
                    self.metrics.internal_errors.labels("ingest").inc()
                    log.exception("storing %d LOGS frames failed; going on", len(frames))
                    break

    async def _store(self, frames: list[tuple[Link, str, Any, Any]]) -> None:
        by_job: dict[str, list[Any]] = {}
        good = []
        for link, job, lines, batch in frames:
            if not isinstance(lines, list):
                self.metrics.frames_refused.labels("malformed").inc()
                continue
            if not await self._may_log(job, link.worker_id):
                self.metrics.frames_refused.labels("foreign").inc()
                log.warning("%s sent log lines for %s, not its job", link.worker_id, job)
                await link.send(Kind.LOGS_ACK, {"job": job, "batch": batch})  # not resent
                continue
            by_job.setdefault(job, []).extend(lines)
            good.append((link, job, batch))
        # Lines a database cannot take (a shape it refuses, a byte its engine cannot hold)
        # are set aside with the reason, recorded on their job; the rest are stored, and
        # every frame is acked so no agent resends a poison batch for ever.
        result = await asyncio.to_thread(self.store.append_logs_salvaging, by_job)
        if result.rejected:
            self.metrics.frames_refused.labels("poison").inc(len(result.rejected))
            first = result.rejected[0]
            log.warning(
                "quarantined %d log line(s); the first, of %s: %s",
                len(result.rejected),
                first.job_id,
                first.reason,
            )
        self.metrics.log_lines.inc(result.stored)
        for link, job, batch in good:
            await link.send(Kind.LOGS_ACK, {"job": job, "batch": batch})
