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

import urllib.parse
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape

from muster.controller.api import artifact_list, controller, job_detail, store, worker_list
from muster.controller.auth import SESSION_COOKIE, SESSION_TTL_S, Guard, guard, same_secret
from muster.errors import NotFound, Unauthorized
from muster.spec import JobState
from muster.web import STATIC, TEMPLATES

router = APIRouter(include_in_schema=False)
env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]))
LIST_CAP = 500  # jobs on the list page: the newest first
STATIC_TYPES = {".css": "text/css", ".js": "text/javascript"}
TERMINAL = {s.value for s in JobState if s.is_terminal}


def _render(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    context.setdefault("signed_in", guard(request).has_session(request))
    html = env.get_template(name).render(age=age, size=size, **context)
    return HTMLResponse(html, status_code=status, headers=_NO_STORE)


_NO_STORE = {"Cache-Control": "no-store", "X-Frame-Options": "DENY"}


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
def login_page(request: Request, next: str = "/ui/jobs") -> HTMLResponse:
    return _render(request, "login.html", next=_safe_next(next), error="", signed_in=False)


@router.post("/ui/login")
async def login(request: Request) -> Response:
    form = urllib.parse.parse_qs((await request.body())[:4096].decode(errors="replace"))
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
        return _render(request, "login.html", 401, next=target, error=error, signed_in=False)
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        g.session(),
        max_age=SESSION_TTL_S,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
    return response


@router.post("/ui/logout")
def logout() -> RedirectResponse:
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


# ---- jobs ----------------------------------------------------------------------------------


async def _job_rows(request: Request, state: str, label: str) -> list[dict[str, Any]]:
    st, ctl = store(request), controller(request)
    jobs = [j for j in await ctl.db(st.job_summaries) if not state or j.state == state]
    jobs = jobs[::-1]  # newest first
    if label:
        key, _, value = label.partition("=")
        specs = await ctl.db(st.specs, [j.id for j in jobs])
        jobs = [
            j
            for j in jobs
            if key.strip() in (labels := specs.get(j.id, {}).get("labels") or {})
            and (not value or labels[key.strip()] == value.strip())
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


def _empty_text(state: str, label: str) -> str:
    if state or label:
        return "no job matches these filters"
    return "no job yet: submit one with `muster run job.yaml`"


@router.get("/ui/jobs", response_model=None)
async def jobs_page(request: Request, state: str = "", label: str = "") -> Response:
    if (redirect := _login_redirect(request)) is not None:
        return redirect
    return _render(
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
    return _render(request, "_job_rows.html", jobs=rows, empty=_empty_text(state, label))


async def _job_context(request: Request, job_id: str) -> dict[str, Any]:
    st, ctl = store(request), controller(request)
    job = await job_detail(st, ctl, job_id)
    window = None
    if ((job["spec"].get("distributed") or {}).get("membership")) == "window":
        window = await ctl.window_view(job_id)
    workers = {w["id"]: w["hostname"] for w in await worker_list(st, ctl)}
    probes = [
        {"epoch": e["data"].get("epoch"), "pairs": e["data"].get("pairs", [])}
        for e in job["events"]
        if e["kind"] == "Probe" and isinstance(e.get("data"), dict)
    ]
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
        return _render(request, "missing.html", 404, nav="jobs", message=str(exc))
    return _render(request, "job.html", nav="jobs", **context)


@router.get("/ui/jobs/{job_id}/detail")
async def job_fragment(job_id: str, request: Request) -> HTMLResponse:
    _readable(request)
    return _render(request, "_job_detail.html", **await _job_context(request, job_id))


# ---- workers -------------------------------------------------------------------------------


async def _worker_rows(request: Request) -> list[dict[str, Any]]:
    rows = await worker_list(store(request), controller(request))
    for w in rows:
        net = w.get("network") or {}
        parts = []
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
    return _render(request, "workers.html", nav="workers", workers=await _worker_rows(request))


@router.get("/ui/workers/rows")
async def workers_rows(request: Request) -> HTMLResponse:
    _readable(request)
    return _render(request, "_worker_rows.html", workers=await _worker_rows(request))


# ---- static --------------------------------------------------------------------------------


@router.get("/ui/static/{name}")
def static(name: str, request: Request) -> FileResponse:
    _readable(request)
    path = STATIC / name
    if path.suffix not in STATIC_TYPES or path.parent != STATIC or not path.is_file():
        raise NotFound(f"no dashboard file {name}")
    return FileResponse(path, media_type=STATIC_TYPES[path.suffix], headers=_NO_STORE)
