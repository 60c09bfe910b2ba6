"""The agent's side of a gang's network: the WireGuard device of the direct path, the
probe's endpoint, and the rendezvous port's rules, all next to the job.

One device (``muster0``) per agent, for one gang epoch at a time: NET_SETUP makes it (an
older one first comes down), NET_PEERS gives it the gang's peers, and it comes down when the
member ends, when a STOP arrives for its job, and when the agent stops. On node 0 of a gang
that spans hosts, the rendezvous port takes TCP from the gang's members only while the
member runs (``muster.net.firewall``); the agent's rules are swept when it starts and
stops. Device and rule commands run in a thread: the link's reader never waits on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from muster.agent.fallback import Fallback
from muster.agent.relayed import RelayedNetwork, TicketStock
from muster.net import cgroup, firewall
from muster.net.endpoint import public_endpoint
from muster.net.probe import (
    LISTEN_FOR_S,
    READINESS_WINDOW_S,
    PairResult,
    ProbeListener,
    probe_peers,
    route_of,
)
from muster.net.wireguard import (
    Device,
    Peer,
    device_unavailable,
    interface_mtu,
    uplink_mtu,
)
from muster.plan import MESH_MTU, MESH_PREFIX, device_mtu
from muster.spec import MESH_INTERFACE, PathClass
from muster.wire import Kind

log = logging.getLogger("muster.agent")

# WireGuard retries a handshake every 5 s; a hole punched through two NATs may take a few.
HANDSHAKE_TIMEOUT_S = 30.0
HANDSHAKE_POLL_S = 0.2
PATH_WATCH_EVERY_S = 5.0  # how often a running member's direct paths are looked at

Send = Callable[[Kind, dict[str, Any]], Awaitable[object]]


class GangNetwork:
    def __init__(
        self,
        send: Send,
        log_dir: Path,
        reflector: tuple[str, int] | None,
        key: str = "",
        *,
        path_timeout: float = 60.0,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
        direct_mtu: int | None = None,
        uplink: str | None = None,
        device: str = MESH_INTERFACE,
        python: str = "python3",
    ) -> None:
        self.send = send
        self.relayed = RelayedNetwork(send, python)  # the relayed path's endpoints
        self.fallback: Fallback | None = None  # a direct gang's way through the relays
        self.fallback_tickets: TicketStock | None = None
        self.peer_nodes: dict[str, int] = {}  # mesh address -> node rank (NET_PEERS)
        self.path_timeout = path_timeout
        self.handshake_timeout = handshake_timeout
        self.direct_mtu = direct_mtu  # the operator's cap on the device's MTU
        self.uplink = uplink  # the interface peers reach this host on (its advertise address)
        self.firewall = firewall.Firewall(key)  # key: firewall.agent_key
        self.firewall_id = key
        self.groups: cgroup.RankGroups | None = None  # where the ranks' cgroups are made
        self.no_groups: str | None = None  # why there are none (found at the first sweep)
        self.said_no_groups = False
        self.rank_groups: dict[str, cgroup.RankGroup] = {}  # job -> its ranks' group
        self.no_rules: str | None = None  # why this host takes no rules (checked at sweep)
        self.reflector = reflector  # the controller's host and port number (UDP)
        self.device = Device(device, log_dir=log_dir)
        self.owner: tuple[str, int] | None = None  # (job, epoch) whose device is up
        self._lock = asyncio.Lock()  # one device change at a time
        self.closed = False  # the agent is stopping: no device is made any more
        self.listener = ProbeListener()
        self.peer_keys: dict[str, str] = {}  # mesh address -> public key (NET_PEERS)
        self.links = 0  # control links so far (relinked)
        self._rules = asyncio.Lock()  # one rule change at a time
        self.probe_job: tuple[str, object] | None = None  # (job, epoch) whose endpoint is open

    async def setup(self, body: dict[str, Any]) -> None:
        if body.get("path") == PathClass.RELAYED.value:
            await self.relayed.setup(body)
            return
        ids = {k: body.get(k) for k in ("job", "epoch", "node_rank")}
        why = device_unavailable()
        public: tuple[str, int] | None = None
        if why is None:
            async with self._lock:
                try:
                    port = 0
                    if self.reflector is not None:
                        # The port the device will listen on, and how the outside sees it.
                        port, public = await asyncio.to_thread(public_endpoint, self.reflector)
                    if self.closed:
                        raise RuntimeError("the agent is stopping")
                    # The link the peers reach this host on: the interface holding its
                    # advertise address, else (a NAT's address) the route out to the
                    # controller; neither known (a tunnel to it): 1280.
                    uplink = interface_mtu(self.uplink) if self.uplink else None
                    if uplink is None and self.reflector is not None:
                        uplink = await asyncio.to_thread(uplink_mtu, self.reflector[0])
                    offered = int(body.get("mtu") or MESH_MTU)
                    mtu = device_mtu(min(offered, self.direct_mtu or offered), uplink)
                    await asyncio.to_thread(
                        self.device.up, str(body["address"]), int(body["prefix"]), port, mtu
                    )
                    self.owner = (str(body["job"]), int(body["epoch"]))
                except Exception as exc:  # the controller fails the epoch with this reason
                    log.warning("job %s: no WireGuard device: %s", ids["job"], exc)
                    why = str(exc)
        if why is not None:
            await self.send(Kind.NET_READY, {**ids, "error": why})
            return
        log.info(
            "job %s: device %s up at %s, MTU %d, UDP port %d (seen outside as %s)",
            ids["job"],
            self.device.name,
            body["address"],
            self.device.mtu,
            self.device.port,
            f"{public[0]}:{public[1]}" if public else "unknown",
        )
        ready: dict[str, Any] = {
            **ids,
            "public_key": self.device.public_key,
            "port": self.device.port,
            "mtu": self.device.mtu,  # (on the job's NetworkReady event)
            "join_key": body.get("join_key"),  # the epoch's single-use key, back once
        }
        if public is not None:
            ready["public"] = {"addr": public[0], "port": public[1]}
        await self.send(Kind.NET_READY, ready)

    async def set_peers(self, body: dict[str, Any]) -> None:
        """Give the device its peers, then wait (bounded) until a WireGuard handshake with
        every one of them proves the path: NET_UP, or NET_READY with the peers that never
        answered (the controller fails the epoch naming them)."""
        if body.get("path") == PathClass.RELAYED.value:
            await self.relayed.set_peers(body)
            return
        ids = {k: body.get(k) for k in ("job", "epoch", "node_rank")}
        if self.owner != (str(body.get("job")), body.get("epoch")):
            log.warning("NET_PEERS for job %s, whose device is not up here", ids["job"])
            return
        peers = [
            Peer(str(p["public_key"]), str(p["endpoint"]), str(p["address"]))
            for p in body.get("peers") or []
        ]
        self.peer_keys = {p.address: p.public_key for p in peers}
        self.peer_nodes = {
            str(p["address"]): int(p["node"])
            for p in body.get("peers") or []
            if p.get("node") is not None
        }
        if body.get("relays"):
            await self._start_fallback(body)
        try:
            async with self._lock:  # (not held while waiting: a STOP may take the device down)
                await asyncio.to_thread(self.device.set_peers, peers)
            silent = await self._await_handshakes(peers, self.owner)
        except Exception as exc:
            log.warning("job %s: setting the peers failed: %s", ids["job"], exc)
            await self.send(Kind.NET_READY, {**ids, "error": f"setting the peers: {exc}"})
            return
        if silent:
            why = "no WireGuard handshake within {:.0f}s with {}".format(
                self.handshake_timeout,
                ", ".join(f"{p.address} at {p.endpoint}" for p in silent),
            )
            log.warning("job %s: %s", ids["job"], why)
            silent_at = [p.address for p in silent]
            await self.send(Kind.NET_READY, {**ids, "error": why, "silent": silent_at})
            return
        await self.send(Kind.NET_UP, ids)

    async def _start_fallback(self, body: dict[str, Any]) -> None:
        """Attach to the relays, so a pair that loses its path can go on through them."""
        await self._close_fallback()
        relays = [(str(r["host"]), int(r["port"])) for r in body["relays"]]
        ids = {k: body.get(k) for k in ("job", "epoch", "node_rank")}
        self.fallback_tickets = TicketStock(list(body["relays"]), ids, self.send)
        fallback = Fallback(
            str(body.get("gang")),
            int(body["node_rank"]),
            relays,
            self.fallback_tickets.take,
            self.device.port,
            self._set_endpoint,
        )
        try:
            await fallback.start()
        except OSError as exc:  # the gang runs without it: a lost path then just waits
            log.warning("job %s: no fallback through the relays: %s", body.get("job"), exc)
            return
        self.fallback = fallback

    def add_tickets(self, body: dict[str, Any]) -> None:
        """RELAY_TICKETS_ISSUED: to the relayed endpoint's stock, or the fallback's."""
        self.relayed.add_tickets(body)
        stock = self.fallback_tickets
        mine = stock is not None and stock.ids.get("job") == body.get("job")
        if stock is not None and mine and stock.ids.get("epoch") == body.get("epoch"):
            stock.add(list(body.get("relays") or []))

    async def _close_fallback(self) -> None:
        fallback, self.fallback = self.fallback, None
        if fallback is not None:
            await fallback.close()

    async def _set_endpoint(self, public_key: str, endpoint: str) -> None:
        async with self._lock:
            await asyncio.to_thread(self.device.set_endpoint, public_key, endpoint)

    async def _await_handshakes(
        self, peers: list[Peer], owner: tuple[str, int] | None
    ) -> list[Peer]:
        """The peers with no handshake yet once ``handshake_timeout`` is over (or none)."""
        deadline = time.monotonic() + self.handshake_timeout
        while True:
            if self.owner != owner:  # taken down (a STOP, the agent stopping), or another's
                raise RuntimeError("the device was removed")
            done = await asyncio.to_thread(self.device.handshakes)
            silent = [p for p in peers if not done.get(p.public_key)]
            if not silent or time.monotonic() > deadline:
                return silent
            await asyncio.sleep(HANDSHAKE_POLL_S)

    async def down(
        self, job: str | None = None, epoch: object = None, *, closing: bool = False
    ) -> None:
        """Remove the device of ``job`` (any, when None; of that epoch only, when given: a
        STOP of a fenced epoch never takes down the next epoch's device); never raises.
        ``closing``: the agent stops, and makes no device after this."""
        if closing:
            self.closed = True
        await self.relayed.down(job, epoch)
        owner = self.owner
        if (
            owner is not None
            and (job is None or owner[0] == job)
            and (epoch is None or owner[1] == epoch)
        ):
            await self._close_fallback()
        async with self._lock:
            owner = self.owner
            if owner is None or (job is not None and owner[0] != job):
                return
            if epoch is not None and owner[1] != epoch:
                return
            try:
                await asyncio.to_thread(self.device.down)
            except Exception:
                log.exception("removing the device of job %s", owner[0])
            log.info("job %s: device %s removed", owner[0], self.device.name)
            self.owner = None

    async def watch_paths(self, ids: dict[str, Any]) -> None:
        """While the member runs on this agent's device: every few seconds, the peers it
        has received nothing from for ``path_timeout``; NET_PATH each time that set changes
        (the controller's NetworkDegraded). Ends with the device; a failed read is logged
        and the watch goes on."""
        owner = (str(ids["job"]), ids["epoch"])
        heard: dict[str, tuple[int, float]] = {}  # public key -> (bytes received, when it grew)
        reported: list[str] | None = None  # None: to be said (again) on the current link
        link = self.links
        failures = 0
        every = min(PATH_WATCH_EVERY_S, self.path_timeout / 4)
        while True:
            await asyncio.sleep(every)
            if self.owner != owner:
                return  # the device went (or is another epoch's)
            try:
                received = await asyncio.to_thread(self.device.received)
            except Exception as exc:
                failures += 1
                if failures in (1, 10, 100):
                    log.warning("job %s: reading the device's counters failed: %s", owner[0], exc)
                continue
            now = time.monotonic()
            lost = []
            for address, key in self.peer_keys.items():
                count = received.get(key, 0)
                before = heard.get(key)
                if before is None or count != before[0]:
                    heard[key] = (count, now)
                elif now - before[1] >= self.path_timeout:
                    lost.append(address)
            fallback = self.fallback
            if fallback is not None:
                for address in lost:  # on through the relays; still a lost direct path
                    node, peer = self.peer_nodes.get(address), self.peer_keys.get(address)
                    if node is not None and peer is not None and node not in fallback.diverted:
                        try:
                            await fallback.divert(node, peer)
                        except Exception as exc:
                            log.warning("job %s: diverting node%d failed: %r", owner[0], node, exc)
                diverted = {a for a, n in self.peer_nodes.items() if n in fallback.diverted}
                lost = sorted(set(lost) | diverted)
            lost.sort()
            if link != self.links:  # a new link (a restarted controller knows nothing yet)
                link, reported = self.links, None
            if lost != (reported or []) or (reported is None and link > 0):
                if lost != (reported or []):
                    if lost:
                        log.warning(
                            "job %s: nothing from %s for %.0fs", owner[0], lost, self.path_timeout
                        )
                    else:
                        log.info("job %s: every peer is heard again", owner[0])
                try:
                    sent = await self.send(Kind.NET_PATH, {**ids, "lost": lost})
                except Exception as exc:
                    log.warning("job %s: NET_PATH not sent: %s", owner[0], exc)
                    sent = False
                if sent is not False:  # (no link now: said again on the next look)
                    reported = lost

    # ---- the rendezvous port's rules ------------------------------------------------------

    async def sweep_rules(self) -> None:
        """Remove every rule and rank group of this agent (a crashed run's too); never raises."""
        if self.groups is None and self.no_groups is None:
            found = await asyncio.to_thread(cgroup.locate)
            if isinstance(found, str):
                self.no_groups = found
            else:
                self.groups = cgroup.RankGroups(found, self.firewall_id)
        if self.groups is not None:
            try:
                gone, stuck = await asyncio.to_thread(self.groups.sweep)
                if gone:
                    log.info("removed the rank groups of an earlier run: %s", ", ".join(gone))
                if stuck:
                    log.warning("could not remove rank groups: %s", "; ".join(stuck))
            except Exception:
                log.exception("sweeping the rank groups under %s", self.groups.parent)
        self.no_rules = await asyncio.to_thread(firewall.unavailable)
        if self.no_rules is not None:
            return  # said when a gang would need rules (never for gangs on loopback)
        try:
            async with self._rules:
                swept = await asyncio.to_thread(self.firewall.sweep)
            if swept:
                log.info("removed the firewall rules of an earlier run (%s)", self.firewall.table)
        except Exception:
            log.exception("sweeping the firewall table %s", self.firewall.table)

    async def guard(self, assignment: dict[str, Any]) -> cgroup.RankGroup | None:
        """A member of a gang across hosts: its ranks' ports (and node 0's rendezvous port)
        take TCP from the gang's members only. Returns the group the ranks must start in,
        or None (a gang on one host, or a host that cannot take the rules: said in the log)."""
        addresses = [str(a) for a in assignment.get("addresses") or ()]
        if len(addresses) < 2:
            return None
        job, epoch = str(assignment["job"]), int(assignment["epoch"])
        port = int(assignment["master_port"]) if assignment.get("node_rank") == 0 else None
        try:
            ips = [ipaddress.ip_address(a) for a in addresses]
        except ValueError:  # a host name advertised: rules need addresses
            log.warning(
                "job %s: a member's address is not an IP address (%s): the ranks' ports stay "
                "open to anyone who reaches this host",
                job,
                ", ".join(addresses),
            )
            return None
        if all(ip.is_loopback for ip in ips):
            return None
        if self.no_rules is not None:
            log.warning(
                "job %s: no firewall rules on this host (%s): the ranks' ports stay open to "
                "anyone who reaches this host",
                job,
                self.no_rules,
            )
            return None
        group = None
        if self.groups is None:
            if not self.said_no_groups:
                self.said_no_groups = True
                log.warning(
                    "the ranks' own ports (gloo, NCCL) stay open to non-members: %s; only "
                    "node 0's rendezvous port is closed to them",
                    self.no_groups,
                )
        else:
            try:
                group = await asyncio.to_thread(self.groups.make, firewall.gang_name(job))
            except OSError as exc:
                log.warning(
                    "job %s: could not make a cgroup for its ranks (%s): their own ports stay "
                    "open to non-members",
                    job,
                    exc,
                )
        if group is not None:
            self.rank_groups[job] = group
        if port is None and group is None:
            return None
        mesh = None
        if assignment.get("path") == "direct":  # the gang's own network (a /22)
            node = int(assignment.get("node_rank") or 0)
            mesh = str(ipaddress.ip_network(f"{addresses[node]}/{MESH_PREFIX}", strict=False))
        try:
            async with self._rules:
                try:
                    await asyncio.to_thread(
                        self.firewall.open, job, epoch, port, addresses, group, mesh
                    )
                except RuntimeError as exc:
                    if group is None or "cgroupv2" not in str(exc):
                        raise
                    # This kernel or nft cannot match sockets by cgroup (Linux 5.13, nft
                    # 1.0): node 0's port by number, as before, and no more groups.
                    log.warning(
                        "the ranks' own ports stay open to non-members: the rule by cgroup "
                        "did not load (%s); only node 0's rendezvous port is closed to them",
                        exc,
                    )
                    made, self.groups = self.groups, None
                    self.no_groups, self.said_no_groups = str(exc), True
                    self.rank_groups.pop(job, None)
                    if made is not None:
                        await asyncio.to_thread(made.remove, group)
                    group = None
                    if port is None:
                        return None
                    await asyncio.to_thread(self.firewall.open, job, epoch, port, addresses)
        except Exception as exc:  # the job still runs; its ports are open as without rules
            log.warning("job %s: could not close its ports to non-members: %s", job, exc)
            return group
        log.info(
            "job %s: %s take TCP from the gang's %d members only",
            job,
            " and ".join(
                ([f"rendezvous port {port}"] if port is not None else [])
                + (["the ranks' ports"] if group is not None else [])
            ),
            len(addresses),
        )
        return group

    async def unguard(self, job: str) -> None:
        """The member has ended: its rules go, and its group (a process still in it is
        killed: no rank outlives its member)."""
        if job in self.firewall.gangs:
            try:
                async with self._rules:
                    await asyncio.to_thread(self.firewall.close, job)
            except Exception:
                log.exception("job %s: removing its rules", job)
        group = self.rank_groups.pop(job, None)
        if group is not None and self.groups is not None:
            try:
                killed = await asyncio.to_thread(self.groups.remove, group)
                if killed:
                    log.warning(
                        "job %s: killed %d process(es) left in its ranks' group", job, killed
                    )
            except OSError:
                log.exception("job %s: removing its ranks' group %s", job, group.path)

    # ---- the probe (every path) -------------------------------------------------------------

    async def probe_listen(self, body: dict[str, Any]) -> None:
        ids = {k: body.get(k) for k in ("job", "epoch", "node_rank")}
        try:
            lifetime = float(body.get("for") or LISTEN_FOR_S)
            token = bytes.fromhex(str(body.get("token") or ""))
            port = await self.listener.start(str(body["addr"]), lifetime, token)
            self.probe_job = (str(body.get("job")), body.get("epoch"))
        except (OSError, ValueError) as exc:
            why = f"listening on {body['addr']}: {exc}"
            await self.send(Kind.PROBE_READY, {**ids, "error": why})
            return
        await self.send(Kind.PROBE_READY, {**ids, "port": port})

    async def probe_run(self, body: dict[str, Any]) -> None:
        ids = {k: body.get(k) for k in ("job", "epoch", "node_rank")}
        peers = [(int(p["node"]), str(p["addr"]), int(p["port"])) for p in body.get("peers") or []]
        seconds = float(body.get("seconds") or 0)
        # Bounded: each peer gets the connects, the echo and its sample, with room to spare.
        timeout = len(peers) * (seconds + READINESS_WINDOW_S + 20.0)
        try:
            token = bytes.fromhex(str(body.get("token") or ""))
        except ValueError:
            token = b""  # the peers will not answer: the probe fails, naming them
        # Over this agent's device (the direct path), a session that lost its first keys
        # heals when WireGuard shakes hands again: timed-out connections get the window.
        owned = self.owner == (str(ids["job"]), ids["epoch"])
        window = READINESS_WINDOW_S if owned else 0.0
        relayed = self.relayed.shim_for(str(ids["job"]))  # through the relays, as the ranks
        if relayed is not None:
            host, _, port = relayed.socks.rpartition(":")
            results = await probe_peers(
                peers, seconds, timeout, token, window, via=(host, int(port))
            )
            results = [replace(r, via="relayed") for r in results]
        else:
            results = await probe_peers(peers, seconds, timeout, token, window)
            results = await asyncio.to_thread(self._paths_taken, results, peers)
        log.info(
            "job %s: probed %s",
            ids["job"],
            ", ".join(f"node{r.node}: {r.gbps} Gbit/s, {r.rtt_ms} ms" for r in results),
        )
        await self.send(
            Kind.PROBE_DONE,
            {**ids, "pairs": [r.as_json() for r in results], "device": self.device.name},
        )

    def _paths_taken(
        self, results: list[PairResult], peers: list[tuple[int, str, int]]
    ) -> list[PairResult]:
        """Each result with the path its traffic took: the interface the peer's address is
        routed by and, through this agent's device, the endpoint WireGuard uses for it."""
        address = {node: addr for node, addr, _port in peers}
        endpoints: dict[str, str] = {}
        handshakes: dict[str, float] = {}
        received: dict[str, int] = {}
        if self.owner is not None:
            with contextlib.suppress(Exception):  # the device went meanwhile
                endpoints = self.device.endpoints()
                if any(r.error for r in results):
                    handshakes, received = self.device.handshakes(), self.device.received()
        taken = []
        for result in results:
            addr = address.get(result.node, "")
            via = route_of(addr) if addr else None
            key = self.peer_keys.get(addr)
            endpoint = endpoints.get(key) if key and via == self.device.name else None
            error = result.error
            if error and endpoint is not None and key in handshakes:
                # What WireGuard saw of the peer: whether the tunnel or what ran in it failed.
                last = handshakes[key]
                ago = f"{time.time() - last:.0f}s ago" if last else "never"
                error += (
                    f"; WireGuard: last handshake with {endpoint} {ago}, "
                    f"{received.get(key, 0)} bytes received from it"
                )
            taken.append(replace(result, via=via, endpoint=endpoint, error=error))
        return taken

    async def probe_close(self, job: str | None = None, epoch: object = None) -> None:
        """Close the probe endpoint (of ``job`` only, when given; of that epoch only, when
        given)."""
        owner = self.probe_job
        if job is not None and (owner is None or owner[0] != job):
            return
        if epoch is not None and owner is not None and owner[1] != epoch:
            return
        await self.listener.close()
        self.probe_job = None

    def relinked(self) -> None:
        """A new control link is up: running members say their paths again on it."""
        self.links += 1

    async def keep_only(self, jobs: set[str]) -> None:
        """A new link: drop a device that no member here uses (its gang ended, or the
        controller restarted, while this agent was away)."""
        owner = self.owner
        if owner is not None and owner[0] not in jobs:
            await self.down(owner[0], owner[1])  # that epoch's: a newer one may be up by now
