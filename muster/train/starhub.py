"""The star reduce's hubs: a host's fold and the cohort's root (seed 002, views 2-4 and 7).

One ``Hub`` class plays both tiers. Each collects one contribution per live child for every
reduce operation (``op``) of the cohort, in order:

- a contribution is a START frame (what, element count, mass, the ranks it speaks for) and
  the CHUNK frames of its pre-scaled values; a zero-mass one is declared (START alone);
- chunks are added into one float accumulator as they arrive (f64 for the count gather, f32
  otherwise, whatever the wire carries), so a hub holds O(model) bytes, never one copy per
  child;
- a **fold** (parent set) sums its local ranks and never divides: once every live child is in
  it sends one host frame up (the summed values, the summed mass, the union of the ranks) and
  fans the root's answer back out, so K local ranks cost the host's uplink 1x the model's
  bytes per direction;
- the **root** (no parent) divides once, on its own reduce thread, by the accepted mass (the
  mass of exactly the contributions it summed; the count gather is a plain sum), or answers
  "not realized" when that mass is 0 (every rank keeps its local state).

Every wait has a ceiling:
- rendezvous: ``idle_s`` (120 s) without a new child, with some still missing, aborts the
  cohort; ``max_rejected`` (1,024) connections refused before their handshake closes the
  listener and aborts it too;
- heartbeats: a child or parent silent past ``timeout_s`` is declared dead (its ranks leave
  every later op's sum and divisor; the root tells every rank); a closed link is a death
  at once;
- the root's reduce stall: an op with a contribution in, ranks missing but alive, past
  ``stall_s`` (10x the heartbeat timeout, at least 300 s), ends the cohort with SHUTDOWN
  {reason}: every rank saves and stops.
The root's reduce thread is the coordinator's state machine: Idle (no contribution of the
current op yet) -> Pending (one in; waiting for the live rest) -> Idle (answered, or the
stall ceiling). It never runs on a rank's training thread.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from muster.train.starwire import (
    DOWN,
    UP,
    Codec,
    Frame,
    Kind,
    StarClosed,
    StarRefused,
    client_handshake,
    serve_handshake,
)

log = logging.getLogger("muster.train.star")

WIRE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f64": torch.float64}
CHUNK_ELEMS = 1 << 20  # values per CHUNK (4 MiB of f32): the unit the reduce streams in


def chunk_count(n: int) -> int:
    return max(1, -(-n // CHUNK_ELEMS))


HANDSHAKE_S = 10.0
LOCAL = "local"  # a Hub's ``bind`` for a fold: a Unix socket in a private directory
_SUN_PATH_MAX = 107  # a Unix socket's path, without its NUL
MAX_ADMITTING = 64  # handshakes in progress at once; more connections are refused at once
LEFT = "it left (its ElChe closed)"


@dataclass(frozen=True)
class Ceilings:
    """The star's bounds (seconds), the same on every rank."""

    heartbeat_s: float = 5.0  # how often a link says it is alive
    timeout_s: float = 30.0  # a link silent this long is dead
    stall_s: float | None = None  # a pending op with every missing rank alive; None: 10x, >=300
    idle_s: float = 120.0  # rendezvous: no new rank for this long aborts the cohort
    max_rejected: int = 1024  # connections refused before their handshake abort the listener

    @property
    def stall(self) -> float:
        return self.stall_s if self.stall_s is not None else max(10 * self.timeout_s, 300.0)


def send_values(
    codec: Codec,
    lock: threading.Lock,
    op: int,
    mass: float,
    meta: dict[str, Any],
    values: torch.Tensor | None,
    wire: str,
    scale: float = 1.0,
) -> None:
    """A START and, unless ``values`` is None (declared), the CHUNKs of ``values * scale``
    converted to ``wire`` chunk by chunk (the pre-scale is fused into the encode). The send
    lock is let go between chunks so heartbeats get through."""
    dtype = WIRE_DTYPES[wire]
    meta = dict(meta, wire=wire, declared=values is None)
    with lock:
        codec.send(Kind.START, op=op, mass=mass, meta=meta)
    if values is None:
        return
    for start in range(0, values.numel(), CHUNK_ELEMS):
        part = values[start : start + CHUNK_ELEMS]
        if scale != 1.0:
            part = part.to(torch.float32) * scale  # (one rounding to the wire, not two)
        if part.dtype != dtype:
            part = part.to(dtype)
        raw = part.contiguous().view(torch.uint8).numpy()
        with lock:
            codec.send(Kind.CHUNK, op=op, offset=start, body=memoryview(raw.data))


def read_values(
    codec: Codec,
    start: Frame,
    into: Callable[[int, torch.Tensor], None],
    on_other: Callable[[Frame], None],
    target: torch.Tensor | None = None,
) -> bool:
    """Read the CHUNKs announced by ``start`` and hand each to ``into(offset, values)``;
    heartbeats and other frames between them go to ``on_other``. With ``target`` (of the
    wire's dtype), chunks land in it directly, no copy (checked before ``into`` sees them;
    a forged one leaves garbage there, and the op fails). False: the sender aborted the op
    midway (ABORT: a contribution below it was cut off)."""
    if start.meta.get("declared"):
        return True
    n = int(start.meta["n"])
    dtype = WIRE_DTYPES[str(start.meta["wire"])]
    direct = target is not None and target.dtype == dtype and target.numel() == n
    size = torch.empty((), dtype=dtype).element_size()

    def place(kind: Kind, offset: int, length: int) -> memoryview | None:
        if not direct or kind is not Kind.CHUNK or offset < 0 or length % size:
            return None
        if offset + length // size > n:
            return None
        assert target is not None
        return memoryview(target[offset : offset + length // size].view(torch.uint8).numpy().data)

    got = 0
    while got < n:
        frame = codec.read(place=place)
        if frame.kind is Kind.ABORT and frame.op == start.op:
            return False
        if frame.kind is not Kind.CHUNK:
            on_other(frame)
            continue
        if frame.op != start.op or frame.offset != got:
            raise StarRefused(f"CHUNK for op {frame.op} at {frame.offset}, expected {got}")
        values = torch.frombuffer(frame.body, dtype=dtype) if len(frame.body) else None
        if values is None or got + values.numel() > n:
            raise StarRefused("a CHUNK past the announced size")
        into(got, values)
        got += values.numel()
    return True


# An in-process child's receiver: (kind, op, mass, meta, values or None), called by the hub.
Deliver = Callable[[Kind, int, float, dict[str, Any], "torch.Tensor | None"], None]


@dataclass
class _Child:
    codec: Codec | None  # None: in this process (``local`` receives)
    ranks: frozenset[int]
    local: Deliver | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True


@dataclass
class _Op:
    number: int = 0
    what: str | None = None
    n: int = 0
    acc: torch.Tensor | None = None
    mass: float = 0.0
    ranks: set[int] = field(default_factory=set)
    since: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    tainted: bool = False  # a child died mid-contribution: its partial chunks are in the sum
    started: set[int] = field(default_factory=set)  # children (by id) whose START is in
    valued: set[int] = field(default_factory=set)  # ... and that send values (not declared)
    done: set[int] = field(default_factory=set)  # ... whose contribution is all read
    chunks: list[int] = field(default_factory=list)  # contributions in, per chunk
    claimed: list[int] = field(default_factory=list)  # ... or being summed in


class Hub:
    """A fold (``parent`` set: a host's local ranks) or the root (all hosts)."""

    def __init__(
        self,
        *,
        name: str,
        salt: bytes,
        ranks: set[int],
        bind: str,
        ceilings: Ceilings,
        wire: str = "f32",
        parent: tuple[str, int] | Hub | None = None,
        groups: list[list[int]] | None = None,
    ) -> None:
        self.name = name
        self.salt = salt
        self.ranks = frozenset(ranks)
        # Who may join as one child: a fold's single ranks, or (the root) whole host groups
        # as the cohort formed them; None: any set of this hub's ranks (tests, benchmarks).
        self.groups = {frozenset(g) for g in groups} if groups is not None else None
        self.ceilings = ceilings
        self.wire = wire
        self.parent_address = parent
        self.cv = threading.Condition()
        self._chunk_locks = [threading.Lock() for _ in range(16)]  # by chunk index
        self._accs: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.children: list[_Child] = []
        self.joined: set[int] = set()
        self.dead: dict[int, str] = {}  # rank -> why
        self.op = _Op()
        self.finishing = False
        self.failure: str | None = None  # the cohort is over: the reason
        self.shutdown_sent = False
        self.rejected = 0
        self.closed = False
        self.parent: Codec | None = None
        self.parent_local: Hub | None = None  # the root, when this process hosts it too
        self.parent_child: _Child | None = None  # this fold, as the local root's child
        self.parent_lock = threading.Lock()
        self.parent_seen = time.monotonic()
        self.down: list[_Child] = []  # the children the current answer goes to
        self.down_done = threading.Event()
        self.uplink_sent = 0  # bytes this fold sent its parent (the benchmark reads it)
        self._private_dir: str | None = None
        self.address: tuple[str, int] | str
        if bind == LOCAL:  # (a fold: its host's ranks come over a Unix socket: see starwire)
            self._private_dir = tempfile.mkdtemp(prefix="muster-star-")  # (0700)
            path = os.path.join(self._private_dir, "fold.sock")
            if len(path.encode()) > _SUN_PATH_MAX:  # (a long TMPDIR: loopback TCP, tagged)
                os.rmdir(self._private_dir)
                self._private_dir, bind = None, "127.0.0.1"
        if self._private_dir is not None:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(path)
            self.listener.listen(128)
            self.address = self.listener.getsockname()
        else:
            self.listener = socket.create_server((bind, 0), backlog=128)
            self.address = self.listener.getsockname()[:2]
        self._last_join = time.monotonic()
        self._admitting = 0
        self._threads: list[threading.Thread] = []
        if isinstance(parent, Hub):
            self.parent_local = parent
            self.parent_child = parent.attach(set(self.ranks), self._from_local_parent)
        self._spawn(self._accept, "accept")
        self._spawn(self._reduce_loop, "reduce")
        self._spawn(self._watch, "watch")

    @property
    def is_root(self) -> bool:
        return self.parent is None and self.parent_local is None

    # -- plumbing --------------------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], what: str, *args: Any) -> None:
        thread = threading.Thread(
            target=self._guard, args=(target, what, *args), name=f"star-{self.name}-{what}",
            daemon=True,
        )  # fmt: skip
        self._threads.append(thread)
        thread.start()

    def _guard(self, target: Callable[..., None], what: str, *args: Any) -> None:
        try:
            target(*args)
        except Exception as exc:  # a hub thread never dies silently
            if not self.closed:
                log.exception("star %s: the %s thread failed", self.name, what)
                self.fail(f"the {self.name} hub's {what} thread failed: {exc}")

    def fail(self, reason: str) -> None:
        """End the cohort: every rank below is told SHUTDOWN {reason} and saves (a fold tells
        the root too, which tells every other host)."""
        with self.cv:
            if self.failure is None:
                self.failure = reason
            self.cv.notify_all()
        self._tell_parent(Kind.SHUTDOWN, {"reason": reason})
        self._broadcast_shutdown(reason)

    def _tell(self, child: _Child, kind: Kind, meta: dict[str, Any]) -> None:
        """A small frame (DEAD, SHUTDOWN, HEARTBEAT) to one child; a broken link is not an
        error here (its reader declares it)."""
        if child.local is not None:
            child.local(kind, 0, 0.0, meta, None)
            return
        assert child.codec is not None
        with contextlib.suppress(OSError, StarRefused), child.lock:
            child.codec.send(kind, meta=meta)

    def _tell_parent(self, kind: Kind, meta: dict[str, Any]) -> None:
        if self.parent_local is not None:
            if kind is Kind.DEAD:
                self.parent_local._mark_dead(set(meta["ranks"]), str(meta["reason"]))
            elif kind is Kind.SHUTDOWN:
                self.parent_local.fail(str(meta["reason"]))
            return
        if self.parent is not None:
            with contextlib.suppress(OSError), self.parent_lock:
                self.parent.send(kind, meta=meta)

    def _broadcast_shutdown(self, reason: str) -> None:
        with self.cv:
            if self.shutdown_sent:
                return
            self.shutdown_sent = True
            children = [c for c in self.children if c.alive]
        for child in children:
            self._tell(child, Kind.SHUTDOWN, {"reason": reason})

    def _stop_listening(self) -> None:
        # (shutdown first: on Linux a close from another thread leaves a blocked accept, and
        # with it the listening socket, alive)
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.listener.close()
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)

    def drain(self, timeout: float) -> None:
        """Close once every child has left or died (at most ``timeout`` s): a rank that hosts
        a hub and ends its loop first must not cut its peers off their last results. Then
        leave the parent, and close."""
        deadline = time.monotonic() + timeout
        with self.cv:
            while (
                any(c.alive for c in self.children)
                and not self.closed
                and time.monotonic() < deadline
            ):
                self.cv.wait(0.2)
        if self.parent_local is not None and self.parent_child is not None:
            self.parent_local.leave(self.parent_child)
        elif self.parent is not None:
            with contextlib.suppress(OSError), self.parent_lock:
                self.parent.send(Kind.BYE)
        self.close()

    def close(self) -> None:
        self.closed = True
        with self.cv:
            self.cv.notify_all()
        self._stop_listening()
        for child in self.children:
            if child.codec is not None:
                child.codec.cut()
        if self.parent is not None:
            self.parent.cut()

    # -- rendezvous ------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._admit, args=(sock,), name=f"star-{self.name}-admit", daemon=True
            ).start()

    def _admit(self, sock: socket.socket) -> None:
        if sock.family == socket.AF_UNIX:
            uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))[1]  # fmt: skip
            if uid != os.getuid():  # (the directory is 0700 already: this is the second lock)
                self._refused(sock, StarRefused(f"a local link from uid {uid}"))
                return
        else:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        codec = Codec(sock, send_dir=DOWN, recv_dir=UP)
        with self.cv:
            crowded = self._admitting >= MAX_ADMITTING
            if not crowded:
                self._admitting += 1
        if crowded:  # (a flood of connections gets no thread and no buffer each)
            self._refused(sock, StarRefused("too many handshakes at once"))
            return
        # The whole handshake has one deadline (not one per read: a byte every few seconds
        # would otherwise hold a connection for ever).
        sock.settimeout(HANDSHAKE_S)
        deadline = threading.Timer(HANDSHAKE_S, codec.cut)
        deadline.daemon = True
        deadline.start()

        def admit(asked: list[int]) -> None:
            wanted = frozenset(asked)
            with self.cv:
                if not wanted or not wanted <= self.ranks or wanted & self.joined:
                    raise StarRefused(f"ranks {sorted(wanted)} are not this hub's to join")
                if self.groups is not None and wanted not in self.groups:
                    raise StarRefused(
                        f"ranks {sorted(wanted)} are not one of the groups that may join "
                        f"({sorted(sorted(g) for g in self.groups)})"
                    )

        try:
            ranks = frozenset(serve_handshake(codec, self.salt, admit))
            with self.cv:
                if ranks & self.joined:
                    raise StarRefused(f"ranks {sorted(ranks)} joined already")
                sock.settimeout(self.ceilings.timeout_s)  # (sends and reads: bounded too)
                child = _Child(codec, ranks)
                self.children.append(child)
                self.joined |= ranks
                self._last_join = time.monotonic()
                self.cv.notify_all()
        except (StarRefused, StarClosed, OSError, ValueError) as exc:
            self._refused(sock, exc)
            return
        finally:
            deadline.cancel()
            with self.cv:
                self._admitting -= 1
        self._spawn(self._read_child, f"child{min(ranks)}", child)

    def _refused(self, sock: socket.socket, exc: Exception) -> None:
        with self.cv:  # (counted before the close the peer sees)
            self.rejected += 1
            rejected = self.rejected
        with contextlib.suppress(OSError):
            sock.close()
        if rejected in (1, 10, 100, 1000):
            log.warning("star %s: refused a connection (%d so far): %s", self.name, rejected, exc)
        if rejected >= self.ceilings.max_rejected:
            self._stop_listening()
            self.fail(
                f"the star's {self.name} listener refused {rejected} connections before "
                "their handshake (another run's ranks, or someone probing the port): "
                "the cohort is aborted"
            )

    def wait_joined(self) -> None:
        """Until every rank of this hub has joined; raises CohortLost-worthy StarClosed when
        none joined for ``idle_s`` while some are missing, or the hub failed."""
        with self.cv:
            while self.joined != self.ranks:
                if self.failure is not None:
                    raise StarClosed(self.failure)
                idle = time.monotonic() - self._last_join
                if idle >= self.ceilings.idle_s:
                    missing = sorted(self.ranks - self.joined)
                    reason = (
                        f"the star's rendezvous ({self.name}) waited {idle:.0f} s with no new "
                        f"rank; ranks {missing} never joined (did they start? can they reach "
                        f"{self.address[0]}:{self.address[1]}?)"
                    )
                    self.failure = reason
                    raise StarClosed(reason)
                self.cv.wait(min(1.0, self.ceilings.idle_s - idle))
        self._stop_listening()  # the world is formed: no one else may join

    def connect_parent(self, host: str, port: int) -> None:
        """A fold dials the root, speaking for its host's ranks."""
        sock = socket.create_connection((host, port), timeout=HANDSHAKE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        codec = Codec(sock, send_dir=UP, recv_dir=DOWN)
        client_handshake(codec, self.salt, sorted(self.ranks))
        sock.settimeout(self.ceilings.timeout_s)
        self.parent = codec
        self.parent_seen = time.monotonic()
        self._spawn(self._read_parent, "parent")

    # -- children --------------------------------------------------------------------------

    def _read_child(self, child: _Child) -> None:
        assert child.codec is not None
        try:
            while not self.closed:
                frame = child.codec.read()
                self._from_child(child, frame)
        except (StarRefused, StarClosed, OSError, KeyError, TypeError, ValueError) as exc:
            if self.closed:
                return
            if isinstance(exc, TimeoutError):  # (the link's own read deadline)
                self.declare_dead(
                    child, f"silent for {self.ceilings.timeout_s:.0f} s (heartbeat timeout)"
                )
                return
            why = "left" if isinstance(exc, StarClosed) else f"sent a bad frame ({exc!r})"
            self.declare_dead(child, f"its link to the {self.name} hub closed ({why})")

    def _seen(self, child: _Child, frame: Frame) -> None:
        child.last_seen = time.monotonic()
        if frame.kind is Kind.HEARTBEAT:
            return
        if frame.kind is Kind.DEAD:  # (from a fold: ranks of its host)
            ranks = {int(r) for r in frame.meta.get("ranks", [])} & child.ranks
            self._mark_dead(ranks, str(frame.meta.get("reason", "declared dead")))
        elif frame.kind is Kind.BYE:
            self.declare_dead(child, LEFT)
        elif frame.kind is Kind.SHUTDOWN:  # (a fold whose ranks asked for it)
            self.fail(str(frame.meta.get("reason", "a rank asked the cohort to stop")))
        else:
            raise StarRefused(f"unexpected {frame.kind.name} between contributions")

    def _from_child(self, child: _Child, frame: Frame) -> None:
        if not child.alive:  # (declared dead: nothing more of it is summed)
            raise StarClosed("declared dead")
        child.last_seen = time.monotonic()
        if frame.kind is not Kind.START:
            self._seen(child, frame)
            return
        assert child.codec is not None
        codec = child.codec
        declared = bool(frame.meta.get("declared"))
        op = self._begin(child, frame.op, frame.mass, frame.meta, declared)
        if op is None or declared:
            return
        try:
            complete = read_values(
                codec, frame, lambda offset, values: self._chunk(op, offset, values),
                lambda f: self._seen(child, f),
            )  # fmt: skip
        except BaseException:
            self._abort(op, child)  # part of it is in the sum: this op realizes nothing
            raise
        if complete:
            self._end(op, child)
        else:
            self._abort(op, child)

    def _turn(
        self, child: _Child, number: int, meta: dict[str, Any], ranks: set[int]
    ) -> _Op | None:
        """(Under the lock) Wait until op ``number`` is the one collected (a contribution to
        the next one waits while this one is answered); None when the cohort is over."""
        what, n = str(meta.get("what")), int(meta.get("n", -1))
        while self.op.number != number or self.finishing:
            if self.closed or self.failure is not None:
                return None
            if number < self.op.number:
                raise StarRefused(f"a contribution to op {number}, already answered")
            child.last_seen = time.monotonic()  # (alive: its frames wait for their turn)
            self.cv.wait(1.0)
        op = self.op
        if op.what is None:
            op.what, op.n, op.since = what, n, time.monotonic()
        elif (op.what, op.n) != (what, n):
            reason = (
                f"the cohort diverged at op {number}: ranks {sorted(ranks)} sent "
                f"{what} of {n} values where ranks {sorted(op.ranks)} sent {op.what} of "
                f"{op.n} (every rank must run the same loop on the same model)"
            )
            threading.Thread(target=self.fail, args=(reason,), daemon=True).start()
            return None
        return op

    def _begin(
        self, child: _Child, number: int, mass: float, meta: dict[str, Any], declared: bool
    ) -> _Op | None:
        """A contribution starts: its mass and ranks count now (its values follow, chunk by
        chunk); None when the cohort is over."""
        ranks = {int(r) for r in meta.get("ranks", sorted(child.ranks))} & child.ranks
        with self.cv:
            op = self._turn(child, number, meta, ranks)
            if op is None:
                return None
            if not math.isfinite(mass) or mass < 0:
                reason = f"ranks {sorted(ranks)} sent a mass of {mass}"
                threading.Thread(target=self.fail, args=(reason,), daemon=True).start()
                return None
            if id(child) in op.started:
                raise StarRefused(f"a second contribution to op {number} from the same link")
            op.started.add(id(child))
            op.mass += mass
            op.ranks |= ranks
            op.tainted |= bool(meta.get("tainted"))
            if declared:
                op.done.add(id(child))
            else:
                op.valued.add(id(child))
                if op.acc is None:
                    op.acc = self._accumulator(op.n, str(op.what))
                    op.chunks = [0] * chunk_count(op.n)
                    op.claimed = [0] * chunk_count(op.n)
            self.cv.notify_all()
            return op

    def _sum_into(self, op: _Op, offset: int, values: torch.Tensor, scale: float = 1.0) -> None:
        """Add a chunk into the accumulator; the chunk's first values are copied instead (so
        the accumulator is never zeroed: every chunk gets every valued contribution)."""
        assert op.acc is not None
        spot = op.acc[offset : offset + values.numel()]
        index = offset // CHUNK_ELEMS
        with self._chunk_locks[index % len(self._chunk_locks)]:  # (other chunks in parallel)
            first = not op.claimed[index]
            op.claimed[index] += 1
            if first:
                torch.mul(values, scale, out=spot) if scale != 1.0 else spot.copy_(values)
            else:
                spot.add_(values, alpha=scale)

    def _chunk(self, op: _Op, offset: int, values: torch.Tensor) -> None:
        self._sum_into(op, offset, values)
        with self.cv:
            op.chunks[offset // CHUNK_ELEMS] += 1
            self.cv.notify_all()

    def _end(self, op: _Op, child: _Child) -> None:
        with self.cv:
            op.done.add(id(child))
            self.cv.notify_all()

    def _abort(self, op: _Op, child: _Child) -> None:
        with self.cv:
            op.tainted = True
            op.done.add(id(child))
            self.cv.notify_all()

    def _accumulator(self, n: int, what: str) -> torch.Tensor:
        """An accumulator of ``n`` values, reused from op to op (one per size: the
        parameters', the buffers', the count's), so a hub holds O(model) bytes. Not zeroed:
        each chunk's first contribution is copied in."""
        dtype = torch.float64 if what == "count" else torch.float32
        acc = self._accs.get((n, dtype))
        if acc is None:
            acc = self._accs[(n, dtype)] = torch.empty(n, dtype=dtype)
        return acc

    # -- children in this process ------------------------------------------------------------

    def attach(self, ranks: set[int], deliver: Deliver) -> _Child:
        """A child in this process (the fold's own rank, the root's own host's fold): no
        socket, no MAC; ``deliver`` receives what a link would."""
        child = _Child(None, frozenset(ranks), local=deliver)
        with self.cv:
            if not child.ranks <= self.ranks or child.ranks & self.joined:
                raise StarRefused(f"ranks {sorted(ranks)} are not this hub's to join")
            self.children.append(child)
            self.joined |= child.ranks
            self._last_join = time.monotonic()
            self.cv.notify_all()
        return child

    def contribute(
        self,
        child: _Child,
        number: int,
        mass: float,
        meta: dict[str, Any],
        values: torch.Tensor | None,
        scale: float = 1.0,
    ) -> None:
        """An in-process child's whole contribution (``values * scale``; None: declared),
        summed chunk by chunk on the caller's thread so the answer can stream as it goes."""
        op = self._begin(child, number, mass, meta, values is None)
        if op is None or values is None:
            return
        flat = values.reshape(-1)
        for lo in range(0, op.n, CHUNK_ELEMS):
            part = flat[lo : lo + CHUNK_ELEMS]
            self._sum_into(op, lo, part, scale)
            with self.cv:
                op.chunks[lo // CHUNK_ELEMS] += 1
                self.cv.notify_all()
        self._end(op, child)

    def leave(self, child: _Child) -> None:
        self.declare_dead(child, LEFT)

    def declare_dead(self, child: _Child, why: str) -> None:
        with self.cv:
            if not child.alive:
                return
            child.alive = False
            op = self.op
            if id(child) in op.valued and id(child) not in op.done:
                op.tainted = True  # (part of its values may be in the sum: void this op)
            # (the reason is on record before the op it frees can answer anyone)
            fresh = self._record_dead(set(child.ranks), why)
            self.cv.notify_all()
        if child.codec is not None:
            child.codec.cut()
        self._announce_dead(fresh, why)

    def _record_dead(self, ranks: set[int], why: str) -> set[int]:
        """Under ``cv``: the ranks newly dead, their reason recorded."""
        fresh = ranks - set(self.dead)
        for rank in fresh:
            self.dead[rank] = why
        return fresh

    def _mark_dead(self, ranks: set[int], why: str) -> None:
        with self.cv:
            fresh = self._record_dead(ranks, why)
            self.cv.notify_all()
        self._announce_dead(fresh, why)

    def _announce_dead(self, fresh: set[int], why: str) -> None:
        if not fresh:
            return
        level = logging.INFO if why.startswith(LEFT) else logging.WARNING
        log.log(level, "star %s: ranks %s declared dead: %s", self.name, sorted(fresh), why)
        meta = {"ranks": sorted(fresh), "reason": why}
        self._tell_parent(Kind.DEAD, meta)
        for child in [c for c in self.children if c.alive]:
            self._tell(child, Kind.DEAD, meta)

    # -- the parent (folds) ----------------------------------------------------------------

    def _read_parent(self) -> None:
        assert self.parent is not None
        try:
            while not self.closed:
                frame = self.parent.read()
                self.parent_seen = time.monotonic()
                if frame.kind is Kind.START:
                    self._result_from_parent(frame)
                else:
                    self._parent_said(frame)
        except (StarRefused, StarClosed, OSError) as exc:
            if not self.closed:
                self.fail(f"the link to the star's root broke ({exc}): the root's rank died?")

    def _parent_said(self, frame: Frame) -> None:
        """The root's frames other than results (they may come between a result's chunks)."""
        if frame.kind is Kind.DEAD:
            self._mark_dead({int(r) for r in frame.meta.get("ranks", [])},
                            str(frame.meta.get("reason", "declared dead")))  # fmt: skip
        elif frame.kind is Kind.SHUTDOWN:
            self.fail(str(frame.meta.get("reason", "the root stopped the cohort")))
        elif frame.kind is not Kind.HEARTBEAT:
            raise StarRefused(f"unexpected {frame.kind.name} from the root")

    def _result_from_parent(self, frame: Frame) -> None:
        """The root's answer, passed down chunk by chunk as it arrives."""
        assert self.parent is not None
        if frame.op != self.op.number:
            raise StarRefused(f"a result for op {frame.op} while op {self.op.number} is pending")
        meta = {k: v for k, v in frame.meta.items() if k not in ("wire", "declared")}
        declared = bool(frame.meta.get("declared"))
        self._down_start(frame.op, frame.mass, meta, declared)
        complete = declared or read_values(
            self.parent, frame, lambda lo, values: self._down_chunk(frame.op, lo, values),
            self._parent_said,
        )  # fmt: skip
        self._down_end(frame.op, aborted=not complete)

    def _from_local_parent(
        self, kind: Kind, number: int, mass: float, meta: dict[str, Any], values: Any
    ) -> None:
        """What the root in this process tells its local fold (on the root's threads)."""
        if kind is Kind.DEAD:
            self._mark_dead({int(r) for r in meta["ranks"]}, str(meta["reason"]))
        elif kind is Kind.SHUTDOWN:
            self.fail(str(meta["reason"]))
        elif kind is Kind.START:
            self._down_start(number, mass, meta, bool(meta.get("declared")))
        elif kind is Kind.CHUNK:
            self._down_chunk(number, int(meta["offset"]), values)
        elif kind in (Kind.END, Kind.ABORT):
            self._down_end(number, aborted=kind is Kind.ABORT)

    # -- the answer, down to the children -------------------------------------------------

    def _down_start(self, number: int, mass: float, meta: dict[str, Any], declared: bool) -> None:
        with self.cv:
            self.down = [c for c in self.children if c.alive]
        wire = "f64" if meta.get("what") == "count" else self.wire
        for child in self.down:
            if child.local is not None:
                child.local(Kind.START, number, mass, dict(meta, declared=declared), None)
                continue
            full = dict(meta, wire=wire, declared=declared)
            self._send_down(child, Kind.START, number, mass, full)

    def _down_chunk(self, number: int, offset: int, values: torch.Tensor) -> None:
        wire = WIRE_DTYPES["f64" if values.dtype == torch.float64 else self.wire]
        raw = None
        for child in self.down:
            if child.local is not None:
                child.local(Kind.CHUNK, number, 0.0, {"offset": offset}, values)
                continue
            if raw is None:  # (converted once, tagged per link)
                part = values if values.dtype == wire else values.to(wire)
                raw = memoryview(part.contiguous().view(torch.uint8).numpy().data)
            self._send_down(child, Kind.CHUNK, number, 0.0, None, offset, raw)

    def _down_end(self, number: int, *, aborted: bool) -> None:
        for child in self.down:
            if child.local is not None:
                child.local(Kind.ABORT if aborted else Kind.END, number, 0.0, {}, None)
            elif aborted:
                self._send_down(child, Kind.ABORT, number, 0.0, {})
        self.down = []
        self.down_done.set()

    def _send_down(
        self,
        child: _Child,
        kind: Kind,
        number: int,
        mass: float,
        meta: dict[str, Any] | None,
        offset: int = 0,
        body: memoryview | bytes = b"",
    ) -> None:
        assert child.codec is not None
        if not child.alive:
            return
        try:
            with child.lock:
                child.codec.send(kind, op=number, mass=mass, offset=offset, meta=meta, body=body)
        except OSError as exc:
            self.declare_dead(child, f"the {self.name} hub could not send to it ({exc})")

    # -- the reduce ------------------------------------------------------------------------

    def _started(self) -> bool:
        """(Under the lock) Every live child has started its contribution to the op."""
        op = self.op  # (by rank: a child that has not joined yet is waited for too)
        return op.what is not None and (self.ranks - set(self.dead)) <= op.ranks

    def _reduce_loop(self) -> None:
        while not self.closed:
            with self.cv:
                while not self.closed and self.failure is None and not self._started():
                    self._stall_check()
                    self.cv.wait(0.5)
                if self.closed or self.failure is not None:
                    return
                self.finishing = True
                op = self.op
            self.down_done.clear()
            if self.is_root:
                self._answer(op)
            else:
                self._up(op)
            while not self.down_done.wait(0.5):
                if self.closed or self.failure is not None:
                    return
            with self.cv:  # (every contribution read off its link before the next op)
                while not self.closed and self.failure is None and not self._all_read(op):
                    self.cv.wait(0.5)
                self.op = _Op(number=op.number + 1)
                self.finishing = False
                self.cv.notify_all()

    def _all_read(self, op: _Op) -> bool:
        live = {id(c) for c in self.children if c.alive}
        return (op.valued & live) <= op.done

    def _ready(self, op: _Op, index: int) -> bool:
        """Wait until chunk ``index`` holds every live contribution; False when the op is
        tainted (or the cohort over) instead."""
        with self.cv:
            while True:
                if op.tainted or self.closed or self.failure is not None:
                    return False
                if op.chunks[index] >= len(op.valued):
                    return True
                self.cv.wait(0.5)

    def _answer(self, op: _Op) -> None:
        """The root: the one divide, chunk by chunk as each is complete, streamed down."""
        if op.tainted:
            log.warning("star root: op %d lost a contribution midway: not realized", op.number)
        if op.what == "count":
            realized = not op.tainted and op.acc is not None
        else:
            realized = (
                not op.tainted and bool(op.valued) and math.isfinite(op.mass) and op.mass > 0.0
            )
        meta = {"what": op.what, "n": op.n, "ranks": sorted(op.ranks), "realized": realized}
        self._down_start(op.number, op.mass, meta, declared=not realized)
        if not realized:
            self._down_end(op.number, aborted=False)
            return
        assert op.acc is not None
        for index, lo in enumerate(range(0, op.n, CHUNK_ELEMS)):
            if not self._ready(op, index):
                self._down_end(op.number, aborted=True)
                return
            part = op.acc[lo : lo + CHUNK_ELEMS]
            if op.what != "count":
                part.mul_(1.0 / op.mass)
                if self.wire == "bf16":  # (rounded once, here: every rank gets the same)
                    part.copy_(part.to(torch.bfloat16))
            self._down_chunk(op.number, lo, part)
        self._down_end(op.number, aborted=False)

    def _up(self, op: _Op) -> None:
        """A fold: one host frame up (the summed mass and ranks first, then each chunk once
        all its local contributions are in); the answer comes down on the parent's thread."""
        declared = op.tainted or not op.valued
        meta: dict[str, Any] = {"what": op.what, "n": op.n, "ranks": sorted(op.ranks)}
        if op.tainted:
            meta["tainted"] = True
        wire = "f64" if op.what == "count" else self.wire
        local = self.parent_local
        if local is not None:
            assert self.parent_child is not None
            child = self.parent_child
            theirs = local._begin(child, op.number, op.mass, meta, declared)
            if theirs is None or declared:
                return
            for index, lo in enumerate(range(0, op.n, CHUNK_ELEMS)):
                if not self._ready(op, index):
                    local._abort(theirs, child)
                    return
                assert op.acc is not None
                local._chunk(theirs, lo, op.acc[lo : lo + CHUNK_ELEMS])
            local._end(theirs, child)
            return
        assert self.parent is not None
        before = self.parent.bytes_sent
        try:
            with self.parent_lock:
                self.parent.send(Kind.START, op=op.number, mass=op.mass,
                                 meta=dict(meta, wire=wire, declared=declared))  # fmt: skip
            if not declared:
                dtype = WIRE_DTYPES[wire]
                for index, lo in enumerate(range(0, op.n, CHUNK_ELEMS)):
                    if not self._ready(op, index):
                        with self.parent_lock:
                            self.parent.send(Kind.ABORT, op=op.number)
                        break
                    assert op.acc is not None
                    part = op.acc[lo : lo + CHUNK_ELEMS]
                    if part.dtype != dtype:
                        part = part.to(dtype)
                    raw = memoryview(part.contiguous().view(torch.uint8).numpy().data)
                    with self.parent_lock:
                        self.parent.send(Kind.CHUNK, op=op.number, offset=lo, body=raw)
        except OSError as exc:
            self.fail(f"the link to the star's root broke while sending ({exc})")
        self.uplink_sent += self.parent.bytes_sent - before

    def _stall_check(self) -> None:
        """(Under the lock) Pending past the ceiling with the missing ranks alive: at a fold,
        local ranks; at the root, hosts. Either tier stops the whole cohort."""
        op = self.op
        if op.since is None:
            return
        waited = time.monotonic() - op.since
        if waited < self.ceilings.stall:
            return
        missing = sorted(self.ranks - set(self.dead) - op.ranks)
        reason = (
            f"the reduce stalled: op {op.number} ({op.what}) waited {waited:.0f} s for ranks "
            f"{missing}, alive but not contributing (a rank wedged outside its loop?)"
        )
        threading.Thread(target=self.fail, args=(reason,), daemon=True).start()
        op.since = None  # (told once)

    # -- heartbeats ------------------------------------------------------------------------

    def _watch(self) -> None:
        beat = self.ceilings.heartbeat_s
        while not self.closed:
            time.sleep(beat)
            now = time.monotonic()
            for child in [c for c in self.children if c.alive and c.codec is not None]:
                assert child.codec is not None
                seen = max(child.last_seen, child.codec.last_read)  # (chunks count too)
                if now - seen > self.ceilings.timeout_s:
                    self.declare_dead(child, f"silent for {now - seen:.0f} s (heartbeat timeout)")
                    continue
                self._tell(child, Kind.HEARTBEAT, {})
            if self.parent is not None and self.failure is None:
                seen = max(self.parent_seen, self.parent.last_read)
                if now - seen > self.ceilings.timeout_s:
                    self.fail(f"the star's root has been silent for {now - seen:.0f} s")
                    continue
                with contextlib.suppress(OSError), self.parent_lock:
                    self.parent.send(Kind.HEARTBEAT)
