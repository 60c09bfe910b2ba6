"""Control-link frames between the controller and its agents: kinds, byte layout, MAC.

One control link is one WebSocket; each binary message is one frame:

     0     1      2              10            14                 14+n          14+n+32
    +-----+------+--------------+-------------+------------------+-------------+
    | ver | kind | seq (u64 BE) | n (u32 BE)  | payload: n bytes | MAC 32 B    |
    +-----+------+--------------+-------------+------------------+-------------+

- ``ver`` is ``VERSION``; a frame of another version is malformed.
- ``payload`` is UTF-8 JSON (an object).
- ``MAC`` = HMAC-SHA256(session key, direction || ver .. payload), direction being b"A" for
  agent -> controller and b"C" for controller -> agent, so a frame cannot be reflected
  back to its sender. The handshake frames CHALLENGE and AUTH carry 32 zero bytes.
- ``seq`` starts at 1 in each direction after the handshake and must strictly increase:
  a frame whose seq is not above the last accepted one is a replay.

A frame that fails any check is refused (and counted by the receiver); the link stays up
for the honest frames that follow.

Handshake (the join secret never crosses the wire):
    controller -> CHALLENGE {nonce: 32 random bytes, hex}
    agent      -> AUTH {worker_id, nonce, proof}
                  proof = HMAC(join secret, "muster-auth\\0" || cnonce || anonce || worker_id)
    controller -> WELCOME {proof, ticket, heartbeat_interval}  (first MAC'd frame, seq 1)
                  proof = HMAC(join secret, "muster-server\\0" || cnonce || anonce): the agent
                  checks that the controller holds the join secret too.
    session key = HMAC(join secret, "muster-session\\0" || cnonce || anonce)
The ``ticket`` is a random bearer secret for this session's HTTP calls (bundle download,
artifact upload); it dies with the link.

Open admission (a window job with ``open_admission: true``; seed 003): a walk-in without the
join secret sends AUTH {worker_id: "open-<job>-<host>", nonce, open_job} and no proof; when
that job's window is open and takes such boxes, the controller answers ADMIT {salt: 32 random
bytes, hex} in the clear, and the salt stands in for the join secret in the session key and
both proofs. Anyone who reads the wire then holds the session: that is why the option is only
for a trusted network (or TLS), and why such a link may do nothing but walk in to that job.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import orjson

from muster.errors import MusterError

VERSION = 1
HEADER = struct.Struct(">BBQI")  # ver, kind, seq, payload length
MAC_SIZE = 32
MAX_PAYLOAD = 16 * 1024 * 1024
ZERO_MAC = b"\0" * MAC_SIZE
TO_CONTROLLER = b"A"
TO_AGENT = b"C"


class Kind(IntEnum):
    """Frame kinds; the comment says who sends it, when, and the payload's fields."""

    CHALLENGE = 1  # C->A, first frame on a new link: {nonce}
    AUTH = 2  # A->C, answer to CHALLENGE: {worker_id, nonce, proof}
    WELCOME = 3  # C->A, secret proven: {proof, ticket, heartbeat_interval, heartbeat_timeout}
    # C->A, plain, to an AUTH {worker_id, nonce, open_job} without proof that a window with
    # open_admission takes: {salt}, which stands in for the join secret from here on
    ADMIT = 4
    # A->C, after WELCOME and when a member ends: {inventory, running: [job ids], members:
    # [{job, epoch, node_rank, exit_code (null: alive), signal}]}; the first of a link is
    # what the agent still holds (muster.gang.LinkBack)
    INVENTORY = 10
    HEARTBEAT = 11  # A->C, every few seconds: {time}
    HEARTBEAT_ACK = 12  # C->A, reply: {stop: [job ids that must stop now]}
    PREPARE_RENDEZVOUS = 20  # C->A node 0 only: {job, epoch, port | null}
    RENDEZVOUS_READY = 21  # A->C node 0: {job, epoch, addr, port}
    ASSIGN = 22  # C->A, after node 0 published: {job, epoch, node_rank, argv, env, ...}
    MEMBER_STARTED = 23  # A->C: {job, epoch, node_rank, pid}
    # A->C, every process of the member gone: {job, epoch, node_rank, exit_code, signal,
    # failed_rank, failed_exit, tail}; kept and sent again on the next link if none was up
    MEMBER_EXITED = 24
    ARTIFACTS_DONE = 25  # A->C, outputs uploaded: {job, epoch, node_rank, files}
    # C->A, kill the member's process tree (or never start it): {job, epoch, node_rank,
    # reason}; an agent without that member answers MEMBER_EXITED {..., absent: true}
    STOP = 26
    # C->A, a MEMBER_EXITED or ARTIFACTS_DONE was handled: {job, epoch, node_rank, report:
    # the kind's number}; the agent sends a report again on each new link until acked
    REPORT_ACK = 27
    LOGS = 30  # A->C: {job, batch, lines: [[origin, rank, seq, time, stream, text], ...]}
    LOGS_ACK = 31  # C->A, batch stored: {job, batch}
    ERROR = 40  # C->A, the controller refuses something: {message}
    # The direct path (muster.net), before the rendezvous; the agent makes the device:
    # C->A: {job, epoch, node_rank, address, prefix, mtu, join_key}: a fresh key and a
    # device (muster0) of at most mtu; join_key comes back once in NET_READY (relayed path:
    # {job, epoch, node_rank, path: "relayed", join_key, ...})
    NET_SETUP = 50
    # A->C: {job, epoch, node_rank, public_key, port, mtu, join_key, public?: {addr, port}}
    # (the device listens on UDP port, took mtu, and the reflector saw it as public), or
    # {job, epoch, node_rank, error, silent?: [mesh address]} when it could not be made
    NET_READY = 51
    # C->A: {job, epoch, node_rank, peers: [{public_key, endpoint, address}]}
    NET_PEERS = 52
    NET_UP = 53  # A->C: {job, epoch, node_rank}: its peers are set
    # The probe (muster.net.probe), before the rendezvous, on every path:
    PROBE_LISTEN = 54  # C->A: {job, epoch, node_rank, addr}: listen on addr, any port
    PROBE_READY = 55  # A->C: {job, epoch, node_rank, port} or {..., error}
    # C->A: {job, epoch, node_rank, seconds, peers: [{node, addr, port}]}: measure them
    PROBE_RUN = 56
    # A->C: {job, epoch, node_rank, pairs: [{node, connects, rtt_ms, gbps, error}]}
    PROBE_DONE = 57
    # A->C: {job, epoch, node_rank, lost: [mesh address]}: while its member runs on the
    # direct path, the peers it has heard nothing from lately (sent when the set changes)
    NET_PATH = 58
    # The join window (muster.membership), to a walk-in (an agent whose inventory has
    # ``join``): {job, admitted, reason, phase, first_rank, ranks}. After a refusal, or once
    # the window has closed without it, the walk-in has nothing to do on this link.
    JOIN_REPLY = 60
    # Diagnosis (muster.agent.stacks): C->A, the Python stacks of this member's ranks:
    # {job, epoch, node_rank, request, ranks: [global ranks] | null, native, timeout}
    STACKS = 70
    # A->C, the answer: {request, job, node_rank, stacks: {rank: text}, error: str | null}
    STACKS_DONE = 71
    # A->C, with hang_timeout set (muster.agent.hang): the member's ranks turned silent and
    # idle, or active again: {job, epoch, node_rank, hung, ranks: [first, last], silent_s}
    HUNG = 72
    # Before any rank starts (muster.gang.gating), C->A: dial node 0's rendezvous, which
    # its agent holds open until its ASSIGN: {job, epoch, node_rank, addr | null, port}
    MASTER_CHECK = 73
    # A->C: {job, epoch, node_rank, error: str | null, torch: str | null, nccl: str | null}
    MASTER_CHECKED = 74
    # A->C: more single-use relay tickets for this member (its stock ran low or is about to
    # expire): {job, epoch, node_rank}; C->A RELAY_TICKETS_ISSUED: {job, epoch, node_rank,
    # relays: [{host, port, tickets}]}. Answered at most every RELAY_TICKETS_EVERY_S.
    RELAY_TICKETS = 75
    RELAY_TICKETS_ISSUED = 76


OPEN_PREFIX = "open-"  # the worker ids of links admitted without the join secret


def open_worker_id(job: str, host: str) -> str:
    """The worker id of a walk-in admitted to ``job`` without the join secret: a name muster
    gives no agent that holds the secret, so an open link never takes one's place."""
    return f"{OPEN_PREFIX}{job}-{host}"


class FrameRefused(MusterError):
    """A frame failed a check; ``reason`` is malformed, forged or replayed."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason} frame: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Frame:
    kind: Kind
    seq: int
    body: dict[str, Any]


def new_nonce() -> str:
    return secrets.token_hex(32)


def _hmac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of the concatenated parts: the MAC every muster link uses (the control
    link here, muster.train's star reduce for its handshake and per-frame keys)."""
    return _hmac(key, *parts)


def auth_proof(token: str, cnonce: str, anonce: str, worker_id: str) -> str:
    return _hmac(
        token.encode(), b"muster-auth\0", cnonce.encode(), anonce.encode(), worker_id.encode()
    ).hex()


def server_proof(token: str, cnonce: str, anonce: str) -> str:
    return _hmac(token.encode(), b"muster-server\0", cnonce.encode(), anonce.encode()).hex()


def session_key(token: str, cnonce: str, anonce: str) -> bytes:
    return _hmac(token.encode(), b"muster-session\0", cnonce.encode(), anonce.encode())


def proofs_match(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def encode_plain(kind: Kind, body: dict[str, Any]) -> bytes:
    """A handshake frame (CHALLENGE, AUTH, ADMIT): seq 0, no MAC."""
    payload = orjson.dumps(body)
    return HEADER.pack(VERSION, kind, 0, len(payload)) + payload + ZERO_MAC


def decode_plain(data: bytes, expect: Kind) -> dict[str, Any]:
    """Parse a handshake frame of kind ``expect``."""
    kind, _seq, body = _parse(data)
    if kind != expect:
        raise FrameRefused("malformed", f"expected {expect.name}, got {kind.name}")
    return body


def _parse(data: bytes) -> tuple[Kind, int, dict[str, Any]]:
    if len(data) < HEADER.size + MAC_SIZE:
        raise FrameRefused("malformed", f"{len(data)} bytes is shorter than a frame")
    ver, kind, seq, size = HEADER.unpack_from(data)
    if ver != VERSION:
        raise FrameRefused("malformed", f"version {ver}, expected {VERSION}")
    if size > MAX_PAYLOAD or len(data) != HEADER.size + size + MAC_SIZE:
        raise FrameRefused("malformed", f"length field {size} does not match the frame")
    try:
        frame_kind = Kind(kind)
    except ValueError:
        raise FrameRefused("malformed", f"unknown kind {kind}") from None
    try:
        body = orjson.loads(data[HEADER.size : HEADER.size + size])
    except orjson.JSONDecodeError as exc:
        raise FrameRefused("malformed", f"payload is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise FrameRefused("malformed", "payload is not a JSON object")
    return frame_kind, seq, body


class LinkCodec:
    """Encodes and checks the MAC'd frames of one link, for one side of it."""

    def __init__(self, key: bytes, *, send: bytes, receive: bytes) -> None:
        self._key = key
        self._send_dir = send
        self._recv_dir = receive
        self._next_seq = 1
        self.last_seq = 0

    def encode(self, kind: Kind, body: dict[str, Any]) -> bytes:
        payload = orjson.dumps(body)
        head = HEADER.pack(VERSION, kind, self._next_seq, len(payload))
        self._next_seq += 1
        return head + payload + _hmac(self._key, self._send_dir, head, payload)

    def decode(self, data: bytes) -> Frame:
        """Check and parse one received frame; raises FrameRefused."""
        kind, seq, body = _parse(data)
        end = len(data) - MAC_SIZE
        expected = _hmac(self._key, self._recv_dir, data[:end])
        if not hmac.compare_digest(expected, data[end:]):
            raise FrameRefused("forged", f"{kind.name} seq {seq} has a bad MAC")
        if seq <= self.last_seq:
            raise FrameRefused("replayed", f"{kind.name} seq {seq} <= last seq {self.last_seq}")
        self.last_seq = seq
        return Frame(kind, seq, body)
