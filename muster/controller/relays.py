"""What relayed gangs sent through the relays, as the relays metered it (``muster usage``).

Every USAGE_EVERY_S (5 s) the controller asks each relay it knows (a USAGE hello that proves the
shared secret, muster.net.relaywire) for its counters: bytes each member of each gang sent.
Counters are the relay's own since it started; the controller adds what grew since its last
look (a counter that went down is a relay that restarted: all of it is new). The sum per job
and node is kept while the controller runs and written as a ``RelayedUsage`` event when the
job's run is over; ``/metrics`` has the total (muster_relayed_bytes_total).

The loop never dies: a relay that does not answer is logged (once per change) and counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from muster.net.relaywire import Kind, LinkClosed, json_frame, read_frame, relay_proof
from muster.store.writes import EventWrite

if TYPE_CHECKING:
    from muster.controller.gangs import Controller

log = logging.getLogger("muster.controller")
USAGE_EVERY_S = 5.0
ASK_TIMEOUT_S = 5.0


async def ask(host: str, port: int, secret: bytes) -> list[tuple[str, int, int]]:
    """One relay's counters: (gang, member, bytes sent)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), ASK_TIMEOUT_S)
    try:
        nonce = f"{time.time():.3f}-{secrets.token_hex(8)}"
        proof = relay_proof(secret, "controller", nonce)
        writer.write(json_frame(Kind.HELLO, {"usage": True, "nonce": nonce, "proof": proof}))
        kind, body = await asyncio.wait_for(read_frame(reader), ASK_TIMEOUT_S)
    finally:
        writer.close()
    if kind is not Kind.USAGE:
        raise LinkClosed(f"the relay refused: {body[:200]!r}")
    return [(str(g), int(m), int(n)) for g, m, n in json.loads(body)["usage"]]


class RelayUsage:
    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self.seen: dict[tuple[str, int, str, int], int] = {}  # (relay, its port, gang, member)
        self.jobs: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.failing: set[tuple[str, int]] = set()
        self.written: dict[str, int] = {}  # job -> the total its last RelayedUsage recorded
        self.known: set[tuple[str, int]] = set()  # relays read at least once

    async def run(self) -> None:
        while True:
            await asyncio.sleep(USAGE_EVERY_S)
            await self.poll()

    async def poll(self) -> None:
        for host, port in self.c.relays:
            try:
                counters = await ask(host, port, self.c.relay_secret)
            except (OSError, TimeoutError, LinkClosed, ValueError, KeyError) as exc:
                if (host, port) not in self.failing:
                    log.warning("relay %s:%d: no usage: %s", host, port, exc)
                self.failing.add((host, port))
                self.c.metrics.internal_errors.labels("relay_usage").inc()
                continue
            if (host, port) in self.failing:
                log.info("relay %s:%d answers again", host, port)
                self.failing.discard((host, port))
            if (host, port) not in self.known:
                # The first read since this controller started: counts from before it are
                # not known to be unrecorded (a restart would count them twice). Baseline.
                self.known.add((host, port))
                for gang, member, sent in counters:
                    self.seen[(host, port, gang, member)] = sent
                continue
            self._add(host, port, counters)
        self._write_finished()

    def _add(self, host: str, port: int, counters: list[tuple[str, int, int]]) -> None:
        for gang, member, sent in counters:
            key = (host, port, gang, member)
            before = self.seen.get(key, 0)
            grown = sent - before if sent >= before else sent  # (a restarted relay)
            self.seen[key] = sent
            if grown > 0:
                job = gang.rsplit("/", 1)[0]
                self.jobs[job][member] += grown
                self.c.metrics.relayed_bytes.inc(grown)

    def _write_finished(self) -> None:
        """A RelayedUsage event for each job whose run is over (once)."""
        for job, nodes in self.jobs.items():
            total = sum(nodes.values())
            if job in self.c.runs or self.written.get(job) == total:
                continue
            self.written[job] = total
            self.c.writer.submit(
                [
                    EventWrite(
                        "RelayedUsage",
                        f"{total / 2**30:.3f} GiB sent through the relays",
                        job,
                        data={"bytes": {str(n): b for n, b in sorted(nodes.items())}},
                    )
                ]
            )

    def of(self, job: str) -> dict[int, int]:
        return dict(self.jobs.get(job) or {})


def usage_answer(job: dict[str, Any], live: dict[int, int], events: list[Any]) -> dict[str, Any]:
    """``GET /v1/jobs/{id}/usage``: bytes per member, live or from the job's last record."""
    recorded: dict[int, int] = {}
    for event in events:
        if event.get("kind") == "RelayedUsage":
            recorded = {
                int(n): int(b) for n, b in (event.get("data") or {}).get("bytes", {}).items()
            }
    sent = live or recorded
    workers = {int(m["node_rank"]): m.get("worker") for m in job.get("members") or []}
    members = [
        {"node": node, "worker": workers.get(node), "relayed_bytes": sent.get(node, 0)}
        for node in sorted(set(workers) | set(sent))
    ]
    return {
        "job": job["id"],
        "path_class": job.get("path_class"),
        "relayed_bytes": sum(sent.values()),
        "members": members,
    }
