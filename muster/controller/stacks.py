"""``POST /v1/jobs/{id}/stacks``: every running rank's Python stack, gathered from the agents.

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
from muster.spec import JobState
from muster.store.writes import EventWrite
from muster.wire import Kind

if TYPE_CHECKING:
    from muster.controller.gangs import Controller

log = logging.getLogger("muster.controller")
RANK_TIMEOUT_S = 10.0  # what each agent gets per rank's dump
CAPTURE_BUDGET_S = 25.0  # a Hung capture's whole wait (the gang fails at 30 s regardless)
EVENT_MAX_CHARS = 256 * 1024  # of a HungStacks event
STACKS_AT_ONCE = 8  # dumps an agent runs at once (muster.agent.stacks's; wire-apart)
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

    async def collect(
        self, job_id: str, rank: int | None, native: bool, budget: float | None = None
    ) -> dict[str, Any]:
        job = await self.c.db(self.c.store.job, job_id)  # 404 for a job that does not exist
        entry = self.c.runs.get(job_id)
        running = (
            [m for m in entry.gang.members if m.started and not m.gone and not m.lost]
            if entry is not None
            else []
        )
        # A job that ended has no running ranks, even while its members are being stopped
        # (the run knows it ended before the store does).
        state = entry.gang.job_state if entry is not None and entry.gang.is_over else None
        state = state or JobState(job.state)
        if entry is None or state.is_terminal or not running:
            raise BadRequest(f"job {job_id} has no running ranks (it is {state.value})")
        plan = rank_plan(entry.spec)
        ranks: list[int] | None = None
        if rank is not None:
            if not 0 <= rank < plan.world_size:
                raise UserError(f"rank {rank}: the job has ranks 0..{plan.world_size - 1}")
            running = [m for m in running if rank in plan.nodes[m.node].ranks]
            ranks = [rank]
            if not running:
                raise BadRequest(f"rank {rank} of job {job_id} is not running now")
        linked = [m for m in running if m.worker in self.c.links]
        request = _Request(job_id, {m.worker: m.node for m in linked})
        unlinked = sorted(m.node for m in running if m.worker not in self.c.links)
        token = secrets.token_hex(8)
        self.open[token] = request
        if not linked:
            request.done.set()
        try:
            for member in linked:
                link = self.c.links[member.worker]
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
            wait = per_agent + ANSWER_SLACK_S
            await asyncio.wait_for(request.done.wait(), min(wait, budget or wait))
        except TimeoutError:
            pass
        finally:
            self.open.pop(token, None)
        stacks: list[dict[str, Any]] = []
        errors = []
        for node, answer in sorted(request.answers.items()):
            if answer.get("error"):
                errors.append({"node": node, "error": str(answer["error"])[:1000]})
            found = answer.get("stacks")
            where = answer.get("collectives")
            where = where if isinstance(where, dict) else {}
            own = plan.nodes[node].ranks
            for key, text in (found if isinstance(found, dict) else {}).items():
                if str(key).isdigit() and int(key) in own:  # its own ranks only
                    item = {"rank": int(key), "node": node, "text": str(text)}
                    item["collective"] = _collective(where.get(str(key)))
                    stacks.append(item)
        missing = sorted({*unlinked, *(set(request.workers.values()) - set(request.answers))})
        return {
            "job": job_id,
            "stacks": sorted(stacks, key=lambda item: item["rank"]),
            "errors": errors,
            "missing": missing,
        }

    def capture_later(self, job_id: str, episode: int) -> None:
        """The stacks of every running rank into the job's events (HungStacks), then the
        gang hears StacksCaptured: a task of its own, never under the controller's lock."""
        task = asyncio.create_task(self._capture(job_id, episode))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _capture(self, job_id: str, episode: int) -> None:
        try:
            answer = await self.collect(job_id, None, False, budget=CAPTURE_BUDGET_S)
            text = folded_text(answer["stacks"]) or "no stack could be read"
            problems = [f"node{e['node']}: {e['error']}" for e in answer["errors"]]
            problems += [f"node{n}: no answer in time" for n in answer["missing"]]
            message = text + ("\n" + "\n".join(problems) if problems else "")
        except Exception as exc:  # the gang still hears that the capture is over
            log.warning("job %s: reading the stacks of a hung job failed: %s", job_id, exc)
            message = f"the stacks could not be read: {exc}"
        if len(message) > EVENT_MAX_CHARS:
            message = message[:EVENT_MAX_CHARS] + "\n... (cut: `muster stacks JOB` for all)"
        self.c.writer.submit([EventWrite("HungStacks", message, job_id)])
        await self.c.step_job(job_id, StacksCaptured(episode))

    def reply(self, worker: str, body: dict[str, Any]) -> None:
        """A STACKS_DONE: kept only from the worker the open request went to."""
        request = self.open.get(str(body.get("request")))
        if request is None or worker not in request.workers:
            return
        request.answers[request.workers[worker]] = body
        if len(request.answers) == len(request.workers):
            request.done.set()


_COLLECTIVE_KEYS = (
    *("seq", "op", "group", "sizes", "dtypes", "state", "age_s"),
    *("last_seq", "last_op"),
)


def _collective(raw: Any) -> dict[str, Any] | None:
    """An agent's account of a rank's collective, kept to the keys muster.plan.stacks.parked
    writes and to a printable size (an agent is trusted with its ranks, not with the API's
    answer size)."""
    if not isinstance(raw, dict):
        return None
    kept = {k: raw[k] for k in _COLLECTIVE_KEYS if k in raw}
    return kept if len(repr(kept)) <= 2000 else None
