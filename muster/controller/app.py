"""The controller's one port: HTTP API, agents' control links, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import Depends, FastAPI, Request, Response, WebSocket
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from muster.controller import dashboard
from muster.controller.api import agents, router, users
from muster.controller.auth import Guard, Tickets, is_loopback, require_user
from muster.controller.credentials import credentials
from muster.controller.files import FileStore
from muster.controller.gangs import Controller
from muster.controller.lease import ControllerLease
from muster.controller.links import (
    CLOSE_REFUSED,
    PRE_AUTH_MAX_BYTES,
    handshake,
    limit_message_size,
    serve_frames,
)
from muster.controller.metrics import Metrics
from muster.controller.reflector import start_reflector
from muster.errors import MusterError, SpecError
from muster.spec import PathClass
from muster.store import Store
from muster.wire import Kind

log = logging.getLogger("muster.controller")


@dataclass
class ControllerConfig:
    store: Store
    artifacts: Path
    host: str = "127.0.0.1"
    heartbeat_interval: float = 3.0
    heartbeat_timeout: float = 15.0
    tls: bool = False
    max_bundle_bytes: int = 512 << 20
    max_artifact_bytes: int = 8 << 30
    restart_grace: float | None = None  # default: 3 heartbeat timeouts
    port: int = 0  # for the lease record: who holds this database
    relays: tuple[tuple[str, int], ...] = ()  # `muster relay`s for the relayed path
    relay_secret: bytes = b""  # the secret they share with this controller
    relay_max_gbps: float = 1.0  # the most one relayed gang may send through them


def create_app(config: ControllerConfig) -> FastAPI:
    store = config.store
    lease = ControllerLease(store, config.port)
    lease.acquire()
    # No agent is connected yet: each comes back when it dials in. Jobs caught mid-run are
    # rebuilt and held for the restart grace while their agents dial back (restore_runs).
    store.mark_all_offline()
    metrics = Metrics()
    tickets = Tickets()
    controller = Controller(
        store, metrics, config.heartbeat_timeout, tickets, restart_grace=config.restart_grace
    )
    if config.relays:
        controller.relays, controller.relay_secret = config.relays, config.relay_secret
        controller.relay_max_gbps = config.relay_max_gbps
        controller.supported_paths = controller.supported_paths | {PathClass.RELAYED}
    creds = credentials(store)
    needs_auth = config.tls or not is_loopback(config.host)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(controller.writer.run())]
        await controller.restore_runs()
        tasks += [
            asyncio.create_task(controller.supervise()),
            asyncio.create_task(controller.logs.run()),
            asyncio.create_task(lease.keep()),
        ]
        if controller.relays:
            tasks.append(asyncio.create_task(controller.relay_usage.run()))
        controller.request_pass()
        reflector = await start_reflector(config.host, config.port, metrics)
        try:
            yield
        finally:
            if reflector is not None:
                reflector.close()
            controller.exiting = True  # the links that close now are not hosts lost
            for task in tasks[1:]:  # supervision and ingest first: nothing new is decided
                task.cancel()
            await controller.writer.drain()
            tasks[0].cancel()
            for link in list(controller.links.values()):
                await link.close(1001)
            await asyncio.to_thread(lease.release)

    app = FastAPI(title="muster", version="0.1.0", lifespan=lifespan)
    app.state.store = store
    app.state.controller = controller
    app.state.files = FileStore(
        config.artifacts,
        max_bundle_bytes=config.max_bundle_bytes,
        max_artifact_bytes=config.max_artifact_bytes,
    )
    app.state.metrics = metrics
    app.state.guard = Guard(creds, tickets, users_need_token=needs_auth)
    app.include_router(router)
    app.include_router(users)
    app.include_router(agents)
    app.include_router(dashboard.router)

    @app.exception_handler(MusterError)
    async def muster_error(_request: Request, exc: MusterError) -> JSONResponse:
        body: dict[str, object] = {"error": str(exc), "kind": type(exc).__name__}
        if isinstance(exc, SpecError):
            body["errors"] = [{"field": e.field, "message": e.message} for e in exc.errors]
        return JSONResponse(body, status_code=exc.http_status)

    @app.get("/metrics", dependencies=[Depends(require_user)])
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    warned_cap: list[bool] = []

    @app.websocket("/v1/agents/link")
    async def agent_link(ws: WebSocket) -> None:
        # Until the agent has proven it holds the join secret, a frame is a few KiB at most.
        if not limit_message_size(ws, PRE_AUTH_MAX_BYTES) and not warned_cap:
            warned_cap.append(True)
            log.warning(
                "this WebSocket server has no per-frame cap: frames before authentication "
                "are refused past %d bytes only once read (run under muster server)",
                PRE_AUTH_MAX_BYTES,
            )
        await ws.accept()
        link = await handshake(
            ws,
            creds.join_secret,
            metrics,
            tickets,
            config.heartbeat_interval,
            config.heartbeat_timeout,
            open_to=controller.open_to,
        )
        if link is None:
            return
        if not await controller.link_up(link):
            # The agent's first MAC'd frame is this ERROR, not WELCOME: it sends nothing
            # on this link (a persistent agent dials again).
            tickets.revoke(link.ticket)
            await link.send(
                Kind.ERROR,
                {
                    "message": f"worker id {link.worker_id!r} is already connected; "
                    "give this agent another --name"
                },
            )
            await link.close(CLOSE_REFUSED)
            return
        if not await link.send(Kind.WELCOME, link.welcome):
            await controller.link_down(link, "the link closed before WELCOME")
            return
        log.info("worker %s connected", link.worker_id)
        why = "control link closed"
        try:
            why = await serve_frames(link, metrics, controller.on_frame)
        finally:
            await controller.link_down(link, why)
            log.info("worker %s disconnected: %s", link.worker_id, why)

    return app
