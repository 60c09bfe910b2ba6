"""The dashboard: server-rendered pages on the controller's one port.

Who may call: the same people as the API's user routes (muster.controller.auth). A caller
with the API token (bearer header, or the session cookie that ``POST /ui/login`` sets after
checking it) sees every page; on loopback without TLS the pages are open, as the API is. A
page asked for without it redirects to the login; fragments and static files answer 401.
The login page is the one thing served to anybody. The pages' buttons call the JSON API
(cancel, start) with the session cookie and the ``X-Muster-UI`` header.

Pages are Jinja2 templates from muster.web (autoescaped: job names, reasons and log text are
the users' and never become markup); one script refreshes fragments and runs the log view,
which reads ``GET /v1/jobs/{id}/logs`` a page at a time.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape

from muster.controller.api import artifact_list, controller, job_detail, store, worker_list
from muster.controller.auth import SESSION_TTL_S, Guard, guard, same_secret
from muster.errors import NotFound, TooLarge, Unauthorized
from muster.spec import JobState
from muster.web import STATIC, TEMPLATES

router = APIRouter(include_in_schema=False)
env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]))
LIST_CAP = 500  # jobs on the list page: the newest first
LOGIN_MAX_BYTES = 4096
EVENTS_SHOWN = 500  # a job's newest events on its page (all: muster describe)
PAIRS_SHOWN = 20  # a probe's slowest pairs on the page (all: muster describe)
STATIC_TYPES = {".css": "text/css", ".js": "text/javascript"}
TERMINAL = {s.value for s in JobState if s.is_terminal}


async def _render(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    """A template, rendered in a worker thread (a big job's page is not the event loop's)."""
    if "signed_in" not in context:
        context["signed_in"] = guard(request).has_session(request)
    template = env.get_template(name)
    html = await asyncio.to_thread(template.render, age=age, size=size, **context)
    return HTMLResponse(html, status_code=status, headers=_NO_STORE)


_NO_STORE = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    # Only this controller's own script and styles (the login page's are inline).
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
}


def _readable(request: Request) -> Guard:
    """The caller may read pages, or 401 (fragments, static files)."""
    g = guard(request)
    if not g.may_read(request):
        raise Unauthorized("sign in at /ui/login with the API token (`muster token --api`)")
    return g


def _login_redirect(request: Request) -> RedirectResponse | None:
    if guard(request).may_read(request):
        return None
    target = urllib.parse.quote(request.url.path, safe="/")
    return RedirectResponse(f"/ui/login?next={target}", status_code=303)


def age(when: str | datetime | None) -> str:
    """'3m12s' since ``when`` (ISO text or a datetime, UTC)."""
    if when is None:
        return "-"
    moment = datetime.fromisoformat(when) if isinstance(when, str) else when
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    seconds = max(0, int((datetime.now(UTC) - moment).total_seconds()))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _safe_next(target: str) -> str:
    """Only a dashboard path of this controller (never another site: no open redirect)."""
    if target.startswith("/ui/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/ui/jobs"


# ---- sign in -------------------------------------------------------------------------------


@router.get("/")
@router.get("/ui")
@router.get("/ui/")
def home() -> RedirectResponse:
    return RedirectResponse("/ui/jobs", status_code=303)


@router.get("/ui/login")
async def login_page(request: Request, next: str = "/ui/jobs") -> HTMLResponse:
    return await _render(request, "login.html", next=_safe_next(next), error="", signed_in=False)


@router.post("/ui/login")
async def login(request: Request) -> Response:
    form = urllib.parse.parse_qs((await _small_body(request)).decode(errors="replace"))
    # What `muster token --api` prints: the token, then ".sha256:<certificate pin>" over TLS.
    token = (form.get("token") or [""])[0].strip().partition(".")[0]
    target = _safe_next((form.get("next") or ["/ui/jobs"])[0])
    g = guard(request)
    if not same_secret(token, g.creds.api_token):
        error = (
            "That is not this controller's API token"
            if token
            else "Enter the API token (`muster token --api` on the controller)"
        )
        return await _render(request, "login.html", 401, next=target, error=error, signed_in=False)
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        g.cookie_name,
        g.session(),
        max_age=SESSION_TTL_S,
        httponly=True,
        # Lax: a link from elsewhere opens the page signed in; every change of state also
        # wants the X-Muster-UI header, which no other site can send.
        samesite="lax",
        secure=request.url.scheme == "https",
        path="/",
    )
    return response


async def _small_body(request: Request) -> bytes:
    """The sign-in form, refused past LOGIN_MAX_BYTES before more is read (anyone may post
    it)."""
    declared = request.headers.get("content-length", "0")
    if not declared.isdigit() or int(declared) > LOGIN_MAX_BYTES:
        raise TooLarge(f"a sign-in form is at most {LOGIN_MAX_BYTES} bytes")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > LOGIN_MAX_BYTES:
            raise TooLarge(f"a sign-in form is at most {LOGIN_MAX_BYTES} bytes")
    return body


@router.post("/ui/logout")
def logout(request: Request) -> RedirectResponse:
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(guard(request).cookie_name, path="/")
    return response


# ---- jobs ----------------------------------------------------------------------------------


async def _job_rows(request: Request, state: str, label: str) -> list[dict[str, Any]]:
    st, ctl = store(request), controller(request)
    jobs = [j for j in await ctl.db(st.job_summaries) if not state or j.state == state]
    jobs = jobs[::-1]  # newest first
    if label:
        key, _, value = (part.strip() for part in label.partition("="))
        labels = await _labels(request, [j.id for j in jobs])
        jobs = [
            j
            for j in jobs
            if key in labels.get(j.id, {}) and (not value or labels[j.id][key] == value)
        ]
    rows = []
    for j in jobs[:LIST_CAP]:
        note = j.why_pending if j.state == JobState.QUEUED.value else j.root_cause
        rows.append(
            {
                "id": j.id,
                "name": j.name,
                "state": j.state,
                "path_class": j.path_class,
                "note": (note or "").split("\n")[0],
                "age": age(j.submitted_at),
            }
        )
    return rows


LABELS_CAP = 100_000  # jobs whose labels the app keeps in memory


async def _labels(request: Request, job_ids: list[str]) -> dict[str, dict[str, str]]:
    """The jobs' labels, read once per job (a spec never changes) and kept on the app."""
    cache: dict[str, dict[str, str]] = request.app.state.__dict__.setdefault("labels", {})
    missing = [j for j in job_ids if j not in cache]
    if missing:
        if len(cache) + len(missing) > LABELS_CAP:
            cache.clear()
        st, ctl = store(request), controller(request)
        for job_id, spec in (await ctl.db(st.specs, missing)).items():
            cache[job_id] = dict(spec.get("labels") or {})
    return {j: cache.get(j, {}) for j in job_ids}


def _empty_text(state: str, label: str) -> str:
    if state or label:
        return "no job matches these filters"
    return "no job yet: submit one with `muster submit job.yaml -f`"


@router.get("/ui/jobs", response_model=None)
async def jobs_page(request: Request, state: str = "", label: str = "") -> Response:
    if (redirect := _login_redirect(request)) is not None:
        return redirect
    return await _render(
        request,
        "jobs.html",
        nav="jobs",
        jobs=await _job_rows(request, state, label),
        empty=_empty_text(state, label),
        states=[s.value for s in JobState],
        state=state,
        label=label,
        query=urllib.parse.urlencode({"state": state, "label": label}),
    )


@router.get("/ui/jobs/rows")
async def jobs_rows(request: Request, state: str = "", label: str = "") -> HTMLResponse:
    _readable(request)
    rows = await _job_rows(request, state, label)
    return await _render(request, "_job_rows.html", jobs=rows, empty=_empty_text(state, label))


WINDOW_FIELDS = ("start", "quorum", "target", "next_deadline_in", "reason", "startable")


async def _job_context(request: Request, job_id: str) -> dict[str, Any]:
    st, ctl = store(request), controller(request)
    job = await job_detail(st, ctl, job_id, events_last=EVENTS_SHOWN)
    window = None
    if ((job["spec"].get("distributed") or {}).get("membership")) == "window":
        # Before its first pass, after a restart or once formed, a window's view is short.
        window = {key: None for key in WINDOW_FIELDS} | await ctl.window_view(job_id)
    workers = {w["id"]: w["hostname"] for w in await worker_list(st, ctl)}
    probes = []
    for e in job["events"]:
        if e["kind"] != "Probe" or not isinstance(e.get("data"), dict):
            continue
        pairs = [p for p in e["data"].get("pairs") or [] if isinstance(p, dict)]
        pairs.sort(key=lambda p: (p.get("tcpGbps") is not None, p.get("tcpGbps") or 0))
        probes.append(
            {"epoch": e["data"].get("epoch"), "pairs": pairs[:PAIRS_SHOWN], "total": len(pairs)}
        )
    return {
        "job": job,
        "terminal": job["state"] in TERMINAL,
        "window": window,
        "hosts": workers,
        "probes": probes,
        "artifacts": await artifact_list(st, ctl, job_id),
    }


@router.get("/ui/jobs/{job_id}", response_model=None)
async def job_page(job_id: str, request: Request) -> Response:
    if (redirect := _login_redirect(request)) is not None:
        return redirect
    try:
        context = await _job_context(request, job_id)
    except NotFound as exc:
        return await _render(request, "missing.html", 404, nav="jobs", message=str(exc))
    return await _render(request, "job.html", nav="jobs", **context)


@router.get("/ui/jobs/{job_id}/detail")
async def job_fragment(job_id: str, request: Request) -> HTMLResponse:
    _readable(request)
    return await _render(request, "_job_detail.html", **await _job_context(request, job_id))


# ---- workers -------------------------------------------------------------------------------


async def _worker_rows(request: Request) -> list[dict[str, Any]]:
    rows = await worker_list(store(request), controller(request))
    for w in rows:
        net = w.get("network") or {}
        parts = []
        if w.get("region", "local") != "local":
            parts.append(f"{w['provider']}/{w['region']}")
        if net.get("private_network_id"):
            parts.append(f"private {net['private_network_id']}")
        if net.get("can_create_device"):
            parts.append(f"direct ({net.get('device') or 'muster0'})")
        if net.get("container_only"):
            parts.append("container only")
        w["network_text"] = ", ".join(parts) or "-"
        w["seen_ago"] = age(w["last_seen"])
    return rows


@router.get("/ui/workers", response_model=None)
async def workers_page(request: Request) -> Response:
    if (redirect := _login_redirect(request)) is not None:
        return redirect
    return await _render(
        request, "workers.html", nav="workers", workers=await _worker_rows(request)
    )


@router.get("/ui/workers/rows")
async def workers_rows(request: Request) -> HTMLResponse:
    _readable(request)
    return await _render(request, "_worker_rows.html", workers=await _worker_rows(request))


# ---- static --------------------------------------------------------------------------------


@router.get("/ui/static/{name}")
def static(name: str, request: Request) -> FileResponse:
    _readable(request)
    path = STATIC / name
    if path.suffix not in STATIC_TYPES or path.parent != STATIC or not path.is_file():
        raise NotFound(f"no dashboard file {name}")
    return FileResponse(path, media_type=STATIC_TYPES[path.suffix], headers=_NO_STORE)
