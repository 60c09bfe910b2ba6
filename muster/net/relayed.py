"""A relayed member's endpoint (seed 000, Relayed): SOCKS5 on loopback in, relays out.

The ranks' connections to peers arrive here from the shim (muster.net.shim) as SOCKS5
CONNECTs. Each becomes a *stream* inside the one end-to-end session this member keeps with
that peer; sessions cross the relays (muster.net.relay) as opaque DATA frames. At the peer's
endpoint a stream dials the peer's own address and port, so torchrun's store, gloo's and
NCCL's listeners need no help.

Sessions. Every member makes an X25519 key for the epoch; the controller hands each member its
peers' public keys. A pair's two directional ChaCha20-Poly1305 keys come from their shared
secret (HKDF-SHA256, bound to the gang and the pair), so a relay, or anyone on its path, sees
ciphertext only and cannot forge, replay or reorder what it carries. A packet is
``[u8 kind][u64 number][ciphertext]``; the number is the nonce (one space per direction and
kind) and, for data, the sequence number.

Reliability across relays. Data packets are numbered per direction and kept until the peer
acknowledges them (cumulative acks, at most every ACK_EVERY packets or ACK_DELAY_S); the peer
delivers in order and drops what it has seen. The endpoint holds a link to every relay of the
gang and sends on the first one up. When a link drops it sends on another, and what was not
acknowledged goes again (also whenever acks stall for RESEND_AFTER_S): a relay killed
mid-stream costs a pause, not a connection. The resend buffer is bounded (RESEND_MAX bytes per
peer); a full one holds the senders back.

Inside a session, messages ``[u8 op][u32 stream][payload]``: OPEN (the port to dial),
OPENED, REFUSED, DATA, FIN (half close), RESET.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from muster.net.relaywire import Kind, LinkClosed, data_frame, json_frame, parse_data, read_frame

log = logging.getLogger("muster.relayed")

CHUNK = 60 * 1024  # payload read from a rank's socket per DATA message
RESEND_MAX = 32 * 1024 * 1024  # unacknowledged bytes per peer before senders wait
STREAM_BUFFER = 64 * 1024 * 1024  # bytes queued for one stream's local socket
ACK_EVERY = 16
ACK_DELAY_S = 0.02
RESEND_AFTER_S = 1.0
OPEN_TIMEOUT_S = 60.0
REDIAL_S = 0.5
DRAIN_TIMEOUT_S = 2.0  # a link that takes no bytes for this long is given up (and redialled)
WELCOME_TIMEOUT_S = 10.0
DATAGRAM_BACKLOG = 4 * 1024 * 1024  # bytes queued on a link before datagrams are dropped

_PACKET = struct.Struct("!BQ")
_MESSAGE = struct.Struct("!BI")
_DATA, _ACK = 1, 2
OPEN, OPENED, REFUSED, DATA, FIN, RESET = 1, 2, 3, 4, 5, 6


def new_key() -> tuple[X25519PrivateKey, bytes]:
    private = X25519PrivateKey.generate()
    return private, private.public_key().public_bytes_raw()


def pair_keys(
    private: X25519PrivateKey, peer_public: bytes, gang: str, me: int, peer: int
) -> tuple[bytes, bytes]:
    """(key to send with, key to receive with) for the pair: both ends derive the same two."""
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    low, high = min(me, peer), max(me, peer)
    okm = HKDF(
        algorithm=hashes.SHA256(),
        length=64,
        salt=None,
        info=f"muster-relayed\0{gang}\0{low}\0{high}".encode(),
    ).derive(shared)
    low_to_high, high_to_low = okm[:32], okm[32:]
    return (low_to_high, high_to_low) if me == low else (high_to_low, low_to_high)


def socket_uid(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The uid owning the TCP socket at ``local`` connected to ``remote`` on this host (from
    /proc/net/tcp): the process on the other end of one of our loopback connections."""
    want = (_proc_address(local), _proc_address(remote))
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if (fields[1], fields[2]) == want or (
                        table.endswith("6") and (fields[1], fields[2]) == _v6(want)
                    ):
                        return int(fields[7])
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return None


def _proc_address(where: tuple[str, int]) -> str:
    """('127.0.0.1', 5) -> '0100007F:0005', as /proc/net/tcp writes IPv4 ends."""
    packed = socket.inet_aton(where[0])
    return f"{int.from_bytes(packed, 'little'):08X}:{where[1]:04X}"


def _v6(pair: tuple[str, str]) -> tuple[str, str]:
    """The same two IPv4 ends as /proc/net/tcp6 writes them (v4-mapped)."""
    return tuple(  # type: ignore[return-value]
        "0000000000000000FFFF0000" + end[:8] + end[8:] for end in pair
    )


def _nonce(kind: int, number: int) -> bytes:
    return bytes([kind, 0, 0, 0]) + number.to_bytes(8, "big")


@dataclass
class _Stream:
    id: int
    writer: asyncio.StreamWriter | None = None
    opened: asyncio.Future[bool] | None = None
    queue: deque[bytes] = field(default_factory=deque)
    queued: int = 0
    fin: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    room: asyncio.Event = field(default_factory=asyncio.Event)


class _Session:
    """This member's end-to-end session with one peer: numbered, acknowledged, resent."""

    def __init__(self, endpoint: Endpoint, peer: int, send_key: bytes, recv_key: bytes) -> None:
        self.endpoint = endpoint
        self.peer = peer
        self.seal = ChaCha20Poly1305(send_key)
        self.open_ = ChaCha20Poly1305(recv_key)
        self.next_seq = 1
        self.unacked: deque[tuple[int, bytes]] = deque()  # (seq, frame) in order
        self.unacked_bytes = 0
        self.room = asyncio.Event()
        self.room.set()
        self.expected = 1  # the next data number to deliver
        self.ack_number = 0  # nonce space of our acks
        self.last_ack_in = 0  # the peer's highest ack number seen (replay guard)
        self.since_ack = 0
        self.ack_due: asyncio.TimerHandle | None = None
        self.progress = time.monotonic()  # the last time the peer acknowledged anything
        self.streams: dict[int, _Stream] = {}
        self.next_stream = 1 if endpoint.me < peer else 2  # the two ends never pick alike
        self.lock = asyncio.Lock()

    # ---- out ------------------------------------------------------------------------------

    async def send(self, op: int, stream: int, payload: bytes = b"") -> None:
        while self.unacked_bytes >= RESEND_MAX:
            self.room.clear()
            await self.room.wait()
        async with self.lock:  # numbers leave in order
            seq = self.next_seq
            self.next_seq += 1
            header = _PACKET.pack(_DATA, seq)
            sealed = self.seal.encrypt(
                _nonce(_DATA, seq), _MESSAGE.pack(op, stream) + payload, header
            )
            packet = data_frame(self.endpoint.gang, self.endpoint.me, self.peer, header + sealed)
            self.unacked.append((seq, packet))
            self.unacked_bytes += len(packet)
            await self.endpoint.transmit(packet)

    async def resend(self) -> None:
        """Everything not acknowledged, in order, on the link up now."""
        async with self.lock:
            for _seq, packet in list(self.unacked):
                await self.endpoint.transmit(packet)
            self.progress = time.monotonic()

    def _acked(self, upto: int) -> None:
        while self.unacked and self.unacked[0][0] <= upto:
            _seq, packet = self.unacked.popleft()
            self.unacked_bytes -= len(packet)
            self.progress = time.monotonic()
        if self.unacked_bytes < RESEND_MAX:
            self.room.set()

    async def _send_ack(self) -> None:
        self.ack_due = None
        self.since_ack = 0
        self.ack_number += 1
        header = _PACKET.pack(_ACK, self.ack_number)
        body = (self.expected - 1).to_bytes(8, "big")
        sealed = self.seal.encrypt(_nonce(_ACK, self.ack_number), body, header)
        await self.endpoint.transmit(
            data_frame(self.endpoint.gang, self.endpoint.me, self.peer, header + sealed)
        )

    def _schedule_ack(self) -> None:
        self.since_ack += 1
        if self.since_ack >= ACK_EVERY:
            if self.ack_due is not None:
                self.ack_due.cancel()
            self.endpoint.spawn(self._send_ack())
        elif self.ack_due is None:
            loop = asyncio.get_running_loop()
            self.ack_due = loop.call_later(
                ACK_DELAY_S, lambda: self.endpoint.spawn(self._send_ack())
            )

    # ---- in -------------------------------------------------------------------------------

    async def received(self, packet: memoryview) -> None:
        if len(packet) < _PACKET.size:
            return
        kind, number = _PACKET.unpack_from(packet)
        header = bytes(packet[: _PACKET.size])
        try:
            plain = self.open_.decrypt(_nonce(kind, number), bytes(packet[_PACKET.size :]), header)
        except InvalidTag:
            self.endpoint.forged += 1
            return
        if kind == _ACK:
            if number > self.last_ack_in:
                self.last_ack_in = number
                self._acked(int.from_bytes(plain[:8], "big"))
            return
        if kind != _DATA:
            return
        if number != self.expected:  # seen already, or after a gap the resend fills
            if number < self.expected:
                self._schedule_ack()  # it resent what we have: say so again
            return
        self.expected += 1
        self._schedule_ack()
        op, stream = _MESSAGE.unpack_from(plain)
        await self._message(op, stream, plain[_MESSAGE.size :])

    async def _message(self, op: int, sid: int, payload: bytes) -> None:
        if op == OPEN:
            (port,) = struct.unpack("!H", payload[:2])
            inbound = _Stream(sid)
            self.streams[sid] = inbound
            self.endpoint.spawn(self._dial_local(inbound, port))
            return
        stream = self.streams.get(sid)
        if stream is None:
            return
        if op in (OPENED, REFUSED) and stream.opened is not None and not stream.opened.done():
            stream.opened.set_result(op == OPENED)
        elif op == DATA:
            if stream.fin:  # its socket is gone: nothing more is delivered to it
                return
            stream.queue.append(payload)
            stream.queued += len(payload)
            stream.wake.set()
            while stream.queued > STREAM_BUFFER and not stream.fin:
                stream.room.clear()  # this stream's socket is slow: hold the session back
                await stream.room.wait()
        elif op in (FIN, RESET):
            stream.fin = True
            stream.wake.set()
            if op == RESET and stream.writer is not None:
                stream.writer.transport.abort()

    # ---- streams --------------------------------------------------------------------------

    async def _dial_local(self, stream: _Stream, port: int) -> None:
        """An inbound stream: dial this member's own address and the port asked."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.endpoint.own_address, port), OPEN_TIMEOUT_S
            )
        except (OSError, TimeoutError):
            self.streams.pop(stream.id, None)
            await self.send(REFUSED, stream.id)
            return
        stream.writer = writer
        await self.send(OPENED, stream.id)
        await self._pump(stream, reader, writer)

    async def connect(
        self, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """An outbound stream from a rank: OPEN at the peer, then both ways until closed."""
        stream = _Stream(self.next_stream, writer, asyncio.get_running_loop().create_future())
        self.next_stream += 2
        self.streams[stream.id] = stream
        await self.send(OPEN, stream.id, struct.pack("!H", port))
        assert stream.opened is not None
        try:
            ok = await asyncio.wait_for(stream.opened, OPEN_TIMEOUT_S)
        except TimeoutError:
            await self.send(RESET, stream.id)  # a late OPENED must not leave it open there
            ok = False
        if not ok:
            self.streams.pop(stream.id, None)
            return False
        self.endpoint.spawn(self._pump(stream, reader, writer, socks_ok=True))
        return True

    async def _pump(
        self,
        stream: _Stream,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        socks_ok: bool = False,
    ) -> None:
        if socks_ok:
            writer.write(b"\x05\x00\x00\x01" + bytes(6))
        out = asyncio.ensure_future(self._drain_to_socket(stream, writer))
        try:
            while data := await reader.read(CHUNK):
                await self.send(DATA, stream.id, data)
            await self.send(FIN, stream.id)
        except (ConnectionError, OSError):
            await self.send(RESET, stream.id)
        with contextlib.suppress(Exception):
            await out
        self.streams.pop(stream.id, None)
        writer.close()

    async def _drain_to_socket(self, stream: _Stream, writer: asyncio.StreamWriter) -> None:
        try:
            await self._drain_loop(stream, writer)
        except (ConnectionError, OSError):
            pass
        finally:  # (the session is never held back by a stream that is gone)
            stream.fin = True
            stream.queue.clear()
            stream.queued = 0
            stream.room.set()

    async def _drain_loop(self, stream: _Stream, writer: asyncio.StreamWriter) -> None:
        while True:
            while stream.queue:
                data = stream.queue.popleft()
                stream.queued -= len(data)
                writer.write(data)
                await writer.drain()
                if stream.queued <= STREAM_BUFFER:
                    stream.room.set()
            if stream.fin:
                with contextlib.suppress(OSError):
                    if writer.can_write_eof():
                        writer.write_eof()
                stream.room.set()
                return
            stream.wake.clear()
            await stream.wake.wait()


TicketSource = Callable[[int], Awaitable[str]]


class Endpoint:
    """One member's endpoint: its SOCKS5 listener, its links to the relays, its sessions."""

    def __init__(
        self,
        gang: str,
        me: int,
        addresses: list[str],
        private: X25519PrivateKey | None,
        peer_keys: dict[int, bytes],
        relays: list[tuple[str, int]],
        ticket: TicketSource,
        on_datagram: Callable[[int, bytes], None] | None = None,
    ) -> None:
        self.gang = gang
        # Datagram mode (a direct gang's fallback, muster.agent.fallback): DATA frames are
        # handed over whole, already sealed by WireGuard; no sessions, no SOCKS5 listener.
        self.on_datagram = on_datagram
        self.me = me
        self.addresses = addresses
        self.own_address = addresses[me] if addresses else ""
        self.by_address = {ipaddress.ip_address(a): n for n, a in enumerate(addresses) if n != me}
        self.sessions = (
            {
                peer: _Session(self, peer, *pair_keys(private, key, gang, me, peer))
                for peer, key in peer_keys.items()
            }
            if private is not None
            else {}
        )
        self.relays = relays
        self.ticket = ticket
        self.links: dict[int, asyncio.StreamWriter] = {}  # relay index -> link, while up
        self.active: int | None = None
        self.up = asyncio.Event()
        self.forged = 0  # packets that failed authentication
        self.refused = 0  # SOCKS5 connections from another user's process
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._send_lock = asyncio.Lock()

    @property
    def socks(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    def spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        if self.on_datagram is None:
            self.server = await asyncio.start_server(self._socks, "127.0.0.1", 0)
        for index in range(len(self.relays)):
            self.spawn(self._link(index))
        self.spawn(self._watch())

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for session in self.sessions.values():
            if session.ack_due is not None:
                session.ack_due.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self.links.values():
            writer.close()

    # ---- relays ---------------------------------------------------------------------------

    async def _link(self, index: int) -> None:
        """Hold a link to relay ``index``, dialling again (with a fresh ticket) when it drops."""
        host, port = self.relays[index]
        while True:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), WELCOME_TIMEOUT_S
                )
                ticket = await self.ticket(index)
                writer.write(
                    json_frame(Kind.HELLO, {"gang": self.gang, "member": self.me, "ticket": ticket})
                )
                kind, body = await asyncio.wait_for(read_frame(reader), WELCOME_TIMEOUT_S)
                if kind is not Kind.WELCOME:
                    raise LinkClosed(f"relay {host}:{port} refused: {body[:200]!r}")
                self.links[index] = writer
                if self.active is None or self.active not in self.links or index < self.active:
                    await self._switch(index)  # the first relay of the list while it is up
                self.up.set()
                await self._read(reader)
            except (OSError, LinkClosed, TimeoutError) as exc:
                log.info("member %d: relay %s:%d: %r", self.me, host, port, exc)
            except Exception:
                log.exception("member %d: the link to relay %s:%d failed", self.me, host, port)
            if self.links.pop(index, None) is not None and self.active == index:
                others = sorted(self.links)
                self.active = None
                if others:
                    await self._switch(others[0])
                else:
                    self.up.clear()
            await asyncio.sleep(REDIAL_S)

    async def _switch(self, index: int) -> None:
        """Send on relay ``index`` from now on, and resend there what was not acked."""
        self.active = index
        for session in self.sessions.values():
            self.spawn(session.resend())

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            kind, body = await read_frame(reader)
            if kind is not Kind.DATA:
                continue
            gang, src, dst, payload = parse_data(body)
            if gang != self.gang or dst != self.me:
                continue
            if self.on_datagram is not None:
                self.on_datagram(src, bytes(payload))
                continue
            session = self.sessions.get(src)
            if session is not None:
                await session.received(payload)

    async def transmit(self, packet: bytes) -> None:
        """One frame onto the active relay's link (waiting, bounded by the resend, for one)."""
        async with self._send_lock:
            while True:
                writer = self.links.get(self.active) if self.active is not None else None
                if writer is not None and not writer.is_closing():
                    writer.write(packet)
                    # (a link that broke: its reader sees it end and switches; acks decide)
                    try:
                        await asyncio.wait_for(writer.drain(), DRAIN_TIMEOUT_S)
                    except TimeoutError:  # a relay that went silent: give the link up
                        log.warning("member %d: a relay link took nothing for %.0fs; dropped",
                                    self.me, DRAIN_TIMEOUT_S)  # fmt: skip
                        writer.transport.abort()
                    except (ConnectionError, OSError):
                        pass
                    return
                self.up.clear()
                try:
                    await asyncio.wait_for(self.up.wait(), RESEND_AFTER_S)
                except TimeoutError:
                    return  # kept unacked: resent once a relay is up

    def send_now(self, packet: bytes) -> bool:
        """Datagram mode: onto the active link at once, or dropped (no link up, or more than
        DATAGRAM_BACKLOG waiting on it): what it carries resends its own."""
        writer = self.links.get(self.active) if self.active is not None else None
        if writer is None or writer.is_closing():
            return False
        if writer.transport.get_write_buffer_size() > DATAGRAM_BACKLOG:
            return False
        writer.write(packet)
        return True

    async def _watch(self) -> None:
        """Resend what stalls: no ack progress for RESEND_AFTER_S with data outstanding."""
        while True:
            await asyncio.sleep(RESEND_AFTER_S / 4)
            now = time.monotonic()
            stalled = [
                s for s in self.sessions.values() if s.unacked and now - s.progress > RESEND_AFTER_S
            ]
            others = sorted(i for i in self.links if i != self.active)
            if stalled and others:
                # No ack through this relay for a while: it may have gone silent without a
                # word (a host down, a partition). Go on through the next one (which resends
                # what is outstanding); the silent link is dropped by its own timeouts.
                log.info("member %d: acks stalled on relay %s; switching", self.me, self.active)
                for session in stalled:
                    session.progress = now  # (one switch per stall, not one per look)
                await self._switch(others[0])
                continue
            for session in stalled:
                self.spawn(session.resend())

    # ---- SOCKS5 ---------------------------------------------------------------------------

    async def _socks(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The shim's CONNECT, from a process of this agent's own user only (the ranks run
        as it: what its ranks may reach it already may; another user of the host may not
        use the endpoint to reach the peers), to a peer's address only."""
        client = writer.get_extra_info("peername")
        server = writer.get_extra_info("sockname")
        uid = await asyncio.to_thread(socket_uid, client, server)
        if uid != os.getuid():
            self.refused += 1
            if self.refused in (1, 10, 100, 1000):
                log.warning(
                    "member %d: refused a SOCKS5 connection from uid %s (only uid %d's "
                    "processes may use the relayed endpoint); %d so far",
                    self.me, uid, os.getuid(), self.refused,
                )  # fmt: skip
            writer.close()
            return
        try:
            head = await asyncio.wait_for(reader.readexactly(2), 10)
            await reader.readexactly(head[1])
            writer.write(b"\x05\x00")
            request = await asyncio.wait_for(reader.readexactly(4), 10)
            if request[3] == 1:
                raw = await reader.readexactly(4)
            elif request[3] == 4:
                raw = await reader.readexactly(16)
            else:
                raise ValueError("only IP addresses are relayed")
            (port,) = struct.unpack("!H", await reader.readexactly(2))
            address = ipaddress.ip_address(raw)
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
                address = address.ipv4_mapped
            peer = self.by_address.get(address)
            if request[1] != 1 or peer is None or peer not in self.sessions:
                writer.write(b"\x05\x02\x00\x01" + bytes(6))  # not allowed: no peer of ours
                writer.close()
                return
            if not await self.sessions[peer].connect(port, reader, writer):
                writer.write(b"\x05\x05\x00\x01" + bytes(6))  # refused at the peer
                writer.close()
        except (OSError, ValueError, asyncio.IncompleteReadError, TimeoutError):
            writer.close()
