"""The dashboard's routes behind the API's credentials: who gets a page, who a redirect or a
401, what the session cookie may do, and that user text never becomes markup. The pages in a
real browser against real jobs: tests/e2e/test_dashboard.py."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from muster.controller import dashboard
from muster.controller.auth import SESSION_COOKIE
from muster.controller.credentials import credentials
from muster.spec import parse_job
from muster.store import Store
from tests.controller.test_auth import link_ticket, serve
from tests.controller.test_auth import store as store

PAGES = ["/ui/jobs", "/ui/workers", "/ui/jobs/{job}"]
FRAGMENTS = ["/ui/jobs/rows", "/ui/workers/rows", "/ui/jobs/{job}/detail", "/ui/static/muster.js"]
EVIL = "<script>alert(1)</script>"


def submit(store: Store, name: str = "web", labels: dict[str, str] | None = None) -> str:
    spec = parse_job(
        {
            "name": name,
            "entrypoint": "train.py",
            "distributed": {"num_workers": 2, "procs_per_worker": 2},
            "labels": labels or {},
        }
    )
    return store.submit_job(spec).id


@pytest.fixture
def tls_client(store: Store, tmp_path: Path) -> Iterator[TestClient]:
    with serve(store, tmp_path, tls=True) as client:
        yield client


def sign_in(client: TestClient, token: str) -> None:
    answer = client.post(
        "/ui/login", data={"token": token, "next": "/ui/workers"}, follow_redirects=False
    )
    assert answer.status_code == 303, answer.text
    assert answer.headers["location"] == "/ui/workers"
    cookie = answer.headers["set-cookie"]
    assert "HttpOnly" in cookie
    assert "samesite=lax" in cookie.lower()  # (Secure over real TLS: tests/e2e/test_dashboard.py)


def test_nothing_but_the_login_is_served_without_the_token(
    store: Store,
    tls_client: TestClient,
) -> None:
    job = submit(store)
    served = {getattr(r, "path", "") for r in dashboard.router.routes} - {"/"}
    known = {p.replace("{job}", "{job_id}") for p in PAGES + FRAGMENTS}
    known |= {"/ui", "/ui/", "/ui/login", "/ui/logout", "/ui/static/{name}"}
    known.discard("/ui/static/muster.js")
    assert served == known, "a new dashboard route: decide who may call it, test it here"
    for page in PAGES:
        answer = tls_client.get(page.format(job=job), follow_redirects=False)
        assert answer.status_code == 303, page
        assert answer.headers["location"].startswith("/ui/login?next=/ui/")
    for fragment in FRAGMENTS:
        assert tls_client.get(fragment.format(job=job)).status_code == 401, fragment
    name = tls_client.app.state.guard.cookie_name  # type: ignore[attr-defined]
    assert name.startswith(SESSION_COOKIE)
    for value in (f"{int(time.time()) + 999}.{'0' * 64}", f"1.{'0' * 64}", "²." + "0" * 64):
        bad = {"Cookie": f"{name}={value}".encode("latin-1")}
        assert tls_client.get("/ui/jobs/rows", headers=bad).status_code == 401, value
        assert tls_client.get("/ui/login", headers=bad).status_code == 200, value
    login = tls_client.get("/ui/login")
    assert login.status_code == 200
    assert "API token" in login.text
    # The join secret is no login, and a wrong token sets nothing.
    join = credentials(store).join_secret
    for wrong in (join, "nope", ""):
        answer = tls_client.post("/ui/login", data={"token": wrong}, follow_redirects=False)
        assert answer.status_code == 401
        assert "set-cookie" not in answer.headers
    assert "not this controller's API token" in answer.text or "Enter the API token" in answer.text


def test_an_agent_ticket_opens_no_page(store: Store, tls_client: TestClient) -> None:
    ticket, ws = link_ticket(tls_client, credentials(store).join_secret)
    try:
        answer = tls_client.get("/ui/jobs/rows", headers={"Authorization": f"Ticket {ticket}"})
        assert answer.status_code == 401
    finally:
        ws.__exit__(None, None, None)  # type: ignore[attr-defined]


def test_a_session_reads_everything_and_changes_state_only_with_the_ui_header(
    store: Store,
    tls_client: TestClient,
) -> None:
    job = submit(store)
    sign_in(tls_client, credentials(store).api_token)
    for path in [*PAGES, *FRAGMENTS, "/v1/jobs", "/v1/jobs/{job}/logs"]:
        assert tls_client.get(path.format(job=job)).status_code == 200, path
    # A cross-site form can make the browser send the cookie, never a custom header.
    assert tls_client.post(f"/v1/jobs/{job}/cancel").status_code == 403
    assert store.job(job).state == "queued"
    assert tls_client.post("/v1/jobs", content=b"{}").status_code == 403
    cancelled = tls_client.post(f"/v1/jobs/{job}/cancel", headers={"X-Muster-UI": "1"})
    assert cancelled.status_code == 200
    assert cancelled.json()["state"] == "cancelled"
    out = tls_client.post("/ui/logout", follow_redirects=False)
    assert out.status_code == 303
    tls_client.cookies.clear()
    assert tls_client.get("/ui/jobs/rows").status_code == 401


def test_the_login_never_redirects_off_the_dashboard(
    store: Store,
    tls_client: TestClient,
) -> None:
    token = credentials(store).api_token
    for target in ("https://evil.example/", "//evil.example/ui/", "/v1/jobs", "/ui/\\evil"):
        answer = tls_client.post(
            "/ui/login", data={"token": token, "next": target}, follow_redirects=False
        )
        assert answer.headers["location"] == "/ui/jobs", target


def test_user_text_is_escaped_and_filters_apply(
    store: Store,
    tmp_path: Path,
) -> None:
    with serve(store, tmp_path, tls=False) as client:  # loopback: open, as the API is
        vision = submit(store, "vision", {"team": "vision"})
        other = submit(store, "speech", {"team": "speech"})
        store.set_why_pending(vision, f"waiting for {EVIL}")
        page = client.get("/ui/jobs").text
        assert vision in page
        assert other in page
        rows = client.get("/ui/jobs/rows", params={"label": "team=vision"}).text
        assert vision in rows
        assert other not in rows
        assert "no job matches" in client.get("/ui/jobs/rows", params={"state": "running"}).text
        detail = client.get(f"/ui/jobs/{vision}").text
        assert "<script>alert" not in detail
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in detail
        assert "<script>alert" not in client.get("/ui/jobs/rows").text
        assert 'id="cancel"' in detail, "a queued job can be cancelled"
        missing = client.get("/ui/jobs/nojob-1")
        assert missing.status_code == 404
        assert "nojob-1" in missing.text
        assert re.search(r'<script src="/ui/static/muster.js"', page)


def test_the_log_reads_the_view_makes_and_their_refusals(
    store: Store,
    tmp_path: Path,
) -> None:
    job = submit(store)
    now = time.time()
    lines = [("rank", r, s, now, "stdout", f"r{r} s{s}") for s in range(1, 6) for r in range(4)]
    store.append_logs(job, [*lines, ("node", 1, 1, now, "stderr", "torchrun node1")])
    with serve(store, tmp_path, tls=False) as client:
        url = f"/v1/jobs/{job}/logs"
        tail = client.get(url, params={"tail": "true", "limit": 3}).json()
        assert len(tail["lines"]) == 3
        older = client.get(url, params={"before": tail["prev"], "limit": 100}).json()
        assert len(older["lines"]) == len(lines) + 1 - 3
        assert client.get(url, params={"before": older["prev"]}).json()["lines"] == []
        assert client.get(url, params={"after": tail["next"]}).json()["lines"] == []
        ranks = client.get(url, params={"ranks": "1-2", "tail": "true"}).json()["lines"]
        assert {ln["rank"] for ln in ranks} == {1, 2}
        node = client.get(url, params={"origin": "node", "node": 1}).json()["lines"]
        assert [ln["text"] for ln in node] == ["torchrun node1"]
        in_node = client.get(url, params={"node": 1, "ranks": "0-2"}).json()["lines"]
        assert {ln["rank"] for ln in in_node} == {2}, "node 1 holds ranks 2-3"
        whole = client.get(url, params={"node": 1}).json()["lines"]
        assert {(ln["origin"], ln["rank"]) for ln in whole} == {
            ("rank", 2),
            ("rank", 3),
            ("node", 1),
        }, "a node alone: its ranks' lines and its torchrun's"
        wide = client.get(url, params={"ranks": "0-1000000000"}).json()["lines"]
        assert len(wide) == len(lines), "a huge range is one clause, not a billion values"
        for params, words in [
            ({"ranks": "3-1"}, "from low to high"),
            ({"ranks": "x"}, "write e.g. 0-3,7"),
            ({"ranks": "1", "rank": 1}, "give one of them"),
            ({"ranks": "1", "origin": "node"}, "filter with node"),
            ({"after": tail["next"], "tail": "true"}, "backwards"),
        ]:
            answer = client.get(url, params=params)
            assert answer.status_code == 400, params
            assert words in answer.json()["error"], answer.json()
