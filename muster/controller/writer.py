"""The controller's group commit: store writes from every gang step, one transaction at a time.

A step queues its writes and goes on; one task takes whatever has queued (from any number of
runs and links) and applies it in one transaction, in order. What must be on record before
something else happens waits for its writes' future: a frame that lets an agent act (ASSIGN,
PREPARE_RENDEZVOUS) and the acks that let an agent forget a report. The loop logs, counts
and goes on; while the database is down it retries, and the waiters wait.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from muster.controller.metrics import Metrics
from muster.errors import StoreUnavailable
from muster.store import Store
from muster.store.writes import Write

log = logging.getLogger("muster.controller")

MOST_PER_TRANSACTION = 5000


class StoreWriter:
    def __init__(
        self, store: Store, metrics: Metrics, flushed: Callable[[Sequence[Write]], None]
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.flushed = flushed  # called after each commit with what it held
        # Whole submissions (a step's writes stay together in one transaction), in order.
        self._queue: list[tuple[list[Write], asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def submit(self, writes: Sequence[Write]) -> asyncio.Future[None]:
        """Queue ``writes``; the future is done once they, and everything queued before
        them, are committed (it fails if they could not be)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not writes and not self._queue and self._idle.is_set():
            done.set_result(None)
            return done
        self._queue.append((list(writes), done))
        self._idle.clear()
        self._wake.set()
        return done

    def barrier(self) -> asyncio.Future[None]:
        """Done once everything queued so far is committed."""
        return self.submit([])

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait (bounded) until everything queued is committed: a clean stop."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            log.error("%d store submissions were still queued at the stop", len(self._queue))

    async def run(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queue:
                    batch = self._take()
                    await self._commit(batch)
                    try:
                        self.flushed([w for writes, _ in batch for w in writes])
                    except Exception:
                        log.exception("after a commit")
                self._idle.set()
        finally:
            for _writes, done in self._queue:  # cancelled at the stop: say so to waiters
                if not done.done():
                    done.set_exception(RuntimeError("the controller stopped before the commit"))

    def _take(self) -> list[tuple[list[Write], asyncio.Future[None]]]:
        """Submissions up to about MOST_PER_TRANSACTION writes, never splitting one."""
        count, end = 0, 0
        while end < len(self._queue) and (end == 0 or count < MOST_PER_TRANSACTION):
            count += len(self._queue[end][0])
            end += 1
        batch = self._queue[:end]
        del self._queue[:end]
        return batch

    async def _commit(self, batch: list[tuple[list[Write], asyncio.Future[None]]]) -> None:
        writes = [w for ws, _ in batch for w in ws]
        attempt = 0
        while True:
            try:
                skipped = await asyncio.to_thread(self.store.apply_writes, writes) if writes else []
                break
            except asyncio.CancelledError:
                raise
            except StoreUnavailable as exc:
                attempt += 1
                self.metrics.internal_errors.labels("writer").inc()
                log.warning("the database is away (%s); retrying (%d)", exc, attempt)
                await asyncio.sleep(min(2.0**attempt, 10.0))
            except Exception:
                # Not the database being away: find the submission that fails, alone.
                self.metrics.internal_errors.labels("writer").inc()
                log.exception(
                    "a batch of %d store writes failed; trying each step alone", len(writes)
                )
                await self._commit_one_by_one(batch)
                return
        for problem in skipped:
            log.warning("a store write was skipped: %s", problem)
        for _writes, done in batch:
            if not done.done():
                done.set_result(None)

    async def _commit_one_by_one(
        self, batch: list[tuple[list[Write], asyncio.Future[None]]]
    ) -> None:
        for writes, done in batch:
            try:
                if writes:
                    await asyncio.to_thread(self.store.apply_writes, writes)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.metrics.internal_errors.labels("writer").inc()
                log.exception("a step's %d store writes failed and are lost", len(writes))
                if not done.done():
                    done.set_exception(exc)
                continue
            if not done.done():
                done.set_result(None)
