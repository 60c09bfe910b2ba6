"""The relayed path's links: member to relay, and relay to relay (muster.net.relay).

Every link is one TCP connection carrying frames ``[u32 length][u8 kind][body]``. The first
frame says who dials (HELLO, JSON); after the relay's WELCOME only DATA and ROUTE frames
follow. DATA carries one member's ciphertext to another member of the same gang: the relay
reads only the addressing, never the payload (the member endpoints encrypt it end to end,
muster.net.relayed), and stamps the source itself, so no member can speak as another.

Admission: a member's HELLO carries a ticket the controller issued for that relay: the gang,
the member, an expiry and a nonce, with an HMAC under the secret the controller shares with
its relays. A relay admits a ticket once (its nonce), before its expiry (15 minutes), and only
for the gang and member it names.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import secrets
import struct
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

MAX_FRAME = 256 * 1024  # a DATA frame's body: 64 KiB of payload and its addressing, with room
TICKET_TTL_S = 15 * 60
_HEAD = struct.Struct("!IB")
_ADDR = struct.Struct("!HHH")  # gang name length, source member, destination member


class Kind(IntEnum):
    HELLO = 1  # member or relay -> relay: JSON
    WELCOME = 2  # relay -> dialer: JSON {relay}
    REFUSED = 3  # relay -> dialer: JSON {reason}; the link closes
    DATA = 4  # [u16 gang len][u16 src][u16 dst][gang][payload]
    ROUTE = 5  # relay -> relay: JSON {gang, member, here}: where a member is attached
    USAGE = 6  # relay -> controller: JSON {relay, usage: [[gang, member, bytes sent], ...]}


class LinkClosed(Exception):
    pass


async def read_frame(reader: asyncio.StreamReader) -> tuple[Kind, bytes]:
    try:
        head = await reader.readexactly(_HEAD.size)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise LinkClosed("the link closed") from exc
    length, kind = _HEAD.unpack(head)
    if length > MAX_FRAME:
        raise LinkClosed(f"a frame of {length} bytes (at most {MAX_FRAME})")
    try:
        body = await reader.readexactly(length)
        return Kind(kind), body
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise LinkClosed("the link closed mid-frame") from exc
    except ValueError as exc:
        raise LinkClosed(f"unknown frame kind {kind}") from exc


def frame(kind: Kind, body: bytes) -> bytes:
    return _HEAD.pack(len(body), kind) + body


def json_frame(kind: Kind, data: dict[str, Any]) -> bytes:
    return frame(kind, json.dumps(data, separators=(",", ":")).encode())


def data_frame(gang: str, src: int, dst: int, payload: bytes) -> bytes:
    name = gang.encode()
    return frame(Kind.DATA, _ADDR.pack(len(name), src, dst) + name + payload)


def parse_data(body: bytes) -> tuple[str, int, int, memoryview]:
    if len(body) < _ADDR.size:
        raise ValueError("a DATA frame without its addressing")
    size, src, dst = _ADDR.unpack_from(body)
    end = _ADDR.size + size
    if len(body) < end:
        raise ValueError("a DATA frame cut inside its gang name")
    return body[_ADDR.size : end].decode(), src, dst, memoryview(body)[end:]


# ---- tickets ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ticket:
    gang: str
    member: int
    expires: float
    nonce: str
    rate: float = 0.0  # bytes per second this member may send through a relay; 0: no cap


def _mac(secret: bytes, payload: str) -> str:
    return hmac.new(secret, b"muster-relay-ticket\0" + payload.encode(), hashlib.sha256).hexdigest()


def issue_ticket(
    secret: bytes, gang: str, member: int, ttl: float = TICKET_TTL_S, rate: float = 0.0
) -> str:
    """A ticket (controller side) admitting ``member`` of ``gang`` once, for ``ttl`` s, to
    send at most ``rate`` bytes/s (its share of the gang's cap; 0: none)."""
    payload = json.dumps(
        {
            "gang": gang,
            "member": member,
            "expires": time.time() + ttl,
            "nonce": secrets.token_hex(12),
            "rate": rate,
        },
        separators=(",", ":"),
    )
    token = base64.urlsafe_b64encode(payload.encode()).decode()
    return f"{token}.{_mac(secret, payload)}"


def read_ticket(secret: bytes, text: str) -> Ticket:
    """The ticket, if its MAC holds and it has not expired; ValueError (why) otherwise."""
    token, _, mac = str(text).partition(".")
    try:
        payload = base64.urlsafe_b64decode(token.encode()).decode()
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError("a malformed ticket") from exc
    if not hmac.compare_digest(_mac(secret, payload), mac):
        raise ValueError("a ticket this relay's secret did not sign")
    ticket = Ticket(
        str(data["gang"]),
        int(data["member"]),
        float(data["expires"]),
        str(data["nonce"]),
        float(data.get("rate") or 0.0),
    )
    if ticket.expires < time.time():
        raise ValueError("an expired ticket")
    return ticket


def ticket_expires(text: str) -> float:
    """When a ticket expires (its payload is not secret; only the MAC is): 0 when unreadable."""
    try:
        payload = base64.urlsafe_b64decode(str(text).partition(".")[0].encode())
        return float(json.loads(payload)["expires"])
    except (ValueError, KeyError, TypeError):
        return 0.0


def relay_proof(secret: bytes, name: str, nonce: str) -> str:
    """What a relay shows another of its mesh: it holds the same secret."""
    return hmac.new(
        secret, f"muster-relay-peer\0{name}\0{nonce}".encode(), hashlib.sha256
    ).hexdigest()
