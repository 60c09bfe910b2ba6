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
        self._queue: list[tuple[Write | None, asyncio.Future[None] | None]] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def submit(self, writes: Sequence[Write]) -> asyncio.Future[None]:
        """Queue ``writes``; the future is done once they are committed."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not writes:
            done.set_result(None)
            return done
        for write in writes[:-1]:
            self._queue.append((write, None))
        self._queue.append((writes[-1], done))
        self._idle.clear()
        self._wake.set()
        return done

    def barrier(self) -> asyncio.Future[None]:
        """Done once everything queued so far is committed (a direct store write that must
        not be overtaken by an older queued one waits for it)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self._queue and self._idle.is_set():
            done.set_result(None)
            return done
        self._queue.append((None, done))
        self._idle.clear()
        self._wake.set()
        return done

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait (bounded) until everything queued is committed: a clean stop."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            log.error("%d store writes were still queued at the stop", len(self._queue))

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._queue[:MOST_PER_TRANSACTION]
                writes = [w for w, _ in batch if w is not None]
                attempt = 0
                while True:
                    try:
                        skipped = (
                            await asyncio.to_thread(self.store.apply_writes, writes)
                            if writes
                            else []
                        )
                        break
                    except asyncio.CancelledError:
                        raise
                    except StoreUnavailable as exc:
                        attempt += 1
                        self.metrics.internal_errors.labels("writer").inc()
                        log.warning("the database is away (%s); retrying (%d)", exc, attempt)
                        await asyncio.sleep(min(2.0**attempt, 10.0))
                    except Exception as exc:
                        self.metrics.internal_errors.labels("writer").inc()
                        log.exception("a batch of %d store writes failed; dropped", len(writes))
                        skipped = [f"the whole batch: {exc}"]
                        break
                del self._queue[: len(batch)]
                for problem in skipped:
                    log.warning("a store write was skipped: %s", problem)
                for _write, done in batch:
                    if done is not None and not done.done():
                        done.set_result(None)
                try:
                    self.flushed(writes)
                except Exception:
                    log.exception("after a commit")
            self._idle.set()
