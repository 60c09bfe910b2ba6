"""Agents' control links: the handshake, then a loop of checked frames (see muster.wire)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from muster import wire
from muster.controller.metrics import Metrics
from muster.errors import MusterError
from muster.wire import Frame, FrameRefused, Kind

log = logging.getLogger("muster.controller")

HANDSHAKE_TIMEOUT_S = 10.0
CLOSE_AUTH_FAILED = 4401
CLOSE_REFUSED = 4409
CLOSE_SERVER_EXITING = 1012  # what uvicorn sends every WebSocket when the controller stops


class Link:
    """One authenticated agent's control link."""

    def __init__(self, ws: WebSocket, worker_id: str, codec: wire.LinkCodec, ticket: str) -> None:
        self.ws = ws
        self.worker_id = worker_id
        self.codec = codec
        self.ticket = ticket
        self.last_seen = time.monotonic()
        self.closed = False
        self.close_code: int | None = None
        self._send_lock = asyncio.Lock()

    async def send(self, kind: Kind, body: dict[str, Any]) -> bool:
        """Send a frame; False when the link is already gone."""
        if self.closed:
            return False
        async with self._send_lock:
            try:
                await self.ws.send_bytes(self.codec.encode(kind, body))
                return True
            except (WebSocketDisconnect, RuntimeError, OSError):
                self.closed = True
                return False

    async def close(self, code: int = 1000) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(RuntimeError, OSError):
                await self.ws.close(code)


async def handshake(
    ws: WebSocket, token: str, metrics: Metrics, heartbeat_interval: float
) -> Link | None:
    """Challenge the agent to prove it holds the token; None (link closed) when it does not."""
    anonce = wire.new_nonce()
    await ws.send_bytes(wire.encode_plain(Kind.CHALLENGE, {"nonce": anonce}))
    try:
        data = await asyncio.wait_for(ws.receive_bytes(), HANDSHAKE_TIMEOUT_S)
        body = wire.decode_plain(data, Kind.AUTH)
        worker_id, cnonce, proof = str(body["worker_id"]), str(body["nonce"]), str(body["proof"])
    except (TimeoutError, FrameRefused, KeyError, WebSocketDisconnect, RuntimeError) as exc:
        metrics.frames_refused.labels("auth").inc()
        log.warning("refused a control link: bad handshake (%s)", exc)
        await _close(ws, CLOSE_AUTH_FAILED)
        return None
    if not wire.proofs_match(proof, wire.auth_proof(token, cnonce, anonce, worker_id)):
        metrics.frames_refused.labels("auth").inc()
        log.warning("refused a control link from %r: wrong token", worker_id)
        await _close(ws, CLOSE_AUTH_FAILED)
        return None
    key = wire.session_key(token, cnonce, anonce)
    codec = wire.LinkCodec(key, send=wire.TO_AGENT, receive=wire.TO_CONTROLLER)
    link = Link(ws, worker_id, codec, ticket=secrets.token_urlsafe(32))
    await link.send(
        Kind.WELCOME,
        {
            "proof": wire.server_proof(token, cnonce, anonce),
            "ticket": link.ticket,
            "heartbeat_interval": heartbeat_interval,
        },
    )
    return link


async def serve_frames(
    link: Link, metrics: Metrics, on_frame: Callable[[Link, Frame], Awaitable[None]]
) -> str:
    """Read frames until the link ends; refused frames are counted and skipped.

    Returns why the link ended (its EOF is the host's exit).
    """
    while True:
        try:
            message = await link.ws.receive()
        except (RuntimeError, OSError) as exc:
            return f"control link broke: {exc}"
        if message["type"] == "websocket.disconnect":
            link.close_code = int(message.get("code", 1000))
            return f"control link closed (code {link.close_code})"
        data = message.get("bytes")
        if data is None:
            metrics.frames_refused.labels("malformed").inc()
            continue
        try:
            frame = link.codec.decode(data)
        except FrameRefused as exc:
            metrics.frames_refused.labels(exc.reason).inc()
            log.warning("worker %s: %s", link.worker_id, exc)
            continue
        link.last_seen = time.monotonic()
        try:
            await on_frame(link, frame)
        except (KeyError, TypeError, ValueError) as exc:  # a well-MAC'd frame with a bad body
            metrics.frames_refused.labels("malformed").inc()
            log.warning(
                "worker %s: %s frame with a bad body: %r", link.worker_id, frame.kind.name, exc
            )
        except MusterError as exc:
            log.warning("worker %s: %s frame refused: %s", link.worker_id, frame.kind.name, exc)


async def _close(ws: WebSocket, code: int) -> None:
    with contextlib.suppress(RuntimeError, OSError):
        await ws.close(code)
