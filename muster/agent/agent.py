"""The agent: dials the controller, proves it holds the join secret, keeps the link for life.

The link's EOF is this host's exit as the controller sees it; heartbeats every few seconds
catch a link that hangs without closing. With ``persist`` the agent dials again after a
lost link, backing off 2 s doubling to 15 s (with jitter), forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import ssl
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import httpx
import websockets
from websockets.asyncio.client import ClientConnection, connect

from muster import wire
from muster.agent import rendezvous
from muster.agent.capture import Line
from muster.agent.datasource import SshfsSource
from muster.agent.launcher import MemberRun
from muster.agent.network import GangNetwork
from muster.agent.prepare import NotReady, Preparation
from muster.agent.rendezvous import Holds
from muster.agent.retention import remove_stale_job_dirs
from muster.agent.stacks import dump_ranks, flight_ranks
from muster.agent.tunnel import SshTunnel
from muster.client import pinned_ssl_context
from muster.errors import InfrastructureError
from muster.net.firewall import agent_key
from muster.spec import MESH_INTERFACE, WorkerInventory
from muster.wire import Frame, FrameRefused, Kind

log = logging.getLogger("muster.agent")

BATCH_LINES = 4000
FLUSH_S = 0.05
MAX_UNACKED = 32  # batches in flight before capture waits: nothing is dropped
STACK_TIMEOUT_S = 15.0  # one rank's py-spy dump at most (the request may ask less)
FLIGHT_TIMEOUT_S = 3.0  # one rank's flight recorder (its own server thread answers at once)
# Lines held in memory (waiting or unacked) before the capture stops reading the ranks' files:
# while the controller is away, the rest waits on disk where torchrun wrote it.
MAX_BACKLOG_LINES = 200_000


class AuthRefused(Exception):
    """The controller refused this agent's join secret; re-dialing will not help."""


class LinkRefused(Exception):
    """The controller refused this session (say, the name is still connected): a persistent
    agent dials again; a one-shot agent exits."""


class WalkInEnded(Exception):
    """A walk-in's job window has nothing more for it: its job ended (code 0) or it was
    refused at the door (code 2)."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


class ControllerSilent(Exception):
    """No frame from the controller for longer than its heartbeat timeout."""


@dataclass
class AgentConfig:
    controller: str  # http://host:port
    token: str
    worker_id: str
    work_dir: Path
    python: str
    inventory: Callable[[], WorkerInventory]
    fingerprint: str | None = None  # sha256 of the controller's certificate, from the token
    persist: bool = False
    grace: float = 10.0
    # Re-dial backoff: doubling from the first to the second, with +-20% jitter. The most
    # stays well under the controller's restart grace (3 heartbeat timeouts, 45 s).
    backoff: tuple[float, float] = (2.0, 15.0)
    # How long the member watchdogs let this agent go without a beat before they end the
    # members' process trees themselves (an agent stopped by SIGSTOP, or wedged).
    watchdog_timeout: float = 30.0
    # Job directories untouched this long (and not running here) are removed every hour.
    retention: timedelta = timedelta(0)
    # On the direct path, a peer this agent has received nothing from for this long has
    # lost its path (NET_PATH: the job's NetworkDegraded). Idle tunnels carry a keepalive
    # every 25 s, so it is more than two of those.
    path_timeout: float = 60.0
    handshake_timeout: float = 30.0  # a new device's wait for every peer's first handshake
    direct_mtu: int | None = None  # the most its direct-path device takes (--direct-mtu)
    uplink: str | None = None  # the interface holding its advertise address, if one does
    # The name of this agent's WireGuard device (claimed by `muster agent`, one per agent).
    device: str = MESH_INTERFACE
    # `muster join --ssh`: each dial goes through a fresh OpenSSH forward (``controller`` is
    # then its local end).
    tunnel: SshTunnel | None = None
    # A walk-in's own facts for its ranks (MUSTER_DATA_PATH, MUSTER_GPU_RAM_SHARE).
    host_env: dict[str, str] = field(default_factory=dict)
    # `muster join --data-source sshfs://...`: its data root, mounted again before each dial
    # when it went away.
    data_source: SshfsSource | None = None
    # `muster join`: the GPU gate and the stage directory, checked before each dial.
    prepare: Preparation | None = None
    # `muster join --open-admission`: no join secret (``token`` is empty); this job's window
    # admits the box (its worker id is then open-<job>-<host>).
    open_job: str | None = None


@dataclass
class _Shipper:
    """Batches captured lines per job; keeps each batch until the controller acks it."""

    pending: dict[str, deque[Line]] = field(default_factory=dict)
    unacked: dict[int, tuple[str, list[Line]]] = field(default_factory=dict)
    next_batch: int = 1
    # Set when lines are added: the flush wakes for them, not on a clock (an agent whose
    # ranks are quiet does no work for their logs).
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def backlog(self) -> int:
        """Lines held: waiting to be sent, or sent and not yet acked."""
        waiting = sum(len(q) for q in self.pending.values())
        return waiting + sum(len(lines) for _job, lines in self.unacked.values())

    def held(self, job: str) -> int:
        """The job's lines not yet stored by the controller (waiting or unacked)."""
        waiting = len(self.pending.get(job) or ())
        return waiting + sum(len(lines) for j, lines in self.unacked.values() if j == job)

    def add(self, job: str, lines: list[Line]) -> None:
        queue = self.pending.get(job)
        if queue is None:
            queue = self.pending[job] = deque()
        queue.extend(lines)
        if lines:
            self.ready.set()

    def next(self) -> tuple[int, str, list[Line]] | None:
        """The next batch to send, now counted as unacked; None when nothing waits."""
        for job, lines in self.pending.items():
            if lines:
                chunk = [lines.popleft() for _ in range(min(BATCH_LINES, len(lines)))]
                batch = self.next_batch
                self.next_batch += 1
                self.unacked[batch] = (job, chunk)
                return batch, job, chunk
        self.pending = {}
        return None


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.members: dict[str, MemberRun] = {}
        self.holds = Holds()  # node 0's rendezvous ports, until torchrun takes them
        self.shipper = _Shipper()
        self.codec: wire.LinkCodec | None = None
        self.ws: ClientConnection | None = None
        self.ticket = ""
        self.heartbeat_interval = 3.0
        self._send_lock = asyncio.Lock()
        self._acked = asyncio.Event()
        self.tls: ssl.SSLContext | None = None
        self.heartbeat_timeout = 15.0
        self.last_heard = time.monotonic()
        self.welcomed = False
        self.inventory: WorkerInventory | None = None
        self.link_up = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        self.alive_file = config.work_dir / ".agent-alive"
        self.network = GangNetwork(
            self.send,
            config.work_dir / ".net",
            _reflector(config),
            agent_key(config.worker_id, config.work_dir),
            path_timeout=config.path_timeout,
            handshake_timeout=config.handshake_timeout,
            direct_mtu=config.direct_mtu,
            uplink=config.uplink,
            device=config.device,
            python=config.python,
        )

    # ---- dialing -------------------------------------------------------------------------

    async def run(self) -> int:
        """Serve until the link ends (or forever with persist), or SIGTERM/SIGINT; on the way
        out every member's process tree is stopped. Returns an exit code."""
        await self.network.sweep_rules()  # a crashed run's rules go before any job
        session = asyncio.create_task(self._serve())
        beats = asyncio.create_task(self._beat_for_watchdogs())
        collector = asyncio.create_task(self._collect_work_dirs())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, session.cancel)
        try:
            return await session
        except asyncio.CancelledError:
            log.info("stopping: ending every member's processes")
            await self._stop_all("the agent is shutting down")
            tasks = [m.task for m in self.members.values() if m.task is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=self.config.grace + 5)
            return 0
        finally:
            beats.cancel()
            collector.cancel()
            if self.config.tunnel is not None:
                await self.config.tunnel.close()
            source = self.config.data_source
            if source is not None and source.mounted_here:
                await asyncio.to_thread(source.unmount)
            await self.network.down(closing=True)
            await self.network.sweep_rules()

    async def _collect_work_dirs(self, every: float = 3600.0) -> None:
        """Retention: every hour, remove the stale job directories of ended members."""
        if not self.config.retention:
            return
        while True:
            await asyncio.sleep(every)
            try:
                await asyncio.to_thread(
                    remove_stale_job_dirs,
                    self.config.work_dir,
                    self.config.retention,
                    running=set(self.members),
                )
            except Exception:
                log.exception("collecting old job directories failed; trying again later")

    async def _beat_for_watchdogs(self, every: float = 1.0) -> None:
        """Touch the alive file: each member's watchdog ends the member's process tree when
        it goes stale (this agent hung, or was stopped), link or no link."""
        while True:
            try:
                self.alive_file.parent.mkdir(parents=True, exist_ok=True)
                self.alive_file.touch()
            except OSError as exc:
                log.warning("cannot touch %s: %s", self.alive_file, exc)
            await asyncio.sleep(every)

    async def _serve(self) -> int:
        # What this machine offers, probed once (importing torch takes seconds).
        self.inventory = await asyncio.to_thread(self.config.inventory)
        delay = self.config.backoff[0]
        while True:
            self.welcomed = False
            try:
                if self.config.data_source is not None:
                    await asyncio.to_thread(self.config.data_source.ensure)
                if self.config.prepare is not None and not self.members:
                    # (a box re-dialling to report running ranks is past the door)
                    await asyncio.to_thread(self.config.prepare.check)
                    self.inventory = self.config.prepare.stamp(self.inventory)
                if self.config.tunnel is not None:
                    await self.config.tunnel.open()
                    scheme = urlparse(self.config.controller).scheme or "http"
                    self.config.controller = self.config.tunnel.url(scheme)  # its port may move
                await self._session()
                reason = "the controller closed the link"
            except AuthRefused as exc:
                log.error("%s", exc)
                return 2
            except NotReady as exc:
                if not self.config.persist:
                    log.error("not dialing: %s", exc)
                    await self._stop_all(str(exc))
                    return 2
                reason = f"not ready to walk in: {exc}"
            except WalkInEnded as exc:
                log.log(logging.INFO if exc.code == 0 else logging.ERROR, "%s", exc)
                await self._stop_all(str(exc))
                return exc.code
            except (
                OSError,
                websockets.exceptions.WebSocketException,
                InfrastructureError,
                FrameRefused,
                TimeoutError,
                LinkRefused,
                ControllerSilent,
            ) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            if self.welcomed:
                # A session that was up resets the backoff: an old outage does not slow the
                # next re-dial.
                delay = self.config.backoff[0]
            if not self.config.persist:
                log.error("control link ended: %s", reason)
                await self._stop_all("the control link ended")
                return 1
            wait = delay * random.uniform(0.8, 1.2)
            if not reason.startswith("not ready"):
                reason = f"control link ended ({reason})"
            log.warning("%s; dialing again in %.0fs", reason, wait)
            await asyncio.sleep(wait)
            delay = min(delay * 2, self.config.backoff[1])

    def _ws_url(self) -> str:
        url = urlparse(self.config.controller)
        scheme = {"https": "wss", "http": "ws"}.get(url.scheme, url.scheme)
        return urlunparse((scheme, url.netloc, "/v1/agents/link", "", "", ""))

    def _ssl(self) -> ssl.SSLContext | None:
        if not self.config.controller.startswith("https://"):
            return None
        return pinned_ssl_context(self.config.controller, self.config.fingerprint)

    async def _session(self) -> None:
        self.tls = await asyncio.to_thread(self._ssl)
        async with connect(
            self._ws_url(),
            max_size=64 * 1024 * 1024,
            ping_interval=None,
            open_timeout=10,
            ssl=self.tls,
        ) as ws:
            first = await asyncio.wait_for(ws.recv(), 10)
            challenge = wire.decode_plain(_bytes(first), Kind.CHALLENGE)
            cnonce, anonce = wire.new_nonce(), str(challenge["nonce"])
            secret = await self._authenticate(ws, cnonce, anonce)
            codec = wire.LinkCodec(
                wire.session_key(secret, cnonce, anonce),
                send=wire.TO_CONTROLLER,
                receive=wire.TO_AGENT,
            )
            try:
                welcome = codec.decode(_bytes(await asyncio.wait_for(ws.recv(), 10)))
            except websockets.exceptions.ConnectionClosed as exc:
                raise AuthRefused(
                    "the controller refused this agent: check its join string (--token-file or "
                    "MUSTER_TOKEN; `muster token` on the controller prints it)"
                ) from exc
            except FrameRefused as exc:
                raise AuthRefused(f"the controller's answer failed its check: {exc}") from exc
            if welcome.kind is Kind.ERROR:  # say, this name is still connected
                raise LinkRefused(f"the controller refused: {welcome.body.get('message')}")
            if welcome.kind is not Kind.WELCOME or not wire.proofs_match(
                str(welcome.body.get("proof", "")),
                wire.server_proof(secret, cnonce, anonce),
            ):
                raise AuthRefused("the controller could not prove it holds the join secret")
            self.codec, self.ws = codec, ws
            self.welcomed = True
            self.last_heard = time.monotonic()
            self.ticket = str(welcome.body["ticket"])
            self.heartbeat_interval = float(welcome.body.get("heartbeat_interval", 3.0))
            self.heartbeat_timeout = float(
                welcome.body.get("heartbeat_timeout", 5 * self.heartbeat_interval)
            )
            for member in self.members.values():  # uploads under way use the new ticket
                member.http.headers["Authorization"] = f"Ticket {self.ticket}"
            self.link_up.set()
            # A gang network no member here uses ended while this agent was away.
            self._in_background(self.network.keep_only(set(self.members)))
            self.network.relinked()
            # Beat and read from the first moment: the set-up below may take a while.
            tasks = [asyncio.create_task(self._heartbeats())]
            tasks.append(asyncio.create_task(self._after_welcome(tasks)))
            try:
                async for message in ws:
                    self.last_heard = time.monotonic()
                    frame = codec.decode(_bytes(message))
                    try:
                        await self._on_frame(frame)
                    except (KeyError, TypeError, ValueError) as exc:  # a bad body: skip it
                        log.warning("a %s frame with a bad body: %r", frame.kind.name, exc)
                for task in tasks:  # the heartbeat task may have ended the link: say why
                    if task.done() and not task.cancelled() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
            finally:
                self.link_up.clear()
                for task in tasks:
                    task.cancel()
                self.codec = self.ws = None

    async def _authenticate(self, ws: ClientConnection, cnonce: str, anonce: str) -> str:
        """Send AUTH; returns the secret the session key comes from: the join secret, or
        with open admission the salt the controller handed out."""
        worker = self.config.worker_id
        job = self.config.open_job
        if job is None:
            proof = wire.auth_proof(self.config.token, cnonce, anonce, worker)
            body = {"worker_id": worker, "nonce": cnonce, "proof": proof}
            await ws.send(wire.encode_plain(Kind.AUTH, body))
            return self.config.token
        body = {"worker_id": worker, "nonce": cnonce, "open_job": job}
        await ws.send(wire.encode_plain(Kind.AUTH, body))
        try:
            admit = wire.decode_plain(_bytes(await asyncio.wait_for(ws.recv(), 10)), Kind.ADMIT)
        except websockets.exceptions.ConnectionClosed as exc:
            said = (
                f"job {job} has no open join window that admits boxes without the join "
                "string (open_admission); walk in with --token-file instead"
            )
            if self.config.persist:  # its window may not be open yet
                raise LinkRefused(said) from exc
            raise AuthRefused(said) from exc
        except (FrameRefused, KeyError) as exc:
            raise AuthRefused(f"the controller's ADMIT failed its check: {exc}") from exc
        return str(admit["salt"])

    async def _after_welcome(self, tasks: list[asyncio.Task[None]]) -> None:
        """Reports the last link missed, what this agent holds, the unacked log batches;
        then ship logs."""
        for member in list(self.members.values()):
            await member.resend()
        await self._forget_settled()
        if self.inventory is None:
            self.inventory = await asyncio.to_thread(self.config.inventory)
        await self._send_inventory()
        log.info("connected to %s as %s", self.config.controller, self.config.worker_id)
        for batch, (job, lines) in sorted(self.shipper.unacked.items()):
            await self.send(Kind.LOGS, {"job": job, "batch": batch, "lines": lines})
        tasks.append(asyncio.create_task(self._flush_logs()))

    async def send(self, kind: Kind, body: dict[str, Any]) -> bool:
        """Send a frame on the link; False when there is none (or it broke meanwhile)."""
        async with self._send_lock:
            if self.ws is None or self.codec is None:
                return False
            try:
                await asyncio.wait_for(self.ws.send(self.codec.encode(kind, body)), 30)
                return True
            except (websockets.exceptions.ConnectionClosed, TimeoutError):
                return False

    async def _send_inventory(self) -> None:
        """What this machine offers, and every member it holds: alive, or how it exited."""
        if self.inventory is None:
            return
        await self.send(
            Kind.INVENTORY,
            {
                "inventory": self.inventory.model_dump(mode="json"),
                "running": sorted(self.members),
                "members": [m.report_for_inventory() for m in self.members.values()],
            },
        )

    async def _forget_settled(self) -> None:
        forgot = False
        for job, member in list(self.members.items()):
            # Called from the reader, a member's task and a new link's set-up: only the
            # first to see it settled forgets it.
            if member.settled and self.members.get(job) is member:
                del self.members[job]
                await member.http.aclose()
                forgot = True
        if forgot:
            await self._send_inventory()

    async def _heartbeats(self) -> None:
        """Beat every interval; a controller silent past its heartbeat timeout (every beat
        is acked) is taken as dead or wedged and the link is dropped."""
        while True:
            silent = time.monotonic() - self.last_heard
            if silent > self.heartbeat_timeout:
                log.warning("no frame from the controller for %.0fs; dropping the link", silent)
                if self.ws is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self.ws.close(1011), 1.0)
                    self.ws.transport.abort()  # a wedged peer may never answer the close
                raise ControllerSilent(f"no frame from the controller for {silent:.0f}s")
            await self.send(Kind.HEARTBEAT, {"time": time.time()})
            await asyncio.sleep(self.heartbeat_interval)

    async def _flush_logs(self) -> None:
        if any(self.shipper.pending.values()):  # held while there was no link
            self.shipper.ready.set()
        while True:
            await self.shipper.ready.wait()
            await asyncio.sleep(FLUSH_S)  # lines come in bursts: one batch for a burst
            self.shipper.ready.clear()
            while True:
                # At most MAX_UNACKED batches in flight: the ranks' lines wait here (in
                # memory) rather than anything being dropped.
                while len(self.shipper.unacked) >= MAX_UNACKED:
                    self._acked.clear()
                    await self._acked.wait()
                taken = self.shipper.next()
                if taken is None:
                    break
                batch, job, lines = taken
                await self.send(Kind.LOGS, {"job": job, "batch": batch, "lines": lines})

    # ---- orders from the controller ------------------------------------------------------

    async def _on_frame(self, frame: Frame) -> None:
        body = frame.body
        if frame.kind is Kind.REPORT_ACK:
            member = self.members.get(str(body.get("job")))
            if member is not None and body.get("epoch") == member.epoch:
                with contextlib.suppress(TypeError, ValueError):  # not a kind it knows
                    member.acked(Kind(int(body.get("report", 0))))
                await self._forget_settled()
        elif frame.kind is Kind.LOGS_ACK:
            self.shipper.unacked.pop(int(body.get("batch") or 0), None)
            self._acked.set()
        elif frame.kind is Kind.HEARTBEAT_ACK:
            for job in body.get("stop", []):
                self._in_background(self._stop(str(job), "the job ended (heartbeat)"))
        elif frame.kind is Kind.NET_SETUP:
            self._in_background(self.network.setup(body))
        elif frame.kind is Kind.NET_PEERS:
            self._in_background(self.network.set_peers(body))
        elif frame.kind is Kind.PROBE_LISTEN:
            await self.network.probe_listen(body)
        elif frame.kind is Kind.PROBE_RUN:
            self._in_background(self.network.probe_run(body))
        elif frame.kind is Kind.PREPARE_RENDEZVOUS:
            await self._prepare(body)
        elif frame.kind is Kind.MASTER_CHECK:
            self._in_background(self._master_check(body))
        elif frame.kind is Kind.RELAY_TICKETS_ISSUED:
            self.network.add_tickets(body)
        elif frame.kind is Kind.ASSIGN:
            await self.network.probe_close()  # every pair was measured before any ASSIGN
            self._start(body)
        elif frame.kind is Kind.STOP:
            # A stop takes up to the grace: never in the reader, which must go on reading.
            self._in_background(
                self._stop(str(body.get("job")), str(body.get("reason", "stopped")), body)
            )
        elif frame.kind is Kind.JOIN_REPLY:
            self._join_reply(body)
        elif frame.kind is Kind.STACKS:
            self._in_background(self._stacks(body))
        elif frame.kind is Kind.ERROR:
            raise LinkRefused(f"the controller refused: {body.get('message')}")

    async def _stacks(self, body: dict[str, Any]) -> None:
        """STACKS: py-spy's dump of this member's ranks (bounded), as STACKS_DONE."""
        job, epoch = str(body.get("job")), body.get("epoch")
        answer: dict[str, Any] = {"request": body.get("request"), "job": job, "stacks": {}}
        member = self.members.get(job)
        answer["node_rank"] = member.node if member is not None else body.get("node_rank")
        ranks = body.get("ranks")
        timeout = min(float(body.get("timeout") or STACK_TIMEOUT_S), STACK_TIMEOUT_S)
        if member is None or member.epoch != epoch or member.proc is None or member.finished:
            answer["error"] = f"no running member of job {job} (epoch {epoch}) here"
        else:
            found = await dump_ranks(
                member.proc.pid,
                [int(r) for r in ranks] if isinstance(ranks, list) else None,
                bool(body.get("native")),
                timeout,
            )
            answer["stacks"] = {str(rank): text for rank, text in found.items()}
            where = await flight_ranks(member.diag_dir, found, min(timeout, FLIGHT_TIMEOUT_S))
            answer["collectives"] = {str(rank): w for rank, w in where.items()}
        await self.send(Kind.STACKS_DONE, answer)

    def _join_reply(self, body: dict[str, Any]) -> None:
        """The window's answer to this walk-in (muster join)."""
        job = str(body.get("job"))
        if body.get("admitted"):
            first, count = int(body.get("first_rank", 0)), int(body.get("ranks", 0))
            log.info(
                "walked in to job %s: ranks %d-%d; the window is %s",
                job,
                first,
                first + count - 1,
                body.get("phase"),
            )
            return
        reason = str(body.get("reason") or "refused")
        if body.get("waiting"):  # walked in for any job: this window is not one for it
            log.warning("not admitted to job %s (%s); waiting for another window", job, reason)
            return
        if body.get("ended"):
            code = 0 if body.get("state") == "succeeded" else 1
            join = self.inventory.join if self.inventory is not None else None
            if self.config.persist and join is not None and join.job is None:
                # A fleet box walked in for any job: it waits for the next run.
                raise LinkRefused(f"job {job} is over ({reason}); dialing again for the next run")
            raise WalkInEnded(code, f"job {job} is over ({reason}); leaving")
        if self.config.persist:
            raise LinkRefused(f"the window of job {job} refused this box: {reason}")
        raise WalkInEnded(2, f"the window of job {job} refused this box: {reason}")

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _prepare(self, body: dict[str, Any]) -> None:
        addr = str(body["addr"])
        try:
            port = await self.holds.hold(str(body["job"]), body["epoch"], addr, body.get("port"))
        except OSError as exc:
            await self.send(
                Kind.MEMBER_EXITED,
                {
                    "job": body["job"],
                    "epoch": body["epoch"],
                    "node_rank": 0,
                    "exit_code": 127,
                    "tail": [f"muster agent: cannot pick a rendezvous port: {exc}"],
                },
            )
            return
        await self.send(
            Kind.RENDEZVOUS_READY,
            {
                "job": body["job"],
                "epoch": body["epoch"],
                "node_rank": 0,
                "addr": addr,
                "port": port,
            },
        )

    async def _master_check(self, body: dict[str, Any]) -> None:
        """MASTER_CHECK: dial node 0's held port and read the job Python's versions."""
        addr = body.get("addr")
        relayed = self.network.relayed.shim_for(str(body.get("job")))  # through the relays
        found = await rendezvous.check(
            self.config.python,
            str(addr) if addr else None,
            int(body.get("port") or 0),
            via=relayed.socks if relayed is not None else None,
        )
        ids = {k: body.get(k) for k in ("job", "epoch", "node_rank")}
        await self.send(Kind.MASTER_CHECKED, {**ids, **found})

    def _start(self, assignment: dict[str, Any]) -> None:
        job = str(assignment["job"])
        # Node 0: torchrun's store takes the port next. Let go now, not after the bundle's
        # fetch: the other members' ranks may dial it meanwhile and must meet a refusal
        # (which they retry), not a held socket that closes under them.
        self.holds.release(job)
        http = httpx.AsyncClient(
            base_url=self.config.controller,
            timeout=60,
            headers={"Authorization": f"Ticket {self.ticket}"},
            verify=self.tls if self.tls is not None else True,
        )
        member = MemberRun(
            assignment,
            work_dir=self.config.work_dir,
            python=self.config.python,
            http=http,
            send=self.send,
            emit=lambda lines: self.shipper.add(job, lines),
            grace=self.config.grace,
            alive_file=self.alive_file,
            watchdog_timeout=self.heartbeat_timeout,
            link_up=self.link_up,
            may_read=lambda: self.shipper.backlog() < MAX_BACKLOG_LINES,
            host_env=self.config.host_env,
            release_port=lambda: self.holds.release(job),
            shim=self.network.relayed.shim_for(job),
            logs_held=lambda: self.shipper.held(job),
        )
        if job in self.members:
            log.warning("ignoring a second ASSIGN for %s", job)
            return
        self.members[job] = member

        async def run() -> None:
            watch = None
            if assignment.get("path") == "direct" and len(assignment.get("addresses") or ()) > 1:
                watch = asyncio.create_task(self.network.watch_paths(member.ids()))
            try:
                member.group = await self.network.guard(assignment)
                member.guarded = job in self.network.firewall.gangs
                await member.run()
            except Exception as exc:
                log.exception("member of %s failed", job)
                await member.report(
                    Kind.MEMBER_EXITED,
                    {**member.ids(), "exit_code": 1, "tail": [f"muster agent error: {exc}"]},
                )
            finally:
                self.holds.release(job)  # (let go before torchrun started; or it never did)
                if watch is not None:
                    watch.cancel()
                member.finished = True
                await self.network.down(job)  # the gang's device goes with the member
                await self.network.unguard(job)
                # Every process of the member is gone. Once the controller has acked its
                # reports the agent forgets it (and says so, so the worker is freed);
                # until then it stays, and the next link carries them again.
                await self._forget_settled()

        member.task = asyncio.create_task(run())

    async def _stop(self, job: str, reason: str, order: dict[str, Any] | None = None) -> None:
        member = self.members.get(job)
        epoch = order.get("epoch") if order is not None else None
        self.holds.release(job, epoch)
        if member is not None and (epoch is None or epoch == member.epoch):
            await member.stop(reason)
            return
        # A gang that ended before its member was assigned: its device and probe endpoint
        # (of the STOP's epoch: a fenced epoch's STOP leaves the next epoch's alone).
        await self.network.down(job, epoch)
        await self.network.probe_close(job, epoch)
        if order is not None and order.get("node_rank") is not None:
            # Nothing of that member runs here (never assigned, or already over): say so,
            # so the controller can give this worker back to the pool.
            await self.send(
                Kind.MEMBER_EXITED,
                {
                    "job": job,
                    "epoch": order.get("epoch"),
                    "node_rank": order["node_rank"],
                    "exit_code": 143,
                    "signal": "SIGTERM",
                    "absent": True,
                },
            )

    async def _stop_all(self, reason: str) -> None:
        self.holds.release_all()
        for member in list(self.members.values()):
            await member.stop(reason)


def _reflector(config: AgentConfig) -> tuple[str, int] | None:
    """The controller's UDP reflector: its host, on its port number."""
    url = urlparse(config.controller)
    if not url.hostname or config.tunnel is not None:  # ssh forwards no UDP
        return None
    return url.hostname, url.port or (443 if url.scheme == "https" else 80)


def _bytes(message: str | bytes) -> bytes:
    if isinstance(message, str):
        raise FrameRefused("malformed", "text message on the control link")
    return message
