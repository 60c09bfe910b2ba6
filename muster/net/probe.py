"""The probe: before the command starts, every pair of a gang proves the path it will use.

Each member listens on an ephemeral TCP port on its path address (the private address, or the
mesh address on the direct path). Then each member measures every peer after it in node order,
one peer at a time: readiness (three fresh TCP connections), round-trip time (an echo over one
connection), and a throughput sample (one stream for at most ``seconds``, ending sooner once
its rate holds steady; counted by the receiver). A pair that cannot connect fails the probe,
naming the pair.

Wire protocol on a probe connection: the first byte says what it is for, and the epoch's
probe token (16 bytes, from the controller) follows it; a connection without the token is
cut before anything is answered, so only the gang's own members are measured. ``c``: a readiness
connect (closed at once); ``e``: echo, one byte back for each byte; ``t``: throughput, the
receiver counts bytes until EOF and answers the count and the nanoseconds from its first to
its last byte (8 bytes big-endian each): the rate is the receiver's, without the connection's
set-up and the final round trip.

A throughput sample is copied in a thread at each end (blocking sockets, 1 MiB blocks): the
event loop would cap it near what one asyncio loop copies. Cancelling either end, or closing
the listener, shuts the sample's socket down, which wakes its thread.

The listener is bounded: at most MAX_CONNECTIONS at once, each for at most its deadline, all
of them cut when it closes (when the member is assigned or stopped, or its lifetime ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import ipaddress
import math
import re
import socket
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass

CONNECT_TIMEOUT_S = 5.0
# On the direct path, a readiness connection that times out is tried again until this much
# time has passed since the first: WireGuard starts a fresh handshake once a peer has sent
# for 15 s without hearing back, and two members that set each other up at the same instant
# can lose their first session keys that way. Elsewhere (and after a refusal) a pair gets
# READINESS_CONNECTIONS tries.
READINESS_WINDOW_S = 25.0
READINESS_MAX_ATTEMPTS = 8
# The mark (SO_MARK) on the probe's connections: a gang's rules let only its ranks' sockets
# and these into its network (muster.net.firewall); "must" in ASCII. It takes CAP_NET_ADMIN.
PROBE_MARK = 0x6D757374
READINESS_CONNECTIONS = 3
ECHO_ROUNDS = 10
# Then one echo of this many bytes: segments of the path's full size, both ways. A path that
# carries less than its links say (a tunnel underneath, its ICMP dropped) passes the
# handshake, the connections and the 1-byte rounds, and loses these: the pair fails here
# even with no throughput sample (probe_seconds 0), instead of the job's first collective
# hanging on it.
FULL_ECHO = 16 * 1024
CHUNK = 1024 * 1024  # per send and receive call of a throughput sample
# A sample ends early once its rate holds, after at least MIN_SAMPLE_S: the last
# STEADY_WINDOWS windows of WINDOW_S each within STEADY_SPREAD of their mean (a quiet link,
# 1 s), or, for a link that jitters about a level (a shared host's scheduling; a busy NIC),
# once the mean of the last PRECISE_WINDOWS windows (at least 8) is known to within
# STEADY_PRECISION at 95% and shows no trend (about 2 s at 10% jitter per window, 4 s at
# 15%). A link that ramps, drifts or wanders more (a shaped or congested one) is sampled for
# the whole of probe_seconds.
WINDOW_S = 0.25
STEADY_WINDOWS = 4
STEADY_SPREAD = 0.05
PRECISE_WINDOWS = 16
STEADY_PRECISION = 0.075
MIN_SAMPLE_S = 1.0
LISTEN_FOR_S = 300.0  # a listener nobody closes goes away after this (PROBE_LISTEN's "for")
MAX_CONNECTIONS = 64
CONNECTION_FOR_S = 75.0  # one probe connection at most (the largest sample is 60 s)


@dataclass(frozen=True)
class PairResult:
    node: int  # the peer
    connects: int  # readiness connections that succeeded, of READINESS_CONNECTIONS
    rtt_ms: float | None = None
    gbps: float | None = None
    error: str | None = None
    # The path the traffic actually took, read from the data plane after the measurement:
    # the interface the kernel routes the peer's address by, and on the direct path the
    # UDP endpoint WireGuard last shook hands with.
    via: str | None = None
    endpoint: str | None = None

    def as_json(self) -> dict[str, object]:
        return asdict(self)


class ProbeListener:
    """One member's probe endpoint, on its path address."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0
        self.token = b""  # the epoch's probe token; every connection must bring it
        self.refused = 0  # connections cut for a wrong token
        self._closer: asyncio.TimerHandle | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._samples: set[socket.socket] = set()  # throughput samples' sockets (threads)

    async def start(self, address: str, lifetime: float = LISTEN_FOR_S, token: bytes = b"") -> int:
        await self.close()
        self.token = token
        try:
            self.server = await asyncio.start_server(self._serve, address, 0)
        except OSError:
            # A NAT's or an elastic address no local interface holds: peers reach it all
            # the same, through whatever maps it here.
            wildcard = "::" if ":" in address else "0.0.0.0"
            self.server = await asyncio.start_server(self._serve, wildcard, 0)
        self.port = int(self.server.sockets[0].getsockname()[1])
        self._closer = asyncio.get_running_loop().call_later(
            max(1.0, lifetime), lambda: asyncio.ensure_future(self.close())
        )
        return self.port

    async def close(self) -> None:
        if self._closer is not None:
            self._closer.cancel()
            self._closer = None
        if self.server is not None:
            self.server.close()
            self.server = None
        for writer in list(self._open):  # Server.close leaves accepted connections open
            writer.transport.abort()
        self._open.clear()
        for sock in list(self._samples):  # a sample's thread holds a copy of its socket
            _cut(sock)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= MAX_CONNECTIONS:
            writer.transport.abort()
            return
        self._open.add(writer)
        try:
            await asyncio.wait_for(self._answer(reader, writer), CONNECTION_FOR_S)
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            self._open.discard(writer)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kind = await asyncio.wait_for(reader.read(1), CONNECT_TIMEOUT_S)
        if self.token:
            brought = await asyncio.wait_for(reader.readexactly(len(self.token)), CONNECT_TIMEOUT_S)
            if not hmac.compare_digest(brought, self.token):
                self.refused += 1
                return
        if kind == b"e":
            while data := await reader.read(FULL_ECHO):  # (a byte a round, then FULL_ECHO)
                writer.write(data)
                await writer.drain()
        elif kind == b"t":
            # Counted in a thread on a blocking copy of the socket (the event loop's reads
            # would cap the sample near what one asyncio loop can copy, not what the path
            # carries). What the stream reader holds already is set-up, not sample.
            if isinstance(writer.transport, asyncio.ReadTransport):
                writer.transport.pause_reading()
            sock = writer.get_extra_info("socket").dup()  # _receive closes it
            self._samples.add(sock)
            try:
                answer = await asyncio.to_thread(_receive, sock, CONNECTION_FOR_S)
            except asyncio.CancelledError:
                _cut(sock)  # the thread wakes, and ends
                raise
            finally:
                self._samples.discard(sock)
            writer.write(answer)
            await writer.drain()


def _cut(sock: socket.socket) -> None:
    """Wake a thread blocked on ``sock`` (it then ends and closes it)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


# The relayed path's SOCKS5 endpoint (host, port) the probe's connections go through, as
# the ranks' do through the shim (muster.net.relayed); None: straight to the peer.
_VIA: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "probe_via", default=None
)


async def _socks_connect(sock: socket.socket, address: str, port: int) -> None:
    """SOCKS5 CONNECT on ``sock`` (connected to the endpoint) to address:port."""
    loop = asyncio.get_running_loop()

    async def read(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = await loop.sock_recv(sock, n - len(data))
            if not chunk:
                raise ConnectionResetError(104, "the relayed endpoint closed")
            data += chunk
        return data

    await loop.sock_sendall(sock, b"\x05\x01\x00")
    if await read(2) != b"\x05\x00":
        raise ConnectionRefusedError(111, "the relayed endpoint refused the handshake")
    packed = ipaddress.ip_address(address).packed
    kind = b"\x01" if len(packed) == 4 else b"\x04"
    await loop.sock_sendall(sock, b"\x05\x01\x00" + kind + packed + port.to_bytes(2, "big"))
    reply = await read(4)
    await read(6 if reply[3] == 1 else 18)
    if reply[1] != 0:
        raise ConnectionRefusedError(111, f"Connection refused (through the relays: {reply[1]})")


async def _socket_to(address: str, port: int, timeout: float | None = None) -> socket.socket:
    """A connected socket carrying the probe's mark (the gang's rules let it into the
    network), to the first of the address's resolutions that answers (``timeout`` each:
    CONNECT_TIMEOUT_S by default); on the relayed path, through the member's endpoint."""
    timeout = CONNECT_TIMEOUT_S if timeout is None else timeout
    via = _VIA.get()
    if via is not None:
        sock = await _socket_direct(via[0], via[1], timeout)
        try:
            await asyncio.wait_for(_socks_connect(sock, address, port), timeout)
        except BaseException:
            sock.close()
            raise
        return sock
    return await _socket_direct(address, port, timeout)


async def _socket_direct(address: str, port: int, timeout: float) -> socket.socket:
    loop = asyncio.get_running_loop()
    found = await asyncio.wait_for(
        loop.getaddrinfo(address, port, type=socket.SOCK_STREAM), timeout
    )
    error: OSError = OSError(f"{address} resolves to no address")
    for family, kind, proto, _name, where in found:
        sock = socket.socket(family, kind, proto)
        with contextlib.suppress(OSError):  # no CAP_NET_ADMIN: then there are no rules either
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, PROBE_MARK)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, where), timeout)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
    raise error


async def _connect(
    address: str, port: int, timeout: float | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = await _socket_to(address, port, timeout)
    try:
        return await asyncio.open_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


async def measure(
    node: int, address: str, port: int, seconds: float, token: bytes = b"", window: float = 0.0
) -> PairResult:
    """Readiness, RTT and (``seconds`` > 0) throughput to one peer; connections that time out
    are tried again for up to ``window`` seconds (0: READINESS_CONNECTIONS tries)."""
    connects = attempts = 0
    last_error = ""
    timed_out = False  # the last failure was a timeout (a refusal ends the window)
    answered = False  # the last attempt connected: the path works, the rest may follow
    first = time.monotonic()
    deadline = first + window
    while connects < READINESS_CONNECTIONS and attempts < READINESS_MAX_ATTEMPTS:
        limit = CONNECT_TIMEOUT_S
        if attempts - connects >= READINESS_CONNECTIONS and not answered:
            left = deadline - time.monotonic()
            if not timed_out or left <= 0:
                break
            # The window's last try fits in what is left of it (never a uselessly short one).
            limit = min(CONNECT_TIMEOUT_S, max(left, CONNECT_TIMEOUT_S / 5))
        attempts += 1
        try:
            _reader, writer = await _connect(address, port, limit)
        except (OSError, TimeoutError) as exc:
            last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            timed_out, answered = isinstance(exc, TimeoutError), False
            continue
        answered = True
        connects += 1
        writer.write(b"c" + token)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    if connects < READINESS_CONNECTIONS:
        return PairResult(
            node,
            connects,
            error=f"{connects} of {attempts} connections to {address}:{port} in "
            f"{time.monotonic() - first:.0f}s ({last_error})",
        )
    try:
        rtt = await _echo(address, port, token)
        gbps = await _throughput(address, port, seconds, token) if seconds > 0 else None
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        return PairResult(node, connects, error=f"measuring {address}:{port}: {exc!r}")
    return PairResult(node, connects, rtt_ms=round(rtt * 1e3, 3), gbps=gbps)


async def _echo(address: str, port: int, token: bytes) -> float:
    reader, writer = await _connect(address, port)
    try:
        writer.write(b"e" + token)
        rounds = []
        for _ in range(ECHO_ROUNDS):
            start = time.perf_counter()
            writer.write(b"x")
            await writer.drain()
            await asyncio.wait_for(reader.readexactly(1), CONNECT_TIMEOUT_S)
            rounds.append(time.perf_counter() - start)
        writer.write(b"x" * FULL_ECHO)
        await writer.drain()
        try:
            await asyncio.wait_for(reader.readexactly(FULL_ECHO), CONNECT_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(
                f"{FULL_ECHO // 1024} KiB did not come back within {CONNECT_TIMEOUT_S:g}s "
                "where single bytes did: packets of the path's full size are lost"
            ) from None
        return statistics.median(rounds)
    finally:
        writer.close()


def _receive(sock: socket.socket, limit: float) -> bytes:
    """The receiving end of a throughput sample: count bytes until EOF (or ``limit``), timed
    from the end of the first read to the end of the last (the steady part, without set-up
    and the final round trip); the 16-byte answer. Closes ``sock``."""
    with sock:
        sock.settimeout(CONNECT_TIMEOUT_S)
        view = memoryview(bytearray(CHUNK))
        count, first, last = 0, 0, 0
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            n = sock.recv_into(view)
            if not n:
                break
            last = time.perf_counter_ns()
            if first:
                count += n
            else:
                first = last
    return count.to_bytes(8, "big") + (last - first).to_bytes(8, "big")


# Student's t at 97.5% for n - 1 degrees of freedom (n = 8 .. 16 windows): with so few
# windows 1.96 would claim 95% and give about 91%.
_T975 = {7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145,
         15: 2.131}  # fmt: skip


def steady(rates: list[float]) -> bool:
    """Whether a sample holds its rate well enough to end early: its last STEADY_WINDOWS
    window rates all within STEADY_SPREAD of their mean, or the mean of its last
    PRECISE_WINDOWS (8 at least) known to STEADY_PRECISION (a 95% t-interval) with no trend
    in them (their halves' means within STEADY_PRECISION of each other: a ramp or a drift
    is sampled on). The probe's answer is the receiver's count over the whole sample."""
    if len(rates) < STEADY_WINDOWS:
        return False
    last = rates[-STEADY_WINDOWS:]
    mean = sum(last) / len(last)
    if mean > 0 and all(abs(rate - mean) <= STEADY_SPREAD * mean for rate in last):
        return True
    if len(rates) < 2 * STEADY_WINDOWS:
        return False
    last = rates[-PRECISE_WINDOWS:]
    n = len(last)
    mean = sum(last) / n
    if mean <= 0:
        return False
    half = n // 2
    early, late = sum(last[:half]) / half, sum(last[n - half :]) / half
    if abs(late - early) > STEADY_PRECISION * mean:
        return False
    variance = sum((rate - mean) ** 2 for rate in last) / (n - 1)
    return _T975[n - 1] * math.sqrt(variance / n) <= STEADY_PRECISION * mean


def _send(sock: socket.socket, seconds: float, token: bytes) -> float:
    """The sending end, on the connected ``sock`` in a thread (see :func:`_receive`);
    closes it. Sends for at most ``seconds``, and stops sooner, after MIN_SAMPLE_S, once
    the rate is :func:`steady` (windows end on a block boundary, so a window's rate is exact
    at any link speed; the sender's rate is the receiver's once the socket buffers are
    full)."""
    with sock:
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.sendall(b"t" + token)
        block = memoryview(bytes(CHUNK))
        start = time.perf_counter()
        sent = 0
        window_start, window_bytes, rates = start, 0, []
        shortest = min(MIN_SAMPLE_S, seconds)
        while True:  # at least one block, however short the sample
            sock.sendall(block)
            sent += len(block)
            window_bytes += len(block)
            now = time.perf_counter()
            held = False
            if now - window_start >= WINDOW_S:
                rates.append(window_bytes / (now - window_start))
                window_start, window_bytes = now, 0
                held = now - start >= shortest and steady(rates)  # (once a window)
            if now - start >= seconds or held:
                break  # its time is up, or the rate holds: more would not change the answer
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(CONNECT_TIMEOUT_S + seconds)
        answer = b""
        while len(answer) < 16:
            more = sock.recv(16 - len(answer))
            if not more:
                raise asyncio.IncompleteReadError(answer, 16)
            answer += more
    count, nanos = int.from_bytes(answer[:8], "big"), int.from_bytes(answer[8:], "big")
    if count == 0 or nanos == 0:  # all of it in one read: the sender's clock, then
        elapsed = time.perf_counter() - start
        return round(sent * 8 / elapsed / 1e9, 4) if sent and elapsed > 0 else 0.0
    return round(count * 8 / nanos, 4)  # bits per nanosecond = Gbit/s


async def _throughput(address: str, port: int, seconds: float, token: bytes) -> float:
    sock = await _socket_to(address, port)
    try:
        return await asyncio.to_thread(_send, sock, seconds, token)
    except asyncio.CancelledError:
        _cut(sock)  # the thread wakes, and ends (it closes the socket)
        raise


async def probe_peers(
    peers: list[tuple[int, str, int]],
    seconds: float,
    timeout: float,
    token: bytes = b"",
    window: float = 0.0,
    via: tuple[str, int] | None = None,
) -> list[PairResult]:
    """Measure each (node, address, port) in turn, within ``timeout`` in all (``window``: see
    :func:`measure`; ``via``: through that SOCKS5 endpoint, the relayed path's)."""
    _VIA.set(via)
    results: list[PairResult] = []

    async def run() -> None:
        for node, address, port in peers:
            results.append(await measure(node, address, port, seconds, token, window))

    try:
        await asyncio.wait_for(run(), timeout)
    except TimeoutError:
        done = {r.node for r in results}
        results.extend(
            PairResult(node, 0, error=f"the probe did not finish within {timeout:.0f}s")
            for node, _a, _p in peers
            if node not in done
        )
    return results


def route_of(address: str) -> str | None:
    """The interface the kernel sends ``address``'s traffic by (``ip route get``), or None
    when it cannot tell (no ``ip``, no route)."""
    try:
        done = subprocess.run(
            ["ip", "-o", "route", "get", address], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"\bdev (\S+)", done.stdout)
    return found.group(1) if done.returncode == 0 and found else None
