"""One controller per database: a lease row that ``muster server`` takes at start.

A second ``muster server`` on the same database refuses to start and names the holder. The
holder renews the lease every few seconds and gives it up on a clean stop; a lease that
expired, or whose holder is a process on this host that no longer exists (a controller
killed with SIGKILL), is taken over at once.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import signal
import socket
import time
from typing import Any

import psutil

from muster.errors import UserError
from muster.store import Store

log = logging.getLogger("muster.controller")

LEASE_TTL_S = 30.0
RENEW_EVERY_S = 5.0


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


class ControllerLease:
    def __init__(self, store: Store, port: int) -> None:
        self.store = store
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.port = port
        self.holder = f"{self.host} pid {self.pid} port {port}"
        self.boot = _boot_id()

    def _stale(self, current: dict[str, Any]) -> bool:
        """The holder was a process of this very machine and boot (same host name and boot
        id: not a clone, not another container's PID namespace) that is gone."""
        if current.get("host") != self.host or current.get("boot") != self.boot:
            return False
        if not self.boot or not isinstance(current.get("pid"), int):
            return False
        pid = int(current["pid"])
        return pid != self.pid and not psutil.pid_exists(pid)

    def _take(self) -> dict[str, Any] | None:
        return self.store.acquire_lease(
            self.holder,
            now=time.time(),
            ttl=LEASE_TTL_S,
            stale=self._stale,
            info={"host": self.host, "pid": self.pid, "port": self.port, "boot": self.boot},
        )

    def acquire(self) -> None:
        """Take the lease, or raise UserError naming the controller that holds it."""
        current = self._take()
        if current is not None:
            since = datetime.datetime.fromtimestamp(float(current.get("since", 0)))
            raise UserError(
                f"another muster server holds this database: {current.get('holder')} "
                f"(since {since:%Y-%m-%d %H:%M:%S}); stop it first, or give this one "
                "another --db"
            )

    async def keep(self) -> None:
        """Renew the lease for the controller's life; log, count and go on on errors."""
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            try:
                current = await asyncio.to_thread(self._take)
            except Exception:
                log.exception("renewing the controller lease failed; trying again")
                continue
            if current is not None:
                log.critical(
                    "the controller lease was taken by %s (this controller was paused past "
                    "%.0fs?); this one stops so that only one decides",
                    current.get("holder"),
                    LEASE_TTL_S,
                )
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def release(self) -> None:
        try:
            self.store.release_lease(self.holder)
        except Exception:
            log.exception("could not give the controller lease up; it expires by itself")
