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
from collections.abc import Awaitable, Callable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from muster.errors import InfrastructureError
from muster.net import shim
from muster.net.relayed import Endpoint, new_key
from muster.plan.env import Shim
from muster.wire import Kind

log = logging.getLogger("muster.agent")

UP_TIMEOUT_S = 30.0  # a relay admits the endpoint within this, or the epoch is fenced

Send = Callable[[Kind, dict[str, Any]], Awaitable[object]]


class RelayedNetwork:
    def __init__(self, send: Send, python: str) -> None:
        self.send = send
        self.python = python
        self.keys: dict[tuple[str, Any], X25519PrivateKey] = {}  # (job, epoch) -> its key
        self.endpoints: dict[str, tuple[Any, Endpoint]] = {}  # job -> (epoch, endpoint)

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
        tickets = {i: list(r.get("tickets") or []) for i, r in enumerate(body.get("relays") or [])}

        async def ticket(index: int) -> str:
            left = tickets.get(index) or []
            if not left:
                raise ConnectionError(f"no ticket left for relay {relays[index]}")
            return str(left.pop(0))

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
            ticket,
        )
        await self.down(job)
        try:
            await endpoint.start()
            await asyncio.wait_for(endpoint.up.wait(), UP_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            await endpoint.close()
            where = ", ".join(f"{h}:{p}" for h, p in relays)
            why = f"no relay admitted this member within {UP_TIMEOUT_S:.0f}s ({where}): {exc}"
            await self.send(Kind.NET_READY, {**ids, "error": why})
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

    async def down(self, job: str | None = None, epoch: Any = None) -> None:
        """Close the endpoint of ``job`` (of that epoch only, when given; all when None)."""
        for name in [job] if job is not None else list(self.endpoints):
            held = self.endpoints.get(name)
            if held is None or (epoch is not None and held[0] != epoch):
                continue
            del self.endpoints[name]
            self.keys.pop((name, held[0]), None)
            await held[1].close()
            log.info("job %s: relayed endpoint closed", name)
