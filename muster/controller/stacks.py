"""``GET /v1/jobs/{id}/stacks``: every running rank's Python stack, gathered from the agents.

The controller sends STACKS to the agent of each member that runs (or only the members that
hold the ranks asked for) and waits, bounded, for their STACKS_DONE; an agent that does not
answer in time is named in ``missing``. A reply is taken only from the worker the request
went to, for a request still open. Who may call: the API token (a user route).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from muster.errors import BadRequest, UserError
from muster.gang import StacksCaptured
from muster.plan import rank_plan
from muster.plan.stacks import folded_text
from muster.store.writes import EventWrite
from muster.wire import Kind

if TYPE_CHECKING:
    from muster.controller.gangs import Controller

log = logging.getLogger("muster.controller")
RANK_TIMEOUT_S = 10.0  # what each agent gets per rank's dump
STACKS_AT_ONCE = 8  # dumps an agent runs at once (muster.agent.stacks)
ANSWER_SLACK_S = 5.0  # on top of it, for the frames


@dataclass
class _Request:
    job: str
    workers: dict[str, int]  # worker id -> node rank asked
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class StackDesk:
    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self.open: dict[str, _Request] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def collect(self, job_id: str, rank: int | None, native: bool) -> dict[str, Any]:
        await self.c.db(self.c.store.job, job_id)  # 404 for a job that does not exist
        entry = self.c.runs.get(job_id)
        running = (
            [m for m in entry.gang.members if m.started and not m.gone and not m.lost]
            if entry is not None
            else []
        )
        if entry is None or not running:
            state = (await self.c.db(self.c.store.job, job_id)).state
            raise BadRequest(f"job {job_id} has no running ranks (it is {state})")
        plan = rank_plan(entry.spec)
        ranks: list[int] | None = None
        if rank is not None:
            if not 0 <= rank < plan.world_size:
                raise UserError(f"rank {rank}: the job has ranks 0..{plan.world_size - 1}")
            running = [m for m in running if rank in plan.nodes[m.node].ranks]
            ranks = [rank]
            if not running:
                raise BadRequest(f"rank {rank} of job {job_id} is not running now")
        request = _Request(job_id, {m.worker: m.node for m in running})
        token = secrets.token_hex(8)
        self.open[token] = request
        try:
            for member in running:
                link = self.c.links.get(member.worker)
                if link is None:
                    continue
                await link.send(
                    Kind.STACKS,
                    {
                        "job": job_id,
                        "epoch": entry.gang.epoch,
                        "node_rank": member.node,
                        "request": token,
                        "ranks": ranks,
                        "native": native,
                        "timeout": RANK_TIMEOUT_S,
                    },
                )
            most = max(len(n.ranks) for n in plan.nodes)  # one agent dumps 8 at once
            per_agent = RANK_TIMEOUT_S * -(-(1 if ranks else most) // STACKS_AT_ONCE)
            await asyncio.wait_for(request.done.wait(), per_agent + ANSWER_SLACK_S)
        except TimeoutError:
            pass
        finally:
            self.open.pop(token, None)
        stacks = []
        errors = []
        for node, answer in sorted(request.answers.items()):
            if answer.get("error"):
                errors.append({"node": node, "error": str(answer["error"])})
            for key, text in sorted((answer.get("stacks") or {}).items(), key=lambda i: int(i[0])):
                stacks.append({"rank": int(key), "node": node, "text": str(text)})
        missing = sorted(set(request.workers.values()) - set(request.answers))
        return {"job": job_id, "stacks": stacks, "errors": errors, "missing": missing}

    def capture_later(self, job_id: str) -> None:
        """The stacks of every running rank into the job's events (HungStacks), then the
        gang hears StacksCaptured: a task of its own, never under the controller's lock."""
        task = asyncio.create_task(self._capture(job_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _capture(self, job_id: str) -> None:
        try:
            answer = await self.collect(job_id, None, False)
            text = folded_text(answer["stacks"]) or "no stack could be read"
            problems = [f"node{e['node']}: {e['error']}" for e in answer["errors"]]
            problems += [f"node{n}: no answer in time" for n in answer["missing"]]
            message = text + ("\n" + "\n".join(problems) if problems else "")
        except Exception as exc:  # the gang still hears that the capture is over
            log.warning("job %s: reading the stacks of a hung job failed: %s", job_id, exc)
            message = f"the stacks could not be read: {exc}"
        self.c.writer.submit([EventWrite("HungStacks", message, job_id)])
        await self.c.step_job(job_id, StacksCaptured())

    def reply(self, worker: str, body: dict[str, Any]) -> None:
        """A STACKS_DONE: kept only from the worker the open request went to."""
        request = self.open.get(str(body.get("request")))
        if request is None or worker not in request.workers:
            return
        request.answers[request.workers[worker]] = body
        if len(request.answers) == len(request.workers):
            request.done.set()
