"""The relayed path's parts with real sockets on loopback: relays (muster.net.relay) and
member endpoints (muster.net.relayed). Member 0 lives at 127.0.0.1 and member 1 at 127.0.0.2
(both loopback): a stream from member 0's SOCKS5 endpoint to 127.0.0.2:PORT crosses a relay,
encrypted, and member 1's endpoint dials its own address and that port."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from muster.net.relay import Relay
from muster.net.relayed import Endpoint, new_key
from muster.net.relaywire import Kind, LinkClosed, issue_ticket, json_frame, read_frame

SECRET = b"s" * 32
GANG = "job1/1"
pytestmark = pytest.mark.timeout(120)


async def echo_server(host: str) -> tuple[asyncio.Server, int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, host, 0)
    return server, server.sockets[0].getsockname()[1]


async def socks_connect(socks: str, host: str, port: int) -> tuple[Any, Any]:
    """What the shim does: SOCKS5, no auth, CONNECT to an IPv4 peer."""
    shost, sport = socks.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(shost, int(sport))
    writer.write(b"\x05\x01\x00")
    assert await reader.readexactly(2) == b"\x05\x00"
    writer.write(b"\x05\x01\x00\x01" + socket.inet_aton(host) + struct.pack("!H", port))
    reply = await reader.readexactly(10)
    if reply[1] != 0:
        raise ConnectionRefusedError(f"SOCKS reply {reply[1]}")
    return reader, writer


async def gang(relays: list[Relay]) -> tuple[Endpoint, Endpoint]:
    keys = [new_key() for _ in range(2)]
    addresses = ["127.0.0.1", "127.0.0.2"]
    where = [("127.0.0.1", r.port) for r in relays]
    endpoints = []
    for me in (0, 1):

        async def ticket(_index: int, me: int = me) -> str:
            return issue_ticket(SECRET, GANG, me)

        peer = 1 - me
        endpoint = Endpoint(GANG, me, addresses, keys[me][0], {peer: keys[peer][1]}, where, ticket)
        await endpoint.start()
        endpoints.append(endpoint)
    for endpoint in endpoints:
        await asyncio.wait_for(endpoint.up.wait(), 10)
    return endpoints[0], endpoints[1]


async def relay(name: str, peers: list[tuple[str, int]] | None = None, port: int = 0) -> Relay:
    r = Relay(name, SECRET, ("127.0.0.1", port), peers or [])
    await r.start()
    return r


async def wait_for(check: Callable[[], bool], within: float = 10) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while not check():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.02)


def run(work: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(work())


def test_a_stream_crosses_a_relay_encrypted_both_ways_and_the_peer_dials_itself() -> None:
    async def scenario() -> None:
        r = await relay("r1")
        a, b = await gang([r])
        server, port = await echo_server("127.0.0.2")
        reader, writer = await socks_connect(a.socks, "127.0.0.2", port)
        blob = os.urandom(8 * 1024 * 1024)
        writer.write(blob)
        await writer.drain()
        writer.write_eof()
        back = await asyncio.wait_for(reader.read(-1), 30)
        assert hashlib.sha256(back).digest() == hashlib.sha256(blob).digest()
        assert r.metered[(GANG, 0)] >= len(blob), "the relay meters what member 0 sent"
        # a port nothing listens on at the peer: refused, as a direct connect would be
        with pytest.raises(ConnectionRefusedError):
            await socks_connect(a.socks, "127.0.0.2", 1)
        # an address that is no peer of this gang: not allowed
        with pytest.raises(ConnectionRefusedError, match="reply 2"):
            await socks_connect(a.socks, "10.9.9.9", port)
        server.close()
        for x in (a, b):
            await x.close()
        await r.close()

    run(scenario)


def test_a_relay_killed_mid_stream_costs_a_pause_not_the_connection() -> None:
    async def scenario() -> None:
        r2 = await relay("r2")
        r1 = await relay("r1", [("127.0.0.1", r2.port)])
        await wait_for(lambda: "r1" in r2.relays)
        a, b = await gang([r1, r2])
        await wait_for(lambda: a.active == 0 and b.active == 0 and len(a.links) == 2)
        server, port = await echo_server("127.0.0.2")
        reader, writer = await socks_connect(a.socks, "127.0.0.2", port)
        total = 64 * 1024 * 1024
        received = 0
        stalls: list[float] = []
        loop = asyncio.get_running_loop()

        async def drain() -> None:
            nonlocal received
            last = loop.time()
            while received < total:
                data = await reader.read(1 << 20)
                assert data, "the stream broke"
                now = loop.time()
                stalls.append(now - last)
                last = now
                received += len(data)

        reading = asyncio.ensure_future(drain())
        chunk = os.urandom(1 << 20)
        for i in range(total >> 20):
            writer.write(chunk)
            await writer.drain()
            if i == 16:
                assert r1.metered[(GANG, 0)] > 8 << 20, "it went through r1 so far"
                before = r2.metered[(GANG, 0)]
                await r1.close()  # the relay both members send on dies
        await asyncio.wait_for(reading, 60)
        assert received == total
        assert max(stalls) < 3.0, f"failover stall {max(stalls):.2f}s"
        assert r2.metered[(GANG, 0)] - before > 16 << 20, "the rest went through r2"
        server.close()
        for x in (a, b):
            await x.close()
        await r2.close()

    run(scenario)


def test_a_relay_refuses_foreign_stale_reused_and_forged_tickets() -> None:
    async def hello(r: Relay, body: dict[str, Any]) -> tuple[Kind, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        writer.write(json_frame(Kind.HELLO, body))
        answer = await read_frame(reader)
        writer.close()
        return answer

    async def scenario() -> None:
        r = await relay("r1")
        good = issue_ticket(SECRET, GANG, 0)
        kind, _ = await hello(r, {"gang": GANG, "member": 0, "ticket": good})
        assert kind is Kind.WELCOME
        cases = {
            "a ticket used before": {"gang": GANG, "member": 0, "ticket": good},
            "another gang or member": {
                "gang": "job2/1",
                "member": 0,
                "ticket": issue_ticket(SECRET, GANG, 0),
            },
            "did not sign": {"gang": GANG, "member": 0, "ticket": issue_ticket(b"x" * 32, GANG, 0)},
            "an expired ticket": {
                "gang": GANG,
                "member": 0,
                "ticket": issue_ticket(SECRET, GANG, 0, ttl=-1),
            },
        }
        for why, body in cases.items():
            kind, said = await hello(r, body)
            assert kind is Kind.REFUSED, why
            assert why in json.loads(said)["reason"], said
        assert r.refused == len(cases)
        await r.close()

    run(scenario)


class Tap:
    """A TCP forwarder between a member and its relay that keeps every byte it carries."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.seen = bytearray()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._one, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                self.seen += data
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


def test_the_relay_sees_only_ciphertext_and_a_forged_packet_is_dropped() -> None:
    async def scenario() -> None:
        r = await relay("r1")
        tap = Tap(r.port)
        tapped = await tap.start()
        keys = [new_key() for _ in range(2)]
        addresses = ["127.0.0.1", "127.0.0.2"]

        async def ticket0(_i: int) -> str:
            return issue_ticket(SECRET, GANG, 0)

        async def ticket1(_i: int) -> str:
            return issue_ticket(SECRET, GANG, 1)

        a = Endpoint(
            GANG, 0, addresses, keys[0][0], {1: keys[1][1]}, [("127.0.0.1", tapped)], ticket0
        )
        b = Endpoint(
            GANG, 1, addresses, keys[1][0], {0: keys[0][1]}, [("127.0.0.1", r.port)], ticket1
        )
        for x in (a, b):
            await x.start()
            await asyncio.wait_for(x.up.wait(), 10)
        server, port = await echo_server("127.0.0.2")
        reader, writer = await socks_connect(a.socks, "127.0.0.2", port)
        secret_text = b"the known payload muster must never show a relay " * 200
        writer.write(secret_text)
        await writer.drain()
        got = await asyncio.wait_for(reader.readexactly(len(secret_text)), 20)
        assert got == secret_text
        assert len(tap.seen) > len(secret_text), "the payload crossed the tap"
        assert b"the known payload" not in bytes(tap.seen)
        # A member of the gang (here: a raw link with member 0's ticket) sends member 1
        # bytes that are no sealed packet: dropped and counted, the stream goes on.
        from muster.net.relaywire import data_frame

        raw_reader, raw_writer = await asyncio.open_connection("127.0.0.1", r.port)
        raw_writer.write(
            json_frame(
                Kind.HELLO, {"gang": GANG, "member": 0, "ticket": issue_ticket(SECRET, GANG, 0)}
            )
        )
        assert (await read_frame(raw_reader))[0] is Kind.WELCOME
        raw_writer.write(data_frame(GANG, 0, 1, b"\x01" + (99).to_bytes(8, "big") + b"junk" * 8))
        await raw_writer.drain()
        await wait_for(lambda: b.forged >= 1)
        writer.write(b"still here")
        assert await asyncio.wait_for(reader.readexactly(10), 10) == b"still here"
        raw_writer.close()
        server.close()
        for x in (a, b):
            await x.close()
        await r.close()

    run(scenario)


def test_the_rate_cap_holds_and_the_metering_matches_what_was_sent() -> None:
    """A ticket for 40 Mbit/s (5 MB/s): 20 MB through the relay take 4 s within 10%, and
    the relay's count (what the controller asks for) matches the bytes sent within 1%."""
    from muster.controller.relays import ask

    async def scenario() -> None:
        r = await relay("r1")
        rate = 5e6
        keys = [new_key() for _ in range(2)]
        addresses = ["127.0.0.1", "127.0.0.2"]
        endpoints = []
        for me in (0, 1):

            async def ticket(_i: int, me: int = me) -> str:
                return issue_ticket(SECRET, GANG, me, rate=rate)

            peer = 1 - me
            e = Endpoint(
                GANG, me, addresses, keys[me][0], {peer: keys[peer][1]},
                [("127.0.0.1", r.port)], ticket,
            )  # fmt: skip
            await e.start()
            await asyncio.wait_for(e.up.wait(), 10)
            endpoints.append(e)
        sink_got = 0

        async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal sink_got
            while data := await reader.read(1 << 20):
                sink_got += len(data)
            writer.close()

        server = await asyncio.start_server(sink, "127.0.0.2", 0)
        port = server.sockets[0].getsockname()[1]
        _reader, writer = await socks_connect(endpoints[0].socks, "127.0.0.2", port)
        total = 20_000_000
        loop = asyncio.get_running_loop()
        start = loop.time()
        chunk = os.urandom(1 << 16)
        sent = 0
        while sent < total:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
        await wait_for(lambda: sink_got >= sent, within=30)
        took = loop.time() - start
        assert abs(sent / took - rate) / rate < 0.10, f"{sent / took / 1e6:.2f} MB/s"
        counted = {(g, m): n for g, m, n in await ask("127.0.0.1", r.port, SECRET)}
        assert abs(counted[(GANG, 0)] - sent) / sent < 0.01, (counted, sent)
        with pytest.raises(LinkClosed, match="refused"):
            await ask("127.0.0.1", r.port, b"w" * 32)  # no secret, no counts
        writer.close()
        server.close()
        for e in endpoints:
            await e.close()
        await r.close()

    run(scenario)


def test_another_users_process_cannot_use_the_endpoint() -> None:
    """The endpoint serves the agent's own user's processes only: a process of another user
    on the host (here `nobody`) is closed on at once, and counted."""
    import shutil
    import subprocess
    import sys

    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a client as another user")

    async def scenario() -> None:
        r = await relay("r1")
        a, b = await gang([r])
        host, port = a.socks.rsplit(":", 1)
        client = (
            "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2])));"
            "s.sendall(b'\\x05\\x01\\x00'); print(repr(s.recv(2)))"
        )
        done = await asyncio.to_thread(
            subprocess.run,
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             sys.executable, "-c", client, host, port],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.stdout.strip() == "b''", (done.stdout, done.stderr)
        assert a.refused == 1
        server, echo_port = await echo_server("127.0.0.2")
        _reader, writer = await socks_connect(a.socks, "127.0.0.2", echo_port)  # own user
        writer.close()
        server.close()
        for x in (a, b):
            await x.close()
        await r.close()

    run(scenario)


class Freezer:
    """A TCP forwarder that can go silent without closing anything (a host gone dark)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.frozen = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._one, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                if self.frozen.is_set():
                    await asyncio.sleep(3600)  # holds everything, closes nothing
                dst.write(data)
                await dst.drain()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


def test_a_relay_that_goes_silent_without_closing_is_left_for_the_next() -> None:
    """Member 0 reaches relay 1 through a link that goes dark mid-stream (no FIN, no RST):
    its acks stall, and it goes on through relay 2 within seconds; the stream completes."""

    async def scenario() -> None:
        r2 = await relay("r2")
        r1 = await relay("r1", [("127.0.0.1", r2.port)])
        await wait_for(lambda: "r1" in r2.relays)
        dark = Freezer(r1.port)
        via = await dark.start()
        keys = [new_key() for _ in range(2)]
        addresses = ["127.0.0.1", "127.0.0.2"]
        endpoints = []
        for me, first in ((0, via), (1, r1.port)):

            async def ticket(_i: int, me: int = me) -> str:
                return issue_ticket(SECRET, GANG, me)

            peer = 1 - me
            e = Endpoint(
                GANG, me, addresses, keys[me][0], {peer: keys[peer][1]},
                [("127.0.0.1", first), ("127.0.0.1", r2.port)], ticket,
            )  # fmt: skip
            await e.start()
            endpoints.append(e)
        a = endpoints[0]
        await wait_for(lambda: a.active == 0 and len(a.links) == 2)
        server, port = await echo_server("127.0.0.2")
        reader, writer = await socks_connect(a.socks, "127.0.0.2", port)
        got = 0
        total = 24 << 20
        loop = asyncio.get_running_loop()

        async def read_all() -> None:
            nonlocal got
            while got < total:
                data = await reader.read(1 << 20)
                assert data, "the stream broke"
                got += len(data)

        reading = asyncio.ensure_future(read_all())
        chunk = os.urandom(1 << 20)
        for i in range(total >> 20):
            writer.write(chunk)
            await writer.drain()
            if i == 4:
                dark.frozen.set()
                went_dark = loop.time()
        await asyncio.wait_for(reading, 60)
        assert got == total
        assert a.active == 1, "it went on through relay 2"
        assert loop.time() - went_dark < 30
        server.close()
        for e in endpoints:
            await e.close()
        await r1.close()
        await r2.close()

    run(scenario)


def test_a_members_tickets_are_refreshed_before_they_run_out_or_expire() -> None:
    from muster.agent.relayed import TicketStock
    from muster.wire import Kind as WireKind

    asked: list[tuple[WireKind, dict[str, Any]]] = []

    async def send(kind: WireKind, body: dict[str, Any]) -> None:
        asked.append((kind, body))

    async def scenario() -> None:
        ids = {"job": "job1", "epoch": 1, "node_rank": 0}
        fresh = [issue_ticket(SECRET, GANG, 0) for _ in range(4)]
        stale = issue_ticket(SECRET, GANG, 0, ttl=30)  # expires within the margin
        stock = TicketStock([{"host": "h", "port": 1, "tickets": [stale, *fresh]}], ids, send)
        assert await stock.take(0) == fresh[0], "a ticket about to expire is skipped"
        await stock.take(0)
        assert asked == []
        await stock.take(0)  # two left before this one: time to ask
        assert asked == [(WireKind.RELAY_TICKETS, ids)]
        await stock.take(0)
        with pytest.raises(ConnectionError, match="asked the controller"):
            await stock.take(0)
        stock.add([{"host": "h", "port": 1, "tickets": [issue_ticket(SECRET, GANG, 0)]}])
        assert await stock.take(0)

    run(scenario)
