"""The agent's side of the relayed path: the member's endpoint, next to the job.

NET_SETUP (relayed): check that the job's launcher loads the shim (a static or musl one does
not: NET_READY says ShimNotLoaded and the job fails), make the epoch's X25519 key, answer with
its public half. NET_PEERS: the peers' keys and addresses, the relays and tickets for them;
start the endpoint (SOCKS5 on loopback, links to every relay) and say NET_UP once a relay
admitted it, or NET_READY with the error when none did in time. The endpoint lives until the
member ends or its job is stopped; the ranks reach it through the shim
(muster.plan.env.launch_env's LD_PRELOAD, MUSTER_NETSHIM_PEERS, MUSTER_NETSHIM_SOCKS).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from muster.errors import InfrastructureError
from muster.net import shim
from muster.net.relayed import Endpoint, new_key
from muster.net.relaywire import ticket_expires
from muster.plan.env import Shim
from muster.wire import Kind

log = logging.getLogger("muster.agent")

UP_TIMEOUT_S = 30.0  # a relay admits the endpoint within this, or the epoch is fenced
TICKET_MARGIN_S = 60.0  # a ticket that expires sooner than this is not used
ASK_EVERY_S = 5.0  # the controller is asked for tickets at most this often


class TicketStock:
    """A member's single-use relay tickets (from NET_PEERS), refreshed from the controller
    (RELAY_TICKETS) when they run low or near their expiry: a link redialled hours into the
    run is admitted like the first."""

    def __init__(self, relays: list[dict[str, Any]], ids: dict[str, Any], send: Send) -> None:
        self.stock = {i: [str(t) for t in r.get("tickets") or []] for i, r in enumerate(relays)}
        self.ids = ids
        self.send = send
        self.asked = 0.0

    async def take(self, index: int) -> str:
        left = self.stock.setdefault(index, [])
        while left and ticket_expires(left[0]) < time.time() + TICKET_MARGIN_S:
            left.pop(0)
        if len(left) <= 2 and time.monotonic() - self.asked > ASK_EVERY_S:
            self.asked = time.monotonic()
            await self.send(Kind.RELAY_TICKETS, dict(self.ids))
        if not left:
            raise ConnectionError("no relay ticket left; asked the controller for more")
        return left.pop(0)

    def add(self, relays: list[dict[str, Any]]) -> None:
        for index, relay in enumerate(relays):
            self.stock[index] = [str(t) for t in relay.get("tickets") or []]


Send = Callable[[Kind, dict[str, Any]], Awaitable[object]]


class RelayedNetwork:
    def __init__(self, send: Send, python: str) -> None:
        self.send = send
        self.python = python
        self.keys: dict[tuple[str, Any], X25519PrivateKey] = {}  # (job, epoch) -> its key
        self.endpoints: dict[str, tuple[Any, Endpoint]] = {}  # job -> (epoch, endpoint)
        self.stocks: dict[str, TicketStock] = {}  # job -> its member's relay tickets

    async def setup(self, body: dict[str, Any]) -> None:
        ids = {k: body.get(k) for k in ("job", "epoch", "node_rank")}
        try:
            library = shim.library()
        except InfrastructureError as exc:
            await self.send(Kind.NET_READY, {**ids, "error": str(exc)})
            return
        why = await asyncio.to_thread(shim.self_test, self.python, library)
        if why is not None:
            await self.send(Kind.NET_READY, {**ids, "error": why, "shim_not_loaded": True})
            return
        private, public = new_key()
        self.keys[(str(body["job"]), body["epoch"])] = private
        ready = {
            **ids,
            "public_key": base64.b64encode(public).decode(),
            "join_key": body.get("join_key"),  # the epoch's single-use key, back once
        }
        await self.send(Kind.NET_READY, ready)

    async def set_peers(self, body: dict[str, Any]) -> None:
        ids = {k: body.get(k) for k in ("job", "epoch", "node_rank")}
        job, epoch = str(body["job"]), body["epoch"]
        private = self.keys.get((job, epoch))
        if private is None:
            log.warning("NET_PEERS for job %s, which has no relayed key here", job)
            return
        relays = [(str(r["host"]), int(r["port"])) for r in body.get("relays") or []]
        stock = TicketStock(list(body.get("relays") or []), ids, self.send)
        self.stocks[job] = stock

        peers = {
            int(p["node"]): base64.b64decode(str(p["public_key"])) for p in body.get("peers") or []
        }
        endpoint = Endpoint(
            str(body["gang"]),
            int(body["node_rank"]),
            [str(a) for a in body.get("addresses") or []],
            private,
            peers,
            relays,
            stock.take,
        )
        await self.down(job, keep_key=epoch)
        try:
            await endpoint.start()
            await asyncio.wait_for(endpoint.up.wait(), UP_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            await endpoint.close()
            where = ", ".join(f"{h}:{p}" for h, p in relays)
            why = f"no relay admitted this member within {UP_TIMEOUT_S:.0f}s ({where}): {exc}"
            await self.send(Kind.NET_READY, {**ids, "error": why})
            return
        if (job, epoch) not in self.keys:  # stopped while it waited: nothing more of it
            await endpoint.close()
            return
        self.endpoints[job] = (epoch, endpoint)
        log.info("job %s: relayed endpoint up (SOCKS5 %s)", job, endpoint.socks)
        await self.send(Kind.NET_UP, ids)

    def shim_for(self, job: str) -> Shim | None:
        """What a relayed member's ranks preload and dial, while its endpoint is up."""
        held = self.endpoints.get(job)
        if held is None:
            return None
        return Shim(shim.library(), held[1].socks)

    def add_tickets(self, body: dict[str, Any]) -> None:
        """RELAY_TICKETS_ISSUED: a fresh stock for the member's links."""
        stock = self.stocks.get(str(body.get("job")))
        if stock is not None and stock.ids.get("epoch") == body.get("epoch"):
            stock.add(list(body.get("relays") or []))

    async def down(self, job: str | None = None, epoch: Any = None, keep_key: Any = None) -> None:
        """Close the endpoint of ``job`` (of that epoch only, when given; all when None) and
        forget its keys (but ``keep_key``'s epoch)."""
        for key in [k for k in self.keys if job is None or k[0] == job]:
            if key[1] != keep_key and (epoch is None or key[1] == epoch):
                del self.keys[key]
        if job is not None and keep_key is None:
            self.stocks.pop(job, None)
        for name in [job] if job is not None else list(self.endpoints):
            held = self.endpoints.get(name)
            if held is None or (epoch is not None and held[0] != epoch):
                continue
            del self.endpoints[name]
            self.keys.pop((name, held[0]), None)
            await held[1].close()
            log.info("job %s: relayed endpoint closed", name)
