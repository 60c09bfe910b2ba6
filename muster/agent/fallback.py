"""A direct gang's way around a lost path: WireGuard's own packets through the relays.

Where the controller knows relays, a direct member also attaches to them (as its gang's
member, with tickets from NET_PEERS) and waits. When the agent's path watch finds a peer it
has heard nothing from for ``--path-timeout`` (NetworkDegraded), it *diverts* that peer:
WireGuard's endpoint for it becomes a UDP socket of the agent's on loopback, whose datagrams
(already sealed by WireGuard) cross the relays as DATA frames; at the other end the agent
hands them to its own WireGuard from a loopback socket of its own, and WireGuard, which
follows a peer to wherever its authenticated packets come from, answers the same way. The
ranks' connections inside the tunnel never notice more than a pause. A diverted pair stays
on the relays for the rest of the run (and counts as a lost direct path).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

from muster.net.relayed import Endpoint
from muster.net.relaywire import data_frame

log = logging.getLogger("muster.agent")

SetEndpoint = Callable[[str, str], Awaitable[None]]  # (peer public key, "host:port")


class _Loopback(asyncio.DatagramProtocol):
    """One peer's socket on loopback: what the local WireGuard sends it goes to the relays."""

    def __init__(self, fallback: Fallback, node: int) -> None:
        self.fallback = fallback
        self.node = node
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        if addr[1] != self.fallback.wg_port:  # only the local WireGuard's packets
            return
        packet = data_frame(self.fallback.gang, self.fallback.me, self.node, data)
        if not self.fallback.endpoint.send_now(packet):
            self.fallback.dropped += 1  # as a lossy path would: WireGuard's TCP resends


class Fallback:
    def __init__(
        self,
        gang: str,
        me: int,
        relays: list[tuple[str, int]],
        ticket: Callable[[int], Awaitable[str]],
        wg_port: int,
        set_endpoint: SetEndpoint,
    ) -> None:
        self.gang = gang
        self.me = me
        self.wg_port = wg_port
        self.set_endpoint = set_endpoint
        self.sockets: dict[int, _Loopback] = {}
        self.diverted: set[int] = set()
        self.dropped = 0  # datagrams with no relay link to take them
        self.endpoint = Endpoint(
            gang, me, [], None, {}, relays, ticket, on_datagram=self._from_relay
        )

    async def start(self) -> None:
        await self.endpoint.start()

    async def close(self) -> None:
        for sock in self.sockets.values():
            if sock.transport is not None:
                sock.transport.close()
        self.sockets.clear()
        await self.endpoint.close()

    async def _socket(self, node: int) -> _Loopback:
        sock = self.sockets.get(node)
        if sock is None:
            loop = asyncio.get_running_loop()
            _transport, sock = await loop.create_datagram_endpoint(
                lambda: _Loopback(self, node), local_addr=("127.0.0.1", 0)
            )
            self.sockets[node] = sock
        return sock

    def _from_relay(self, src: int, datagram: bytes) -> None:
        """A peer's WireGuard packet: to the local WireGuard, from that peer's socket."""
        sock = self.sockets.get(src)
        if sock is not None and sock.transport is not None:
            sock.transport.sendto(datagram, ("127.0.0.1", self.wg_port))
            return

        async def first() -> None:
            made = await self._socket(src)
            if made.transport is not None:
                made.transport.sendto(datagram, ("127.0.0.1", self.wg_port))

        self.endpoint.spawn(first())

    async def divert(self, node: int, public_key: str) -> None:
        """Send the peer's WireGuard traffic through the relays from now on."""
        if node in self.diverted:
            return
        sock = await self._socket(node)
        assert sock.transport is not None
        port = sock.transport.get_extra_info("sockname")[1]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.endpoint.up.wait(), 10)
        await self.set_endpoint(public_key, f"127.0.0.1:{port}")
        self.diverted.add(node)
        log.warning("job %s: the direct path to node%d is lost; through the relays now",
                    self.gang, node)  # fmt: skip
