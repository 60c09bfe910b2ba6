"""Agents' control links: the handshake, then a loop of checked frames (see muster.wire)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from muster import wire
from muster.controller.auth import Tickets
from muster.controller.metrics import Metrics
from muster.errors import MusterError
from muster.wire import Frame, FrameRefused, Kind

log = logging.getLogger("muster.controller")

HANDSHAKE_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 10.0  # a peer that takes longer to accept one frame is dropped
PRE_AUTH_MAX_BYTES = 4096  # CHALLENGE/AUTH are a few hundred bytes
LINK_MAX_BYTES = wire.MAX_PAYLOAD + wire.HEADER.size + wire.MAC_SIZE
OPEN_LINK_MAX_BYTES = 4 * 1024 * 1024  # a link admitted without the secret (open_admission)
INBOX_FRAMES = 1024  # frames of one link waiting for the lock before its reader waits too
OUTBOX_FRAMES = 10_000  # frames queued to one agent before it counts as not reading


@dataclass(frozen=True)
class LinkEnded:
    """The last item of a link's inbox: the link is gone (``why``), handled after every
    frame that came before it."""

    why: str
    controller_exiting: bool = False


CLOSE_AUTH_FAILED = 4401
CLOSE_REFUSED = 4409


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
        self.reported = False  # its first INVENTORY (what the agent still runs) was handled
        self.walk_in = False  # its inventory names a job's window (muster join)
        # Admitted without the join secret to this job's window (open_admission): it may
        # only walk in to that job.
        self.open_job: str | None = None
        self.opened_at = time.monotonic()
        self.welcome: dict[str, Any] = {}  # the WELCOME body, sent once the link is registered
        self.logs_queued = 0  # its LOGS frames waiting for the ingest task
        # Frames that need the controller's lock wait here, in their order, for the link's
        # own consumer task; the reader goes on reading (and heartbeats are answered).
        self.inbox: asyncio.Queue[Frame | LinkEnded] = asyncio.Queue(maxsize=INBOX_FRAMES)
        self.consumer: asyncio.Task[None] | None = None
        # Frames to the agent go out through one pump task, so no caller (and no lock a
        # caller holds) ever waits on a peer that stopped reading.
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None

    async def send(self, kind: Kind, body: dict[str, Any]) -> bool:
        """Queue a frame for the agent; False when the link is gone. A peer that does not
        take a frame within SEND_TIMEOUT_S, or lets OUTBOX_FRAMES pile up, is dropped."""
        if self.closed:
            return False
        if self._outbox.qsize() >= OUTBOX_FRAMES:
            log.warning("worker %s lets frames pile up; dropping its link", self.worker_id)
            await self.close(1011)
            return False
        self._outbox.put_nowait(self.codec.encode(kind, body))  # seq order = queue order
        if self._pump is None:
            self._pump = asyncio.create_task(self._send_queued())
        return True

    async def _send_queued(self) -> None:
        while True:
            data = await self._outbox.get()
            try:
                async with asyncio.timeout(SEND_TIMEOUT_S):
                    await self.ws.send_bytes(data)
            except TimeoutError:
                log.warning(
                    "worker %s took over %.0fs to accept a frame; dropping its link",
                    self.worker_id,
                    SEND_TIMEOUT_S,
                )
                self.closed = True
                await _close(self.ws, 1011)
                return
            except Exception:  # WebSocketDisconnect, RuntimeError, OSError: it is gone
                self.closed = True
                return
            finally:
                self._outbox.task_done()

    async def flush(self, timeout: float = 1.0) -> None:
        """Wait (bounded) until the queued frames are out."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._outbox.join()

    def abandon(self) -> None:
        """The link is gone (its reader ended): nothing more is sent on it."""
        self.closed = True
        if self._pump is not None:
            self._pump.cancel()

    async def close(self, code: int = 1000) -> None:
        """Close the link (what was queued goes first, within a second); never raises."""
        if not self.closed:
            await self.flush()
            self.closed = True
        await _close(self.ws, code)
        if self._pump is not None:
            self._pump.cancel()


def limit_message_size(ws: WebSocket, size: int) -> bool:
    """Cap the size of the next messages this WebSocket accepts (bigger: closed with 1009).

    uvicorn's sans-I/O websockets protocol reads the cap per frame, so the handshake runs
    under a few KiB and an authenticated link under a frame's maximum. False when the server
    is not that protocol (the cap then stays uvicorn's ``ws_max_size``).
    """
    protocol = getattr(getattr(ws, "_receive", None), "__self__", None)
    conn = getattr(protocol, "conn", None)
    if conn is None or not hasattr(conn, "max_message_size"):
        return False
    conn.max_message_size = size
    return True


async def handshake(
    ws: WebSocket,
    join_secret: str,
    metrics: Metrics,
    tickets: Tickets,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    open_to: Callable[[str, str], str] | None = None,
) -> Link | None:
    """Challenge the agent to prove it holds the join secret; None (link closed) if not.

    ``open_to(job, worker_id)`` answers an AUTH without proof that asks for open admission
    to ``job``: "" when that job's window takes it (the link is then admitted for that job
    alone, see muster.wire), else why not.

    Whatever goes wrong before the proof (garbage, a peer that hangs up, a slow one) is
    counted and logged in one line; the listener goes on serving.
    """
    anonce = wire.new_nonce()
    try:
        await ws.send_bytes(wire.encode_plain(Kind.CHALLENGE, {"nonce": anonce}))
        message = await asyncio.wait_for(ws.receive(), HANDSHAKE_TIMEOUT_S)
        data = message.get("bytes")
        if message["type"] != "websocket.receive" or data is None:
            raise FrameRefused("malformed", "the peer sent no binary AUTH frame")
        if len(data) > PRE_AUTH_MAX_BYTES:
            raise FrameRefused("malformed", f"{len(data)} bytes before authentication")
        body = wire.decode_plain(data, Kind.AUTH)
        worker_id, cnonce = str(body["worker_id"]), str(body["nonce"])
        open_job = body.get("open_job")
        proof = "" if open_job is not None else str(body["proof"])
    except (
        TimeoutError,
        FrameRefused,
        KeyError,
        WebSocketDisconnect,
        RuntimeError,
        OSError,
    ) as exc:
        metrics.frames_refused.labels("auth").inc()
        log.warning("refused a control link: bad handshake (%s: %s)", type(exc).__name__, exc)
        await _close(ws, CLOSE_AUTH_FAILED)
        return None
    secret = join_secret
    if open_job is not None:
        why = (
            open_to(str(open_job), worker_id)
            if open_to is not None
            else "this controller admits no box without the join secret"
        )
        if why:
            metrics.frames_refused.labels("auth").inc()
            log.warning("refused open admission to %r: %s", worker_id[:64], why[:200])
            await _close(ws, CLOSE_AUTH_FAILED)
            return None
        secret = wire.new_nonce()  # the salt: the session's secret, sent in the clear
        try:
            await ws.send_bytes(wire.encode_plain(Kind.ADMIT, {"salt": secret}))
        except (WebSocketDisconnect, RuntimeError, OSError):
            return None
        log.warning(
            "admitted %s to job %s without the join secret (the window's open_admission)",
            worker_id,
            open_job,
        )
    elif not wire.proofs_match(proof, wire.auth_proof(join_secret, cnonce, anonce, worker_id)):
        metrics.frames_refused.labels("auth").inc()
        log.warning("refused a control link from %r: wrong join secret", worker_id[:64])
        await _close(ws, CLOSE_AUTH_FAILED)
        return None
    elif worker_id.startswith(wire.OPEN_PREFIX):
        # (the open- names are the links without the secret's: none may pass for one)
        log.warning("refused a control link from %r: open- names are reserved", worker_id[:64])
        await _close(ws, CLOSE_AUTH_FAILED)
        return None
    # Proven: lift the cap before WELCOME, as the agent's next frames follow it at once (an
    # open link's stays smaller: its frames are a walk-in's, and nobody vouched for it).
    limit_message_size(ws, OPEN_LINK_MAX_BYTES if open_job is not None else LINK_MAX_BYTES)
    key = wire.session_key(secret, cnonce, anonce)
    codec = wire.LinkCodec(key, send=wire.TO_AGENT, receive=wire.TO_CONTROLLER)
    link = Link(ws, worker_id, codec, ticket=tickets.issue(worker_id))
    link.open_job = str(open_job) if open_job is not None else None
    # Sent by welcome(), once the link is registered (or an ERROR instead, if it is not).
    link.welcome = {
        "proof": wire.server_proof(secret, cnonce, anonce),
        "ticket": link.ticket,
        "heartbeat_interval": heartbeat_interval,
        "heartbeat_timeout": heartbeat_timeout,
    }
    return link


MAX_REFUSED_FRAMES = 1024


async def serve_frames(
    link: Link, metrics: Metrics, on_frame: Callable[[Link, Frame], Awaitable[None]]
) -> str:
    """Read frames until the link ends; refused frames are counted and skipped.

    Returns why the link ended (its EOF is the host's exit). A link that sends
    MAX_REFUSED_FRAMES refused frames is ended: an honest agent sends none, and a peer that
    keeps trying is not served for ever (the listener goes on for the others).
    """
    refused = 0

    def refuse(reason: str, why: object) -> bool:
        nonlocal refused
        refused += 1
        metrics.frames_refused.labels(reason).inc()
        if refused <= 10 or refused % 100 == 0:  # its log is not the attacker's to fill
            log.warning("worker %s: %s (%d refused on this link)", link.worker_id, why, refused)
        return refused >= MAX_REFUSED_FRAMES

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
            if refuse("malformed", "a text message on the control link"):
                return await _refused_too_often(link, refused)
            continue
        try:
            frame = link.codec.decode(data)
        except FrameRefused as exc:
            if refuse(exc.reason, exc):
                return await _refused_too_often(link, refused)
            continue
        link.last_seen = time.monotonic()
        try:
            await on_frame(link, frame)
        except (KeyError, TypeError, ValueError) as exc:  # a well-MAC'd frame with a bad body
            if refuse("malformed", f"{frame.kind.name} frame with a bad body: {exc!r}"):
                return await _refused_too_often(link, refused)
        except MusterError as exc:
            log.warning("worker %s: %s frame refused: %s", link.worker_id, frame.kind.name, exc)


async def _refused_too_often(link: Link, refused: int) -> str:
    await _close(link.ws, 1008)  # policy violation
    return f"closed after {refused} refused frames"


async def _close(ws: WebSocket, code: int) -> None:
    """Close, whatever state the socket is in (starlette raises WebSocketDisconnect, or
    RuntimeError, on one the peer already dropped)."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await ws.close(code)
