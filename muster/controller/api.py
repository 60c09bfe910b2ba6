"""The HTTP API: jobs, workers, logs, bundles and artifacts. JSON in, JSON out."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import FileResponse

from muster.controller.auth import require_agent, require_user
from muster.controller.files import FileStore
from muster.controller.gangs import Controller
from muster.controller.relays import usage_answer
from muster.errors import BadRequest, FieldError, Forbidden, NotFound, SpecError, UserError
from muster.plan import RankPlan, rank_plan
from muster.spec import JobState, parse_job
from muster.store import Store
from muster.store.jobs import JobSummary
from muster.store.models import Job

# Who may call each route: see muster.controller.auth. ``router`` is open (health only),
# ``users`` wants the API token, and agent routes take ``Depends(require_agent)``.
router = APIRouter(prefix="/v1")
users = APIRouter(prefix="/v1", dependencies=[Depends(require_user)])
agents = APIRouter(prefix="/v1")

INT32, INT64 = 2**31, 2**63  # ranks are 32-bit columns, log cursors 64-bit
SUBMIT_HINT = "send a JSON object {'spec': {...}, 'bundle_sha256': '...'}"


def controller(request: Request) -> Controller:
    return request.app.state.controller  # type: ignore[no-any-return]


def store(request: Request) -> Store:
    return request.app.state.store  # type: ignore[no-any-return]


def files(request: Request) -> FileStore:
    return request.app.state.files  # type: ignore[no-any-return]


@router.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


# ---- jobs --------------------------------------------------------------------------------


def utc(moment: datetime) -> str:
    """A stored time as the API says it, the same on both engines: ISO 8601 in UTC with
    microseconds and its offset, ``2026-12-01T09:38:43.954555+00:00`` (SQLite reads times
    back naive; they were written in UTC)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


def job_summary(job: Job | JobSummary) -> dict[str, Any]:
    return {
        "id": job.id,
        "name": job.name,
        "state": job.state,
        "priority": job.priority,
        "path_class": job.path_class,
        "why_pending": job.why_pending,
        "root_cause": job.root_cause,
        "submitted_at": utc(job.submitted_at),
        "started_at": utc(job.started_at) if job.started_at else None,
        "finished_at": utc(job.finished_at) if job.finished_at else None,
    }


@users.post("/jobs", status_code=201)
async def submit(request: Request) -> dict[str, Any]:
    body = await _json_object(request)
    if "spec" not in body:
        raise UserError(f"the request body has no 'spec'; {SUBMIT_HINT}")
    spec = parse_job(body["spec"], source="spec")
    bundle = body.get("bundle_sha256")
    if bundle is not None and not files(request).has_bundle(str(bundle)):
        raise SpecError([FieldError("bundle_sha256", f"no bundle {bundle}; upload it first")])
    ctl = controller(request)
    job = await ctl.db(store(request).submit_job, spec, bundle_sha256=bundle)
    ctl.request_pass()
    return job_summary(job)


async def _json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object; anything else is a 400 that says what it got."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        what = "empty" if not raw.strip() else f"not JSON ({exc})"
        raise UserError(f"the request body is {what}; {SUBMIT_HINT}") from None
    if not isinstance(body, dict):
        raise UserError(f"the request body is a JSON {type(body).__name__}; {SUBMIT_HINT}")
    return body


@users.get("/jobs", response_model=list[dict[str, Any]])
async def list_jobs(request: Request) -> Response:
    # Built by the database (the store's job_listing), without FastAPI's per-item
    # validation: a dashboard polls this with thousands of jobs while the controller places.
    body = await controller(request).db(store(request).job_listing)
    return Response(body, media_type="application/json")


@users.get("/jobs/{job_id}", response_model=dict[str, Any])
async def describe(job_id: str, request: Request) -> Response:
    # Encoded here (orjson) rather than by FastAPI's per-value walk: a CLI follow or a
    # dashboard asks for this every second or so (with the one-transaction read, 4.3-4.7 ms
    # of the server's CPU a request here, was 5.3-6.1).
    detail = await job_detail(store(request), controller(request), job_id)
    try:
        body = orjson.dumps(detail)
    except orjson.JSONEncodeError:  # an integer past 64 bits (in an event's stored data)
        body = json.dumps(_finite(detail), ensure_ascii=False).encode()
    return Response(body, media_type="application/json")


def _finite(value: Any) -> Any:
    """NaN and infinities as null, as orjson writes them (json would write NaN: not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


async def job_detail(
    st: Store, ctl: Controller, job_id: str, events_last: int | None = None
) -> dict[str, Any]:
    """A job as ``muster describe`` and the dashboard show it (the dashboard: only the newest
    ``events_last`` events, and ``events_total``). Read and built in one trip to a worker
    thread: under load each trip waits its turn for the event loop."""
    return await ctl.db(_job_detail, st, job_id, events_last)


def _job_detail(st: Store, job_id: str, events_last: int | None) -> dict[str, Any]:
    job, members, events, conditions, events_total = st.job_view(job_id, events_last)
    plan: RankPlan | None = None
    spec_error: str | None = None
    try:
        plan = rank_plan(st.job_spec(job))
    except BadRequest as exc:  # stored by an older muster: the job is still shown
        spec_error = str(exc)
    return {
        **job_summary(job),
        "spec": job.spec,
        **({"spec_error": spec_error} if spec_error else {}),
        "world_size": plan.world_size if plan else None,
        "members": [
            {
                "node_rank": m.node_rank,
                "worker": m.worker_id,
                "state": m.state,
                "exit_code": m.exit_code,
                "signal": m.signal,
                "advertise_address": m.advertise_address,
                "path_address": m.path_address,
                "ranks": [
                    plan.nodes[m.node_rank].ranks.start,
                    plan.nodes[m.node_rank].ranks.stop - 1,
                ]
                if plan and m.node_rank < plan.num_nodes
                else None,
            }
            for m in members
        ],
        "events": [
            {"time": utc(e.time), "kind": e.kind, "message": e.message, "data": e.data}
            for e in events
        ],
        "conditions": [
            {"type": c.type, "status": c.status, "reason": c.reason, "message": c.message}
            for c in conditions
        ],
        **({"events_total": events_total} if events_last else {}),
    }


@users.post("/jobs/{job_id}/cancel")
async def cancel(job_id: str, request: Request) -> dict[str, Any]:
    ctl = controller(request)
    await ctl.cancel(job_id)
    return job_summary(await ctl.db(store(request).job, job_id))


@users.post("/jobs/{job_id}/start")
async def start(job_id: str, request: Request) -> dict[str, Any]:
    """Fire a staging join window (manual or hybrid start): the world forms now. 409 with
    the reason when it cannot (auto mode, quorum not met, window already closed)."""
    return await controller(request).start_window(job_id)


@users.get("/jobs/{job_id}/window")
async def window(job_id: str, request: Request) -> dict[str, Any]:
    """A job's join window: phase, rules, roster (read-only)."""
    return await controller(request).window_view(job_id)


@users.get("/jobs/{job_id}/usage")
async def usage(job_id: str, request: Request) -> dict[str, Any]:
    """What the job's members sent through the relays, as the relays metered it:
    ``relayed_bytes`` and ``members`` [{node, worker, relayed_bytes}] (0 off the relayed
    path). Live while the job runs (read every 5 s), its record once it is over."""
    ctl = controller(request)
    job = await job_detail(store(request), ctl, job_id)
    return usage_answer(job, ctl.relay_usage.of(job_id), job["events"])


@users.post("/jobs/{job_id}/stacks")
async def stacks(
    job_id: str,
    request: Request,
    rank: int | None = Query(None, ge=0, lt=INT32),
    native: bool = False,
) -> dict[str, Any]:
    """Every running rank's Python stack (py-spy on each agent), or one rank's: ``stacks``
    [{rank, node, text}], ``errors`` per node, ``missing`` (nodes that did not answer in
    time). The job goes on; each dump is bounded. A POST: py-spy pauses each rank for a
    moment, so a page on another site must not be able to make a browser ask for it."""
    return await controller(request).stacks.collect(job_id, rank, native)


# ---- logs --------------------------------------------------------------------------------


@users.get("/jobs/{job_id}/logs")
async def logs(
    job_id: str,
    request: Request,
    rank: int | None = Query(None, ge=0, lt=INT32),
    ranks: str = Query("", max_length=1000, description="global ranks, e.g. 0-3,7"),
    node: int | None = Query(None, ge=0, lt=INT32),
    origin: Literal["rank", "node"] | None = None,
    after: str = "",
    before: str = "",
    tail: bool = False,
    limit: int = Query(10_000, ge=1),
) -> dict[str, Any]:
    """Lines after the cursor ``after`` (opaque; from the previous answer's ``next``).

    Reading backwards: ``tail=true`` gives the newest ``limit`` lines, and ``before`` (a
    previous answer's ``prev``) the page before a line; both still in ingest order. Filters:
    ``rank`` or ``ranks`` (e.g. ``0-3,7``) for those ranks' own lines; ``node`` for a node's
    lines (its ranks' and its torchrun's); ``origin=rank`` or ``origin=node`` for only the
    ranks' or only torchrun's lines.
    """
    st, ctl = store(request), controller(request)
    job = await ctl.db(st.job, job_id)
    runs, only, launcher = _log_filter(lambda: st.job_spec(job), rank, ranks, node, origin)
    kept = {"runs": runs, "origin": only, "launcher": launcher}
    limit = min(limit, 50_000)
    if before or tail:
        if after:
            raise UserError("after: read forwards with after, or backwards with before/tail")
        edge = _decode_cursor(before, "before") if before else None
        lines = await ctl.db(st.logs_before, job_id, edge, limit=limit, **kept)
        # After a tail, follow from its last line (from the start when it was empty).
        next_cursor = lines[-1].ingest_id if lines else 0
    else:
        cursor = _decode_cursor(after)
        lines = await ctl.db(st.logs_after, job_id, cursor, limit=limit, **kept)
        next_cursor = lines[-1].ingest_id if lines else cursor
    return {
        "job": job_id,
        "state": job.state,
        "lines": [
            {
                "origin": ln.origin,
                "rank": ln.rank,
                "seq": ln.seq,
                "time": ln.time_us / 1e6,
                "stream": ln.stream,
                "text": ln.text,
                **({"raw_b64": ln.raw_b64} if ln.raw_b64 else {}),
            }
            for ln in lines
        ],
        "next": _encode_cursor(next_cursor),
        # The cursor of the first line (before=prev reads the page ahead of it); null when
        # there is nothing before.
        "prev": _encode_cursor(lines[0].ingest_id) if lines else None,
    }


MAX_RANK_RUNS = 256  # ranges in one ``ranks`` filter


def _log_filter(
    spec: Callable[[], Any], rank: int | None, ranks: str, node: int | None, origin: str | None
) -> tuple[list[tuple[int, int]] | None, str | None, int | None]:
    """(runs of rank or node numbers, origin, launcher node) for the store; see ``logs``."""
    if rank is not None and ranks:
        raise UserError("rank and ranks: give one of them")
    runs: list[tuple[int, int]] | None = None
    if ranks:
        runs = parse_ranks(ranks)
    elif rank is not None:
        runs = [(rank, rank)]
    if node is not None:
        plan = rank_plan(spec())
        if not 0 <= node < plan.num_nodes:
            raise UserError(f"node {node}: the job has nodes 0..{plan.num_nodes - 1}")
    if origin == "node":
        if runs is not None:
            raise UserError("origin=node reads a node's launcher lines: filter with node, not rank")
        return (None if node is None else [(node, node)]), "node", None
    if node is None:
        return runs, ("rank" if runs is not None else origin), None
    in_node = plan.nodes[node].ranks
    lo, hi = in_node.start, in_node.stop - 1
    clipped = [(max(a, lo), min(b, hi)) for a, b in (runs or [(lo, hi)]) if a <= hi and b >= lo]
    # A node alone: its ranks' lines and its torchrun's; with ranks or origin=rank, ranks only.
    launcher = node if runs is None and origin is None else None
    return clipped, "rank", launcher


def parse_ranks(text: str) -> list[tuple[int, int]]:
    """``0-3,7`` -> [(0, 3), (7, 7)] (merged, in order); a 400 naming the bad part otherwise.
    Never expanded: a range of a million ranks is one pair."""
    runs: list[tuple[int, int]] = []
    for part in (p.strip() for p in text.split(",")):
        lo_text, dash, hi_text = part.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
        except ValueError:
            raise UserError(f"ranks: {part!r} is not a rank or a range; write e.g. 0-3,7") from None
        if not 0 <= lo <= hi < INT32:
            raise UserError(f"ranks: {part!r} is not a range of ranks from low to high")
        runs.append((lo, hi))
        if len(runs) > MAX_RANK_RUNS:
            raise UserError(f"ranks: more than {MAX_RANK_RUNS} ranges; give fewer")
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(runs):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _decode_cursor(text: str, name: str = "after") -> int:
    """The ingest id of the last line the caller saw (0: none yet)."""
    if not text:
        return 0
    try:
        data = json.loads(base64.urlsafe_b64decode(text.encode()))
    except ValueError as exc:
        raise BadRequest(f"{name}: not a cursor this API returned") from exc
    if isinstance(data, bool) or not isinstance(data, int) or not 0 <= data < INT64:
        raise BadRequest(f"{name}: not a cursor this API returned; start again without it")
    return data


def _encode_cursor(cursor: int) -> str:
    return base64.urlsafe_b64encode(json.dumps(cursor).encode()).decode()


# ---- bundles and artifacts ---------------------------------------------------------------


def _declared_size(request: Request) -> int:
    try:
        return int(request.headers.get("content-length") or 0)
    except ValueError as exc:
        raise BadRequest("Content-Length is not a number") from exc


async def _chunks(request: Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        if chunk:
            yield chunk


@users.post("/bundles", status_code=201)
async def upload_bundle(request: Request) -> dict[str, Any]:
    files(request).bundle_limit().check(_declared_size(request))
    sha, size = await files(request).save_bundle(_chunks(request))
    return {"sha256": sha, "size": size}


@agents.get("/bundles/{sha256}")
async def download_bundle(
    sha256: str, request: Request, worker: str = Depends(require_agent)
) -> FileResponse:
    """The source bundle of a job this agent is placed in (and no other)."""
    path = files(request).bundle_path(sha256)
    if not controller(request).runs_bundle(worker, sha256):
        raise Forbidden(f"worker {worker} is placed in no running job with bundle {sha256}")
    if not path.is_file():
        raise NotFound(f"no bundle {sha256}")
    return FileResponse(path, media_type="application/gzip")


@agents.put("/jobs/{job_id}/artifacts/{node_rank}/{rel:path}", status_code=201)
async def upload_artifact(
    job_id: str,
    node_rank: int,
    rel: str,
    request: Request,
    x_muster_sha256: str = Header(...),
    worker: str = Depends(require_agent),
) -> dict[str, Any]:
    st, ctl = store(request), controller(request)
    if not ctl.may_upload(worker, job_id, node_rank):
        raise Forbidden(
            f"worker {worker} is not node{node_rank} of a run of job {job_id} whose outputs "
            "are still awaited"
        )
    files(request).artifact_limit(rel).check(_declared_size(request))
    size = await files(request).save_artifact(
        job_id, node_rank, rel, _chunks(request), x_muster_sha256
    )
    await ctl.db(st.add_artifact, job_id, node_rank, rel, size, x_muster_sha256)
    return {"path": f"node{node_rank}/{rel}", "size": size, "sha256": x_muster_sha256}


@users.get("/jobs/{job_id}/artifacts")
async def list_artifacts(job_id: str, request: Request) -> list[dict[str, Any]]:
    return await artifact_list(store(request), controller(request), job_id)


async def artifact_list(st: Store, ctl: Controller, job_id: str) -> list[dict[str, Any]]:
    await ctl.db(st.job, job_id)
    return [
        {
            "path": f"node{a.node_rank}/{a.path}",
            "node_rank": a.node_rank,
            "size": a.size,
            "sha256": a.sha256,
        }
        for a in await ctl.db(st.artifacts, job_id)
    ]


# An artifact is whatever a job wrote: never shown as a page of this origin (where a script
# in it would run with the dashboard's session), always a download.
ARTIFACT_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "sandbox; default-src 'none'",
}


@users.get("/jobs/{job_id}/artifacts/{node_rank}/{rel:path}")
async def download_artifact(
    job_id: str, node_rank: int, rel: str, request: Request
) -> FileResponse:
    return FileResponse(
        files(request).open_artifact(job_id, node_rank, rel),
        media_type="application/octet-stream",
        filename=PurePosixPath(rel).name,
        content_disposition_type="attachment",
        headers=ARTIFACT_HEADERS,
    )


# ---- workers -----------------------------------------------------------------------------


@users.get("/workers")
async def list_workers(request: Request) -> list[dict[str, Any]]:
    return await worker_list(store(request), controller(request))


async def worker_list(st: Store, ctl: Controller) -> list[dict[str, Any]]:
    """Every worker as ``muster get workers`` and the dashboard show it."""
    rows = await ctl.db(st.worker_rows)
    return [
        {
            "id": w.id,
            "hostname": w.hostname,
            "state": w.state,
            "job": w.job_id,
            "advertise_address": w.advertise_address,
            "torch": w.inventory.get("torch_version"),
            "gpus": w.inventory.get("gpus", {}).get("count", 0),
            # Where it is, as its agent declared (--provider, --region; "local": undeclared).
            "provider": w.inventory.get("provider", "local"),
            "region": w.inventory.get("region", "local"),
            "region_class": w.inventory.get("region_class", "local"),
            "network": {
                key: w.inventory.get("network", {}).get(key)
                for key in ("private_network_id", "can_create_device", "container_only", "device")
            },
            "connected": w.id in ctl.links,
            "last_seen": utc(w.last_seen),
        }
        for w in rows
    ]


__all__ = ["JobState", "agents", "router", "users"]
