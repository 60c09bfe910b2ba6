"""The UDP reflector on the controller's port number: tells a sender its public UDP endpoint.

The direct path needs each member's endpoint as its peers will see it: behind a NAT that is
the router's public address and the port it mapped, which only something outside can see.
An agent sends ``REQUEST`` from the UDP port its WireGuard device will listen on; the answer
is ``REPLY nonce ip port`` as the datagram arrived. Anyone may ask (it says nothing but the
asker's own address, as a STUN server does); an answer is never larger than its question, so
the reflector amplifies nothing, and anything else is dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from typing import cast

from muster.controller.metrics import Metrics

log = logging.getLogger("muster.controller")

REQUEST = b"muster-reflect "
REPLY = b"muster-reflected "
MAX_REQUEST = 128


class Reflector(asyncio.DatagramProtocol):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        if self.transport is None:
            return
        nonce = data[len(REQUEST) :].split(b" ", 1)[0] if data.startswith(REQUEST) else b""
        host = str(addr[0])
        with contextlib.suppress(ValueError):  # an IPv4 agent on a dual-stack socket
            mapped = ipaddress.ip_address(host)
            if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
                host = str(mapped.ipv4_mapped)
        reply = REPLY + nonce + f" {host} {addr[1]}".encode()
        if not nonce or len(data) > MAX_REQUEST or len(reply) > len(data):
            self.metrics.frames_refused.labels("reflector").inc()
            return
        self.transport.sendto(reply, addr)

    def error_received(self, exc: Exception) -> None:  # an ICMP error for an earlier reply
        log.debug("reflector: %s", exc)


async def start_reflector(
    host: str, port: int, metrics: Metrics
) -> asyncio.DatagramTransport | None:
    """Listen on ``host``:``port`` UDP; None (logged) when that port cannot be had."""
    if not port:
        return None
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind = host if host not in ("localhost",) else "127.0.0.1"
    try:
        transport, _ = await loop.create_datagram_endpoint(
            lambda: Reflector(metrics), local_addr=(bind, port), family=family
        )
    except OSError as exc:
        log.warning(
            "no UDP reflector on %s:%d (%s): members behind NATs cannot learn their "
            "public endpoints for the direct path",
            host,
            port,
            exc,
        )
        return None
    return transport
