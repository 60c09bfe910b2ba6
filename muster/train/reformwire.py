"""The survivors' rendezvous for the collective backend's re-form (``muster.train.reform``).

Each rank binds two sockets when the cohort forms, on its address on the route to
``MASTER_ADDR``, and every rank learns every other's (one ``all_gather_object``, which also
hands out the run's key, the lowest rank's salt):

- the *call port*, answered by an accept thread (a thread per connection, 16 at most): a
  *call* (a peer lost a peer: re-form) marks the rank ``kicked``, which wakes it where it is
  parked in a collective; a *ping* is answered with a MAC, which proves the rank alive, its
  thread running and of this run (a ping for a re-form this rank has not joined kicks it too:
  the leader's pings every second repeat a call that was missed). Both frames carry an
  HMAC-SHA256 under the run's key; others are refused, counted and logged;
- the *store port*, never accepted on until its rank leads a re-form: then a ``TCPStore``
  takes it over (``master_listen_fd``), and the survivors register there.

Who may call: a call or a ping needs the run's key (which travelled over the process group,
as the star's salt does); the store, like torchrun's, takes any client that reaches it while
the survivors meet, so the member list it carries is MAC'd and checked.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from muster.errors import CohortStopped
from muster.train.collective import Seat

CANDIDATE_S = 5.0  # how long a survivor waits for a candidate leader's socket to answer
_PROBE_EVERY_S = 1.0  # the leader re-checks a member that has not registered yet
_FRAME = 41  # a call or a ping: kind (1), generation (8), MAC (32)
_MAX_ANSWERING = 16  # calls and pings answered at once
# Process groups and works given up on: their destructors would wait for the collectives a
# lost peer never joins, so they are kept (their sockets and threads with them) for good.
ABANDONED: list[Any] = []

log = logging.getLogger("muster.train")


def _loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "localhost")


def route_address() -> str:
    """This host's address on the route to MASTER_ADDR: the one its peers reach it on."""
    master = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = int(os.environ.get("MASTER_PORT") or 29500)
    try:
        family, _, _, _, where = socket.getaddrinfo(master, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(where)
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class Reformer:
    """The survivors' rendezvous. Each rank has two listening sockets: one its accept thread
    answers (calls to re-form, and pings that prove a rank alive and of this run), and one
    only a leader uses, for the store the survivors meet on."""

    def __init__(self, seat: Seat, backend: str, wait_s: float) -> None:
        self.seat = seat
        self.backend = backend
        self.wait_s = wait_s
        self.generation = 0
        self.called = 0  # the highest re-form generation a peer called this rank to
        self.refused = 0  # calls and pings that did not authenticate
        self.usable = True  # False: the seats cannot reach each other (loopback across hosts)
        self._store: Any = None  # the current generation's store (the leader serves it)
        self._listener: socket.socket | None = None
        self._closed = False
        self._answering = threading.Semaphore(_MAX_ANSWERING)
        self.seats: dict[int, tuple[str, int, int]] = {}  # rank -> (host, store port, call port)
        self._caller = socket.create_server((route_address(), 0), backlog=128)
        try:
            gathered = self._gather_seats(
                {"salt": secrets.token_bytes(32).hex(), "host": socket.gethostname()}
            )
        except BaseException:
            self.close()
            raise
        hosts = {str(g["host"]) for g in gathered}
        looped = [int(g["rank"]) for g in gathered if _loopback(g["seat"][0])]
        if looped and len(hosts) > 1:
            self.usable = False
            if seat.rank == min(self.seats):
                log.warning(
                    "re-form is off: ranks %s advertise a loopback address across %d hosts "
                    "(MASTER_ADDR unset, or naming 127.x on its host); a lost peer stops "
                    "the cohort with a save", looped, len(hosts),
                )  # fmt: skip
        threading.Thread(target=self._answer_calls, name="muster-reform-calls", daemon=True).start()

    def _gather_seats(self, extra: dict[str, Any]) -> list[dict[str, Any]]:
        host, port = self._open()
        mine = {
            **extra,
            "rank": self.seat.rank,
            "seat": [host, port, self._caller.getsockname()[1]],
        }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        self.seats = {int(g["rank"]): (g["seat"][0], int(g["seat"][1]), int(g["seat"][2]))
                      for g in gathered}  # fmt: skip
        if "salt" in extra:  # (the lowest rank's salt keys the calls to re-form)
            self._key = bytes.fromhex(min(gathered, key=lambda g: int(g["rank"]))["salt"])
        return gathered

    def _open(self) -> tuple[str, int]:
        listener = socket.create_server((route_address(), 0), backlog=128)
        old, self._listener = self._listener, listener
        if old is not None:
            old.close()
        return str(listener.getsockname()[0]), int(listener.getsockname()[1])

    def close(self) -> None:
        self._closed = True
        for sock in (self._listener, self._caller):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # (wakes the accept thread: Linux)
                with contextlib.suppress(OSError):
                    sock.close()
        self._listener = None
        self._store = None

    # -- calls and pings -----------------------------------------------------------------------

    def _mac(self, what: bytes, generation: int) -> bytes:
        head = generation.to_bytes(8, "big")
        return hmac.new(self._key, b"muster-reform/" + what + head, hashlib.sha256).digest()

    def _frame(self, kind: bytes, generation: int) -> bytes:
        return kind + generation.to_bytes(8, "big") + self._mac(kind, generation)

    @property
    def kicked(self) -> bool:
        """A peer called a re-form this rank has not joined yet."""
        return self.called > self.generation

    def _answer_calls(self) -> None:
        """Accept calls and pings, a thread each (at most a few at once; the others wait
        in the backlog). A call to re-form (a peer lost a peer) sets ``kicked``: a rank
        parked in a collective with a rank that left it wakes up. A ping is answered
        with a MAC, which proves this rank alive, its thread running and of this run.
        Refused frames are counted and logged; the loop goes on until close."""
        while not self._closed:
            try:
                conn, _ = self._caller.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.1)
                continue
            self._answering.acquire()  # (each answer ends within 2 s: the queue moves)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        data = b""
        deadline = time.monotonic() + 2.0  # (for the whole frame: not 2 s a byte)
        try:
            with contextlib.suppress(OSError):  # (a short frame, timed out: refused below)
                while len(data) < _FRAME and (left := deadline - time.monotonic()) > 0:
                    conn.settimeout(left)
                    piece = conn.recv(_FRAME - len(data))
                    if not piece:
                        break
                    data += piece
            kind, generation = data[:1], int.from_bytes(data[1:9], "big")
            if (
                len(data) != _FRAME
                or kind not in (b"C", b"P")
                or not hmac.compare_digest(data, self._frame(kind, generation))
            ):
                self.refused += 1
                log.warning("re-form: refused an unauthenticated frame (%d so far)",
                            self.refused)  # fmt: skip
            else:
                if generation > self.generation:  # (else a late call, or a plain ping)
                    self.called = max(self.called, generation)
                if kind == b"P":
                    conn.sendall(self._mac(b"pong", generation))
        except OSError:
            pass
        finally:
            conn.close()
            self._answering.release()

    def _call_all(self, generation: int) -> None:
        """Tell every other member to re-form (at most ``CANDIDATE_S``; the dead refuse)."""
        frame = self._frame(b"C", generation)

        def call(rank: int) -> None:
            host, _, port = self.seats[rank]
            with (
                contextlib.suppress(OSError),
                socket.create_connection((host, port), CANDIDATE_S) as c,
            ):
                c.sendall(frame)

        threads = [threading.Thread(target=call, args=(r,), daemon=True)
                   for r in self.seat.members if r != self.seat.rank]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(CANDIDATE_S + 1.0)

    def answers(self, rank: int, timeout: float, kick: bool = True) -> bool:
        """A ping: True when ``rank`` answers with the run's MAC within ``timeout``. A dead
        process refuses, a dead host or a frozen process stays silent: dead; a connection
        reset or closed early (a busy port) is tried again until ``timeout``. ``kick``: the
        ping is for the next re-form (it calls the rank to it too)."""
        host, _, port = self.seats[rank]
        generation = self.generation + (1 if kick else 0)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            data = b""
            try:
                with socket.create_connection((host, port), left) as peer:
                    peer.settimeout(max(0.05, deadline - time.monotonic()))
                    peer.sendall(self._frame(b"P", generation))
                    while len(data) < 32:
                        piece = peer.recv(32 - len(data))
                        if not piece:
                            break
                        data += piece
            except (ConnectionRefusedError, TimeoutError):
                return False
            except OSError:
                pass
            if len(data) == 32:
                return hmac.compare_digest(data, self._mac(b"pong", generation))
            time.sleep(0.1)
        return False

    # -- the rendezvous --------------------------------------------------------------------------

    def _leader(self) -> int:
        for candidate in self.seat.members:
            if candidate == self.seat.rank or self.answers(candidate, CANDIDATE_S):
                return candidate
        return self.seat.rank  # (unreachable: this rank is a member)

    def reform(self, report: dict[str, Any]) -> tuple[Seat, list[dict[str, Any]]]:
        """Re-form the survivors into a new default group; returns this rank's new seat and
        every member's ``report``. Raises CohortStopped when this rank cannot go on."""
        me, old = self.seat.rank, self.seat.members
        generation = self.generation + 1
        self._call_all(generation)
        with contextlib.suppress(Exception):
            broken = dist.distributed_c10d._get_default_group()
            ABANDONED.append(broken)  # (its destructor would wait for its parked works)
            if self.backend == "nccl":  # (NCCL's collectives only end by an abort)
                broken.abort()
            dist.destroy_process_group()
        leader = self._leader()
        prefix = f"muster-reform/{generation}/"
        timeout = datetime.timedelta(seconds=self.wait_s)
        try:
            if leader == me:
                assert self._listener is not None
                host, port, _ = self.seats[me]
                store = TCPStore(host, port, None, True, timeout, wait_for_workers=False,
                                 master_listen_fd=os.dup(self._listener.fileno()))  # fmt: skip
                members = self._gather(store, prefix, old, generation)
            else:
                host, port, _ = self.seats[leader]
                store = TCPStore(host, port, None, False, timeout)
                store.set(f"{prefix}in/{me}", "1")
                store.wait([f"{prefix}members"], timeout)
                members = self._read_members(store.get(f"{prefix}members"), generation)
        except (RuntimeError, OSError) as exc:  # (DistError is a RuntimeError)
            raise CohortStopped(
                f"the survivors could not re-form around rank {leader}: "
                f"{str(exc).splitlines()[0][:200]}"
            ) from exc
        if 2 * len(members) <= len(old):
            raise CohortStopped(
                f"only ranks {members} of {list(old)} re-formed: a re-formed cohort needs a "
                "majority of the last one (so two halves of a split network never both go on)"
            )
        if me not in members:
            raise CohortStopped(f"ranks {members} re-formed without rank {me} (it came late)")
        # (its timeout: twice the stall ceiling, which the sliced waits enforce first)
        dist.init_process_group(self.backend, store=PrefixStore(f"{prefix}group", store),
                                rank=members.index(me), world_size=len(members),
                                timeout=datetime.timedelta(seconds=2 * self.wait_s))  # fmt: skip
        self._store = store
        self.seat = Seat(me, self.seat.world, tuple(members))
        self.generation = generation  # (calls for this one or older no longer kick)
        gathered = self._gather_seats(report)
        return self.seat, gathered

    def _read_members(self, raw: bytes, generation: int) -> list[int]:
        """The leader's list, checked: the store takes anyone's writes, the MAC only ours."""
        try:
            text, tag = raw.decode().rsplit("|", 1)
            valid = hmac.compare_digest(bytes.fromhex(tag), self._mac(text.encode(), generation))
            members = [int(r) for r in json.loads(text)] if valid else None
        except (ValueError, TypeError):
            members = None
        if members is None:
            raise CohortStopped("the re-formed cohort's member list does not carry the run's MAC")
        return members

    def _gather(self, store: Any, prefix: str, old: Sequence[int], generation: int) -> list[int]:
        """The leader: wait for every old member to register or stop answering, then name
        the members (none when they are not a majority: every rank stops)."""
        me = self.seat.rank
        joined = {me}
        pending = {r for r in old if r != me}
        checked: dict[int, float] = {}
        deadline = time.monotonic() + self.wait_s
        while pending and time.monotonic() < deadline:
            for rank in sorted(pending):
                if store.check([f"{prefix}in/{rank}"]):
                    joined.add(rank)
                    pending.discard(rank)
                elif time.monotonic() - checked.get(rank, -1e9) >= _PROBE_EVERY_S:
                    checked[rank] = time.monotonic()
                    if not self.answers(rank, CANDIDATE_S):
                        pending.discard(rank)  # (its process is gone)
            time.sleep(0.02)
        members = sorted(joined)
        if pending:
            log.warning("re-form: ranks %s answer but did not come in %.0f s: left out",
                        sorted(pending), self.wait_s)  # fmt: skip
        text = json.dumps(members)
        store.set(f"{prefix}members", f"{text}|{self._mac(text.encode(), generation).hex()}")
        return members
