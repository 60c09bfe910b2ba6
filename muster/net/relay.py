"""``muster relay``: forwards relayed gangs' ciphertext between their members (seed 000).

Two or more relays mesh (``--peer``): each tells the others which members are attached to it
(ROUTE), so a frame for a member attached elsewhere crosses one relay-to-relay link. Members
attach to every relay of their gang at once and send through one; when it dies they resend
what was not acknowledged through another (muster.net.relayed), so a relay restart loses no
admitted gang.

Who may do what: a member is admitted with a controller-issued ticket for this gang and
member (once, before it expires; muster.net.relaywire); its frames reach only members of its
own gang, stamped with its own number. A relay of the mesh proves the shared secret. Nothing
else is answered. The relay counts the bytes each member sends (``metered``) and drops what a
full link cannot take rather than buffer without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from muster.net.relaywire import (
    Kind,
    LinkClosed,
    data_frame,
    json_frame,
    parse_data,
    read_frame,
    read_ticket,
    relay_proof,
)

log = logging.getLogger("muster.relay")

HELLO_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 5.0  # a link that takes nothing for this long is dropped (it redials)
LINK_BUFFER = 8 * 1024 * 1024  # bytes queued on one link before its writer is waited on
REDIAL_S = 1.0
NONCE_MEMORY_S = 20 * 60  # a used ticket's nonce is remembered past its expiry
USAGE_KEEP_S = 3600.0  # a detached member's count is kept this long for the controller


class Bucket:
    """A token bucket: ``rate`` bytes/s, bursts of ``burst`` bytes; ``take`` waits."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.at = time.monotonic()

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        if self.tokens < 0:  # in debt: wait until it is paid (the member's TCP backs off)
            await asyncio.sleep(-self.tokens / self.rate)


def bucket_for(rate: float) -> Bucket | None:
    """A member's bucket for its ticket's rate (None: no cap); bursts of 50 ms, 256 KiB+."""
    return Bucket(rate, max(256 * 1024, rate * 0.05)) if rate > 0 else None


@dataclass
class _Link:
    writer: asyncio.StreamWriter
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def send(self, data: bytes) -> bool:
        """Queue ``data``; past LINK_BUFFER wait (bounded) for the link to take it. A link
        that takes nothing for DRAIN_TIMEOUT_S is closed (its member or relay dials again;
        what was lost the members resend): a dead host never holds up the others."""
        if self.writer.is_closing():
            return False
        async with self.lock:
            self.writer.write(data)
            if self.writer.transport.get_write_buffer_size() > LINK_BUFFER:
                try:
                    await asyncio.wait_for(self.writer.drain(), DRAIN_TIMEOUT_S)
                except (TimeoutError, ConnectionError, OSError):
                    self.writer.transport.abort()
                    return False
        return True


class Relay:
    def __init__(
        self, name: str, secret: bytes, listen: tuple[str, int], peers: list[tuple[str, int]]
    ) -> None:
        self.name = name
        self.secret = secret
        self.listen = listen
        self.peers = peers
        self.members: dict[tuple[str, int], _Link] = {}  # (gang, member) attached here
        self.routes: dict[tuple[str, int], str] = {}  # (gang, member) -> the relay it is on
        self.relays: dict[str, _Link] = {}  # mesh links by relay name
        self.used: dict[str, float] = {}  # ticket nonces admitted -> when to forget them
        self.metered: dict[tuple[str, int], int] = defaultdict(int)  # bytes each member sent
        self.idle_since: dict[tuple[str, int], float] = {}  # detached members' counts, since
        self.dropped = 0  # frames for a member attached nowhere
        self.refused = 0  # links refused at HELLO
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, *self.listen)
        for host, port in self.peers:
            self._spawn(self._dial_peer(host, port))

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._tasks):
            task.cancel()
        for link in [*self.members.values(), *self.relays.values()]:
            link.writer.close()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- links -----------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link(writer)
        try:
            kind, body = await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT_S)
            hello = json.loads(body) if kind is Kind.HELLO else None
            if not isinstance(hello, dict):
                raise ValueError("the first frame is not a HELLO")
            if "relay" in hello:
                await self._peer_link(reader, link, hello)
            elif "usage" in hello:
                await self._usage(link, hello)
            else:
                await self._member_link(reader, link, hello)
        except (TimeoutError, ValueError, KeyError, TypeError) as exc:
            self.refused += 1
            log.warning("relay %s: refused a link: %s", self.name, exc)
            with contextlib.suppress(ConnectionError):
                writer.write(json_frame(Kind.REFUSED, {"reason": str(exc)[:200]}))
                await writer.drain()
        except (LinkClosed, ConnectionError):
            pass
        except Exception:  # one link's failure never takes the relay down
            log.exception("relay %s: a link failed", self.name)
        finally:
            writer.close()

    async def _member_link(
        self, reader: asyncio.StreamReader, link: _Link, hello: dict[str, object]
    ) -> None:
        ticket = read_ticket(self.secret, str(hello.get("ticket")))
        now = time.time()
        self.used = {n: t for n, t in self.used.items() if t > now}
        if ticket.nonce in self.used:
            raise ValueError("a ticket used before")
        if ticket.gang != hello.get("gang") or ticket.member != hello.get("member"):
            raise ValueError("a ticket for another gang or member")
        self.used[ticket.nonce] = now + NONCE_MEMORY_S
        bucket = bucket_for(ticket.rate)
        key = (ticket.gang, ticket.member)
        old = self.members.get(key)
        if old is not None:
            old.writer.close()  # the member dialled again: its new link replaces the old
        self.members[key] = link
        await link.send(json_frame(Kind.WELCOME, {"relay": self.name}))
        await self._announce(key, True)
        try:
            while True:
                kind, body = await read_frame(reader)
                if kind is not Kind.DATA:
                    continue
                gang, _src, dst, payload = parse_data(body)
                if gang != ticket.gang:
                    continue  # its own gang only
                self.metered[key] += len(payload)
                if bucket is not None:
                    await bucket.take(len(payload))
                await self._forward(gang, ticket.member, dst, payload)
        finally:
            if self.members.get(key) is link:
                del self.members[key]
                self.idle_since[key] = time.monotonic()
                await self._announce(key, False)

    async def _usage(self, link: _Link, hello: dict[str, object]) -> None:
        """The controller asks what each member sent (it proves the secret, as relays do)."""
        nonce = str(hello.get("nonce"))
        if relay_proof(self.secret, "controller", nonce) != hello.get("proof"):
            raise ValueError("a usage request without this mesh's secret")
        if abs(time.time() - float(nonce.split("-", 1)[0])) > 60 or nonce in self.used:
            raise ValueError("a stale or replayed usage request")
        self.used[nonce] = time.time() + NONCE_MEMORY_S
        now = time.monotonic()
        for key in [k for k, t in self.idle_since.items() if now - t > USAGE_KEEP_S]:
            if key not in self.members:  # a gang long gone: its count was read by now
                self.metered.pop(key, None)
                del self.idle_since[key]
        usage = [[gang, member, sent] for (gang, member), sent in self.metered.items()]
        await link.send(json_frame(Kind.USAGE, {"relay": self.name, "usage": usage}))

    async def _forward(self, gang: str, src: int, dst: int, payload: memoryview) -> None:
        target = self.members.get((gang, dst)) or self.relays.get(self.routes.get((gang, dst), ""))
        try:
            sent = target is not None and await target.send(
                data_frame(gang, src, dst, bytes(payload))
            )
        except (ConnectionError, OSError):  # the destination's trouble, not the sender's
            sent = False
        if not sent:
            self.dropped += 1

    # ---- the mesh --------------------------------------------------------------------------

    async def _announce(self, key: tuple[str, int], here: bool) -> None:
        route = json_frame(Kind.ROUTE, {"gang": key[0], "member": key[1], "here": here})
        for link in list(self.relays.values()):
            with contextlib.suppress(ConnectionError):
                await link.send(route)

    def _hello(self) -> dict[str, str]:
        nonce = f"{time.time():.3f}-{secrets.token_hex(8)}"
        return {
            "relay": self.name,
            "nonce": nonce,
            "proof": relay_proof(self.secret, self.name, nonce),
        }

    async def _peer_link(
        self, reader: asyncio.StreamReader, link: _Link, hello: dict[str, object]
    ) -> None:
        name, nonce = str(hello["relay"]), str(hello.get("nonce"))
        if relay_proof(self.secret, name, nonce) != hello.get("proof"):
            raise ValueError(f"relay {name} does not hold this mesh's secret")
        stamp = float(nonce.split("-", 1)[0])
        if abs(time.time() - stamp) > 60 or nonce in self.used:
            raise ValueError(f"relay {name}: a stale or replayed hello")
        self.used[nonce] = time.time() + NONCE_MEMORY_S
        await link.send(json_frame(Kind.WELCOME, {"relay": self.name}))
        await self._serve_peer(reader, link, name)

    async def _dial_peer(self, host: str, port: int) -> None:
        """Keep a link to a mesh peer, dialling again whenever it drops (bounded pause)."""
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port)
                link = _Link(writer)
                await link.send(json_frame(Kind.HELLO, self._hello()))
                kind, body = await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT_S)
                if kind is not Kind.WELCOME:
                    log.warning(
                        "relay %s: peer %s:%d refused: %s", self.name, host, port, body[:200]
                    )
                else:
                    await self._serve_peer(reader, link, str(json.loads(body)["relay"]))
            except (OSError, LinkClosed, TimeoutError, ValueError) as exc:
                log.debug("relay %s: peer %s:%d: %s", self.name, host, port, exc)
            except Exception:
                log.exception("relay %s: the link to %s:%d failed", self.name, host, port)
            await asyncio.sleep(REDIAL_S)

    async def _serve_peer(self, reader: asyncio.StreamReader, link: _Link, name: str) -> None:
        self.relays[name] = link
        for key in list(self.members):  # what is attached here, all at once
            await link.send(
                json_frame(Kind.ROUTE, {"gang": key[0], "member": key[1], "here": True})
            )
        try:
            while True:
                kind, body = await read_frame(reader)
                if kind is Kind.ROUTE:
                    route = json.loads(body)
                    key = (str(route["gang"]), int(route["member"]))
                    if route.get("here"):
                        self.routes[key] = name
                    elif self.routes.get(key) == name:
                        del self.routes[key]
                elif kind is Kind.DATA:
                    gang, src, dst, payload = parse_data(body)
                    target = self.members.get((gang, dst))  # one hop: never forwarded again
                    try:
                        sent = target is not None and await target.send(
                            data_frame(gang, src, dst, bytes(payload))
                        )
                    except (ConnectionError, OSError):
                        sent = False
                    if not sent:
                        self.dropped += 1
        finally:
            if self.relays.get(name) is link:
                del self.relays[name]
                self.routes = {k: v for k, v in self.routes.items() if v != name}
