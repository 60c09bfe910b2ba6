"""Frames of the star reduce (muster.train's CPU averaging backend): layout, handshake, MAC.

Every link of the star (rank -> its host's fold, fold -> root) is one TCP connection that
carries frames::

    | "MS" | ver | kind | seq u64 | op u64 | mass f64 | offset u64 | meta n u32 | body n u32 |
    | meta: UTF-8 JSON, n bytes | body: n bytes | tag 16 B |

- ``op`` numbers the reduce operations of the cohort (every rank runs the same sequence);
  ``mass`` is a contribution's realized-work mass; ``offset`` is a CHUNK's first element.
- ``tag`` = Poly1305(frame key, every byte before it), the frame key being
  HMAC-SHA256(session key, direction || seq): a fresh one-time key per frame, so a 64 MiB
  body is authenticated at Poly1305's speed (about 10 GB/s here, against 1.8 GB/s for
  HMAC-SHA256 over the body), and the whole frame is checked before any of it is used.
- ``seq`` starts at 1 in each direction after the handshake and goes up by exactly 1: a
  replayed, dropped or reordered frame breaks the link.
- ``direction`` is b"U" (towards the root) or b"D" (towards the ranks): a frame cannot be
  reflected back to its sender.

Handshake (the run's salt never crosses the wire; it reaches the ranks through the process
group at start, as torch's own rendezvous data does)::

    server -> CHALLENGE {nonce}
    client -> HELLO {nonce, ranks, proof}   proof = HMAC(salt, "muster-star-hello\\0" ||
                                                         snonce || cnonce || ranks)
    server -> WELCOME {proof}   (MAC'd, seq 1)  proof = HMAC(salt, "muster-star-server\\0" ||
                                                         snonce || cnonce)
    session key = HMAC(salt, "muster-star-session\\0" || snonce || cnonce)

CHALLENGE and HELLO carry seq 0 and a zero tag. Anything else before a valid HELLO is a
rejected pre-auth frame.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import orjson
from cryptography.hazmat.primitives.poly1305 import Poly1305

from muster.errors import MusterError
from muster.wire import mac

MAGIC = b"MS"
VERSION = 1
HEAD = struct.Struct(">2sBBQQdQII")  # magic, ver, kind, seq, op, mass, offset, meta n, body n
TAG_SIZE = 16
ZERO_TAG = b"\0" * TAG_SIZE
MAX_META = 1 << 20
MAX_PLAIN_META = 4096  # a handshake frame's metadata; it carries no body
MAX_BODY = 8 << 20  # a CHUNK's body: 1 Mi values, f64 at most
UP = b"U"
DOWN = b"D"


class Kind(IntEnum):
    CHALLENGE = 1
    HELLO = 2
    WELCOME = 3
    HEARTBEAT = 4
    START = 5  # a contribution (up) or a result (down): meta says what, n, ranks
    CHUNK = 6  # part of the body announced by START
    DEAD = 7  # ranks declared dead (up: a fold saw them go; down: the root tells everyone)
    SHUTDOWN = 8  # the cohort stops with a save: meta {reason}
    BYE = 9  # a rank leaves on purpose (its ElChe closed)
    ABORT = 10  # the op's values stop here: a contribution below was cut off (not realized)
    END = 11  # (in-process links only) the answer is complete


class StarRefused(MusterError):
    """A frame failed a check (malformed, forged, replayed): the link it came on is closed."""


class StarClosed(MusterError):
    """The other end closed the link (or it broke) while a frame was expected."""


@dataclass
class Frame:
    kind: Kind
    seq: int
    op: int
    mass: float
    offset: int
    meta: dict[str, Any]
    body: memoryview


def new_nonce() -> bytes:
    return secrets.token_bytes(32)


def hello_proof(salt: bytes, snonce: bytes, cnonce: bytes, ranks: list[int]) -> bytes:
    return mac(salt, b"muster-star-hello\0", snonce, cnonce, orjson.dumps(ranks))


def server_proof(salt: bytes, snonce: bytes, cnonce: bytes) -> bytes:
    return mac(salt, b"muster-star-server\0", snonce, cnonce)


def session_key(salt: bytes, snonce: bytes, cnonce: bytes) -> bytes:
    return mac(salt, b"muster-star-session\0", snonce, cnonce)


def proofs_match(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise StarClosed("the link closed mid-frame" if got else "the link closed")
        got += n


class Codec:
    """One side of one link: sequence numbers, the session key, reading and writing frames.

    Reading happens on one thread per link; writing takes ``send_lock`` (heartbeats and
    contributions share the socket)."""

    def __init__(self, sock: socket.socket, *, send_dir: bytes, recv_dir: bytes) -> None:
        self.sock = sock
        self.key: bytes | None = None
        self.send_dir = send_dir
        self.recv_dir = recv_dir
        self.send_seq = 0
        self.recv_seq = 0
        self._head = bytearray(HEAD.size)
        self.body = bytearray(0)  # (MAX_BODY, once the link is authenticated)
        self.last_read = time.monotonic()  # when the last whole frame arrived
        self.bytes_sent = 0
        self.bytes_received = 0
        # Frames on a Unix socket carry no tag: nobody but its two ends can write into an
        # established Unix stream (and only this user can connect: see starhub.LOCAL), so
        # the handshake's proof is the whole of it. Across hosts every frame is tagged.
        self.tagged = sock.family != socket.AF_UNIX

    def cut(self) -> None:
        """End the link for good: a reader blocked in it wakes up, and the peer sees it go
        (a bare close from another thread does neither)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def _tagger(self, direction: bytes, seq: int) -> Poly1305 | None:
        if self.key is None or not self.tagged:
            return None
        return Poly1305(mac(self.key, direction, seq.to_bytes(8, "big"))[:32])

    def send(
        self,
        kind: Kind,
        *,
        op: int = 0,
        mass: float = 0.0,
        offset: int = 0,
        meta: dict[str, Any] | None = None,
        body: memoryview | bytes = b"",
        plain: bool = False,
    ) -> None:
        """Write one frame (the caller holds the link's send lock). ``plain``: a handshake
        frame (seq 0, zero tag)."""
        packed = orjson.dumps(meta) if meta else b""
        if len(packed) > MAX_META or len(body) > MAX_BODY:
            raise StarRefused(f"a {kind.name} frame is past the size limits")
        seq = 0
        if not plain:
            self.send_seq += 1
            seq = self.send_seq
        head = HEAD.pack(MAGIC, VERSION, kind, seq, op, mass, offset, len(packed), len(body))
        tagger = None if plain else self._tagger(self.send_dir, seq)
        if tagger is None:
            tag = ZERO_TAG
        else:
            tagger.update(head)
            tagger.update(packed)
            tagger.update(body)
            tag = tagger.finalize()
        self.sock.sendall(head + packed)
        if len(body):
            self.sock.sendall(body)
        self.sock.sendall(tag)
        self.bytes_sent += HEAD.size + len(packed) + len(body) + TAG_SIZE

    def read(
        self,
        *,
        plain: bool = False,
        place: Callable[[Kind, int, int], memoryview | None] | None = None,
    ) -> Frame:
        """Read and check one frame. Its body is a view of this codec's buffer, valid until
        the next read, or of what ``place(kind, offset, length)`` returned for it. Raises
        StarRefused (bad frame) or StarClosed (link gone)."""
        head = memoryview(self._head)
        recv_exact(self.sock, head)
        magic, version, kind, seq, op, mass, offset, meta_n, body_n = HEAD.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise StarRefused("not a star frame (wrong magic or version)")
        if meta_n > MAX_META or body_n > MAX_BODY:
            raise StarRefused(f"a frame announces {meta_n} + {body_n} bytes, past the limits")
        if (plain or self.key is None) and (meta_n > MAX_PLAIN_META or body_n):
            raise StarRefused("a handshake frame past its size (no body, 4 KiB of metadata)")
        try:
            kind = Kind(kind)
        except ValueError:
            raise StarRefused(f"unknown frame kind {kind}") from None
        meta_raw = bytearray(meta_n)
        recv_exact(self.sock, memoryview(meta_raw))
        spot = place(kind, offset, body_n) if place is not None and body_n else None
        if spot is None or len(spot) != body_n:
            if len(self.body) < body_n:
                self.body = bytearray(MAX_BODY)
            spot = memoryview(self.body)[:body_n]
        body = spot
        recv_exact(self.sock, body)
        tag = bytearray(TAG_SIZE)
        recv_exact(self.sock, memoryview(tag))
        self.bytes_received += HEAD.size + meta_n + body_n + TAG_SIZE
        self.last_read = time.monotonic()
        if plain:
            if seq != 0 or kind not in (Kind.CHALLENGE, Kind.HELLO):
                raise StarRefused(f"{kind.name} before the handshake finished")
        else:
            if self.key is None:
                raise StarRefused("a MAC'd frame before the handshake")
            if seq != self.recv_seq + 1:
                raise StarRefused(
                    f"{kind.name} seq {seq}, expected {self.recv_seq + 1} (replayed or lost)"
                )
            tagger = self._tagger(self.recv_dir, seq)
            if tagger is not None:
                tagger.update(bytes(head))
                tagger.update(bytes(meta_raw))
                tagger.update(body)
                try:
                    tagger.verify(bytes(tag))
                except Exception:
                    raise StarRefused(f"{kind.name} seq {seq} has a bad tag (forged)") from None
            self.recv_seq = seq
        try:
            meta = orjson.loads(meta_raw) if meta_n else {}
        except orjson.JSONDecodeError:
            raise StarRefused(f"{kind.name} carries malformed metadata") from None
        if not isinstance(meta, dict):
            raise StarRefused(f"{kind.name} metadata is not an object")
        return Frame(kind, seq, op, mass, offset, meta, body)


def serve_handshake(
    codec: Codec, salt: bytes, admit: Callable[[list[int]], None] | None = None
) -> list[int]:
    """Server side: challenge, check the HELLO's proof, ``admit(ranks)`` (raises StarRefused
    for ranks that may not join), answer WELCOME; returns the ranks the client speaks for.
    Raises StarRefused on anything else."""
    snonce = new_nonce()
    codec.send(Kind.CHALLENGE, meta={"nonce": snonce.hex()}, plain=True)
    hello = codec.read(plain=True)
    if hello.kind is not Kind.HELLO:
        raise StarRefused(f"expected HELLO, got {hello.kind.name}")
    try:
        cnonce = bytes.fromhex(hello.meta["nonce"])
        ranks = [int(r) for r in hello.meta["ranks"]]
        proof = bytes.fromhex(hello.meta["proof"])
    except (KeyError, TypeError, ValueError):
        raise StarRefused("a malformed HELLO") from None
    if len(cnonce) != 32 or not proofs_match(proof, hello_proof(salt, snonce, cnonce, ranks)):
        raise StarRefused("a HELLO whose proof does not hold (another run's salt, or forged)")
    if admit is not None:
        admit(ranks)
    codec.key = session_key(salt, snonce, cnonce)
    codec.send(Kind.WELCOME, meta={"proof": server_proof(salt, snonce, cnonce).hex()})
    return ranks


def client_handshake(codec: Codec, salt: bytes, ranks: list[int]) -> None:
    """Client side: answer the challenge, check the server's proof."""
    challenge = codec.read(plain=True)
    if challenge.kind is not Kind.CHALLENGE:
        raise StarRefused(f"expected CHALLENGE, got {challenge.kind.name}")
    try:
        snonce = bytes.fromhex(challenge.meta["nonce"])
    except (KeyError, TypeError, ValueError):
        raise StarRefused("a malformed CHALLENGE") from None
    cnonce = new_nonce()
    proof = hello_proof(salt, snonce, cnonce, ranks)
    meta = {"nonce": cnonce.hex(), "ranks": ranks, "proof": proof.hex()}
    codec.send(Kind.HELLO, meta=meta, plain=True)
    codec.key = session_key(salt, snonce, cnonce)
    welcome = codec.read()
    if welcome.kind is not Kind.WELCOME:
        raise StarRefused(f"expected WELCOME, got {welcome.kind.name}")
    try:
        theirs = bytes.fromhex(welcome.meta["proof"])
    except (KeyError, TypeError, ValueError):
        raise StarRefused("a malformed WELCOME") from None
    if not proofs_match(theirs, server_proof(salt, snonce, cnonce)):
        raise StarRefused("the server does not hold this run's salt")
