"""The agent's side of the direct path: the gang's WireGuard device, next to the job.

One device (``muster0``) per agent, for one gang epoch at a time: NET_SETUP makes it (an
older one first comes down), NET_PEERS gives it the gang's peers, and it comes down when the
member ends, when a STOP arrives for its job, and when the agent stops. Device commands run
in a thread: the link's reader never waits on them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from muster.net.wireguard import Device, Peer, device_unavailable
from muster.wire import Kind

log = logging.getLogger("muster.agent")

Send = Callable[[Kind, dict[str, Any]], Awaitable[object]]


class GangNetwork:
    def __init__(self, send: Send, log_dir: Path) -> None:
        self.send = send
        self.device = Device(log_dir=log_dir)
        self.owner: tuple[str, int] | None = None  # (job, epoch) whose device is up
        self._lock = asyncio.Lock()  # one device change at a time

    async def setup(self, body: dict[str, Any]) -> None:
        ids = {k: body.get(k) for k in ("job", "epoch", "node_rank")}
        why = device_unavailable()
        if why is None:
            async with self._lock:
                try:
                    await asyncio.to_thread(
                        self.device.up, str(body["address"]), int(body["prefix"])
                    )
                    self.owner = (str(body["job"]), int(body["epoch"]))
                except Exception as exc:  # the controller fails the epoch with this reason
                    log.warning("job %s: no WireGuard device: %s", ids["job"], exc)
                    why = str(exc)
        if why is not None:
            await self.send(Kind.NET_READY, {**ids, "error": why})
            return
        log.info(
            "job %s: device %s up at %s, UDP port %d",
            ids["job"],
            self.device.name,
            body["address"],
            self.device.port,
        )
        await self.send(
            Kind.NET_READY,
            {**ids, "public_key": self.device.public_key, "port": self.device.port},
        )

    async def set_peers(self, body: dict[str, Any]) -> None:
        ids = {k: body.get(k) for k in ("job", "epoch", "node_rank")}
        if self.owner != (str(body.get("job")), body.get("epoch")):
            log.warning("NET_PEERS for job %s, whose device is not up here", ids["job"])
            return
        peers = [
            Peer(str(p["public_key"]), str(p["endpoint"]), str(p["address"]))
            for p in body.get("peers") or []
        ]
        async with self._lock:
            try:
                await asyncio.to_thread(self.device.set_peers, peers)
            except Exception as exc:
                log.warning("job %s: setting the peers failed: %s", ids["job"], exc)
                await self.send(Kind.NET_READY, {**ids, "error": f"setting the peers: {exc}"})
                return
        await self.send(Kind.NET_UP, ids)

    async def down(self, job: str | None = None) -> None:
        """Remove the device of ``job`` (any, when None); never raises."""
        if self.owner is None or (job is not None and self.owner[0] != job):
            return
        async with self._lock:
            try:
                await asyncio.to_thread(self.device.down)
            except Exception:
                log.exception("removing the device of job %s", self.owner[0])
            log.info("job %s: device %s removed", self.owner[0], self.device.name)
            self.owner = None
