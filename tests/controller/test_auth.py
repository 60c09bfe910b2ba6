"""Every route checks its own credential (muster.controller.auth), walked over the served
OpenAPI with each kind of caller: nobody, a forged ticket, a stale ticket, a live agent's
ticket, the join secret, a wrong token, and the API token."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from muster import wire
from muster.controller.app import ControllerConfig, create_app
from muster.controller.credentials import credentials
from muster.spec import parse_job
from muster.store import Store, open_store
from muster.store.models import Job
from muster.wire import Kind

# What each route of the API is for. A route missing here fails the walk: whoever adds one
# decides who may call it.
RIGHTS = {
    ("GET", "/v1/health"): "open",
    ("POST", "/v1/jobs"): "user",
    ("GET", "/v1/jobs"): "user",
    ("GET", "/v1/jobs/{job_id}"): "user",
    ("POST", "/v1/jobs/{job_id}/cancel"): "user",
    ("POST", "/v1/jobs/{job_id}/start"): "user",
    ("GET", "/v1/jobs/{job_id}/window"): "user",
    ("GET", "/v1/jobs/{job_id}/logs"): "user",
    ("POST", "/v1/jobs/{job_id}/stacks"): "user",
    ("GET", "/v1/jobs/{job_id}/usage"): "user",
    ("POST", "/v1/bundles"): "user",
    ("GET", "/v1/bundles/{sha256}"): "agent",
    ("PUT", "/v1/jobs/{job_id}/artifacts/{node_rank}/{rel}"): "agent",
    ("GET", "/v1/jobs/{job_id}/artifacts"): "user",
    ("GET", "/v1/jobs/{job_id}/artifacts/{node_rank}/{rel}"): "user",
    ("GET", "/v1/workers"): "user",
    ("GET", "/metrics"): "user",
}
PARAMS = {"job_id": "nojob-0", "node_rank": "0", "rel": "model.pt", "sha256": "ab" * 32}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    st = open_store(str(tmp_path / "muster.db"))
    yield st
    st.db.dispose()


def serve(store: Store, tmp_path: Path, *, tls: bool) -> TestClient:
    config = ControllerConfig(store=store, artifacts=tmp_path / "artifacts", tls=tls)
    # As a local user's tools call it (an open loopback controller answers only to that).
    return TestClient(create_app(config), base_url="http://127.0.0.1:7070")


def link_ticket(client: TestClient, join_secret: str, worker_id: str = "w1") -> tuple[str, object]:
    """Open a real control link (the handshake of muster.wire); returns its ticket."""
    ws = client.websocket_connect("/v1/agents/link").__enter__()
    challenge = wire.decode_plain(ws.receive_bytes(), Kind.CHALLENGE)
    cnonce, anonce = wire.new_nonce(), str(challenge["nonce"])
    proof = wire.auth_proof(join_secret, cnonce, anonce, worker_id)
    ws.send_bytes(
        wire.encode_plain(Kind.AUTH, {"worker_id": worker_id, "nonce": cnonce, "proof": proof})
    )
    codec = wire.LinkCodec(
        wire.session_key(join_secret, cnonce, anonce),
        send=wire.TO_CONTROLLER,
        receive=wire.TO_AGENT,
    )
    welcome = codec.decode(ws.receive_bytes())
    assert welcome.kind is Kind.WELCOME
    return str(welcome.body["ticket"]), ws


def routes(client: TestClient) -> list[tuple[str, str]]:
    spec = client.get("/openapi.json").json()
    found = [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops]
    found.append(("GET", "/metrics")) if ("GET", "/metrics") not in found else None
    return found


def call(client: TestClient, method: str, path: str, auth: str | None) -> int:
    url = re.sub(r"\{(\w+)(:path)?\}", lambda m: PARAMS[m.group(1)], path)
    headers = {"Authorization": auth} if auth is not None else {}
    body: dict[str, object] = {}
    if method in ("POST", "PUT"):
        body = {"content": b"{}", "headers": {**headers, "X-Muster-Sha256": "00" * 32}}
    else:
        body = {"headers": headers}
    return client.request(method, url, **body).status_code  # type: ignore[arg-type]


def test_every_route_is_decided(store: Store, tmp_path: Path) -> None:
    with serve(store, tmp_path, tls=True) as client:
        assert set(routes(client)) == set(RIGHTS)


def test_every_route_checks_its_own_credential(store: Store, tmp_path: Path) -> None:
    creds = credentials(store)
    with serve(store, tmp_path, tls=True) as client:
        stale, stale_ws = link_ticket(client, creds.join_secret, "gone")
        stale_ws.__exit__(None, None, None)  # type: ignore[attr-defined]
        live, live_ws = link_ticket(client, creds.join_secret, "w1")
        try:
            callers = {
                "nobody": None,
                "forged ticket": "Ticket x",
                "stale ticket": f"Ticket {stale}",
                "agent ticket": f"Ticket {live}",
                "join secret": f"Bearer {creds.join_secret}",
                "wrong token": "Bearer not-the-token",
                "api token": f"Bearer {creds.api_token}",
            }
            expected = {
                "user": {
                    "nobody": 401,
                    "forged ticket": 401,
                    "stale ticket": 401,
                    "agent ticket": 403,
                    "join secret": 403,
                    "wrong token": 401,
                },
                "agent": {
                    "nobody": 401,
                    "forged ticket": 401,
                    "stale ticket": 401,
                    "join secret": 403,
                    "wrong token": 401,
                    "api token": 403,
                    # A live ticket, but w1 is placed in no job: job-scoped, still refused.
                    "agent ticket": 403,
                },
            }
            wrong = []
            for method, path in routes(client):
                kind = RIGHTS[(method, path)]
                for who, auth in callers.items():
                    status = call(client, method, path, auth)
                    want = expected.get(kind, {}).get(who)
                    if want is not None and status != want:
                        wrong.append(f"{method} {path} as {who}: {status}, want {want}")
                    if want is None and status in (401, 403):
                        wrong.append(f"{method} {path} as {who}: refused with {status}")
            assert not wrong, "\n".join(wrong)
        finally:
            live_ws.__exit__(None, None, None)  # type: ignore[attr-defined]


def test_forged_ticket_cannot_submit_over_tls(store: Store, tmp_path: Path) -> None:
    """The bypass this replaces: any 'Ticket ...' header used to pass the middleware."""
    with serve(store, tmp_path, tls=True) as client:
        auth = {"Authorization": "Ticket x"}
        assert client.get("/v1/jobs", headers=auth).status_code == 401
        job = {"spec": {"name": "x", "entrypoint": "t.py"}}
        assert client.post("/v1/jobs", json=job, headers=auth).status_code == 401
        assert client.post("/v1/bundles", content=b"x", headers=auth).status_code == 401
        assert store.jobs() == []


def test_loopback_without_tls_keeps_user_routes_open_but_not_agent_routes(
    store: Store, tmp_path: Path
) -> None:
    with serve(store, tmp_path, tls=False) as client:
        assert client.get("/v1/jobs").status_code == 200
        assert client.get(f"/v1/bundles/{'ab' * 32}").status_code == 401
        assert (
            client.get(
                f"/v1/bundles/{'ab' * 32}", headers={"Authorization": "Ticket x"}
            ).status_code
            == 401
        )


def test_a_ticket_fetches_only_bundles_of_its_own_jobs(store: Store, tmp_path: Path) -> None:
    creds = credentials(store)
    with serve(store, tmp_path, tls=True) as client:
        api = {"Authorization": f"Bearer {creds.api_token}"}
        sha = client.post("/v1/bundles", content=b"someone else's code", headers=api).json()
        ticket, ws = link_ticket(client, creds.join_secret)
        try:
            got = client.get(
                f"/v1/bundles/{sha['sha256']}", headers={"Authorization": f"Ticket {ticket}"}
            )
            assert got.status_code == 403
            assert "placed in no running job" in got.json()["error"]
        finally:
            ws.__exit__(None, None, None)  # type: ignore[attr-defined]


def test_uploads_over_the_limit_get_413_naming_the_flag(store: Store, tmp_path: Path) -> None:
    config = ControllerConfig(
        store=store, artifacts=tmp_path / "artifacts", max_bundle_bytes=1 << 20
    )
    with TestClient(create_app(config), base_url="http://127.0.0.1:7070") as client:
        big = b"x" * ((1 << 20) + 1)
        answer = client.post("/v1/bundles", content=big)
        assert answer.status_code == 413
        assert "--max-bundle-mb" in answer.json()["error"]
        # Streamed without a length, it is refused as it crosses the limit; nothing kept.
        answer = client.post("/v1/bundles", content=iter([big[: 1 << 19], big[1 << 19 :]]))
        assert answer.status_code == 413
        assert list((tmp_path / "artifacts" / "bundles").iterdir()) == []
        assert client.post("/v1/bundles", content=b"small").status_code == 201


def test_an_artifact_of_a_job_id_no_job_can_have_is_a_404_not_a_crash(
    store: Store, tmp_path: Path
) -> None:
    """Found by the schema fuzzer: a 300-character job id reached the file system
    (ENAMETOOLONG, HTTP 500); '..' would step out of the artifacts directory."""
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "secret").write_text("x")  # what '..' would reach
    with serve(store, tmp_path, tls=False) as client:
        for job_id in ("0" * 300, "%2E%2E", "..", "a" + "\u0080" * 120):
            got = client.get(f"/v1/jobs/{job_id}/artifacts/1/secret")
            assert got.status_code == 404, (job_id, got.status_code, got.text)
        long_name = client.get(f"/v1/jobs/job-0123456789/artifacts/1/{'n' * 300}")
        assert long_name.status_code == 404


def test_an_open_loopback_controller_answers_no_other_site(store: Store, tmp_path: Path) -> None:
    """Open on loopback means this machine's tools, not every page its browser opens: a
    cross-site post (its Origin) and a rebound name (its Host) are refused; the token, or
    the controller's own pages, still work."""
    with serve(store, tmp_path, tls=False) as client:
        assert client.get("/v1/jobs").status_code == 200
        same = {"Origin": "http://127.0.0.1:7070"}
        assert client.get("/v1/jobs", headers=same).status_code == 200
        assert client.get("/v1/jobs", headers={"Host": "127.0.0.2:7070"}).status_code == 200
        assert client.get("/v1/jobs", headers={"Host": "[::1]:7070"}).status_code == 200
        for headers in (
            {"Origin": "https://evil.example"},
            {"Origin": "null"},
            {"Origin": "http://127.0.0.1:9999"},
            {"Origin": "https://127.0.0.1:7070"},
            {"Origin": "http://127.0.0.1:abc"},
            {"Host": "evil.example:7070"},
            {"Host": "127.0.0.1.evil.example:7070"},
        ):
            answer = client.post("/v1/jobs", content=b"{}", headers=headers)
            assert answer.status_code == 403, headers
            assert "another site" in answer.json()["error"] or "Host" in answer.json()["error"]
            assert client.get("/ui/jobs", headers=headers, follow_redirects=False).status_code in (
                303,
                401,
            ), headers
        token = f"Bearer {credentials(store).api_token}"
        evil = {"Origin": "https://evil.example", "Authorization": token}
        assert client.get("/v1/jobs", headers=evil).status_code == 200, "the token decides"
        # Behind a proxy under another name, signing in to the dashboard opens it.
        proxied = {"Host": "notebook.internal:8888"}
        signed = client.post(
            "/ui/login",
            data={"token": credentials(store).api_token},
            headers=proxied,
            follow_redirects=False,
        )
        assert signed.status_code == 303
        assert client.get("/ui/jobs/rows", headers=proxied).status_code == 200


def test_a_job_whose_events_hold_a_huge_integer_is_described(store: Store, tmp_path: Path) -> None:
    """orjson stops at 64 bits; stored JSON may hold more (an event's data, a spec stored
    before the spec bounded its integers): the detail is still served, the number intact."""
    job = store.submit_job(parse_job({"name": "big", "entrypoint": "t.py"}))
    store.record_event("Note", "a big number", job=job.id, data={"n": 2**70, "loss": math.nan})
    with serve(store, tmp_path, tls=False) as client:
        answer = client.get(f"/v1/jobs/{job.id}")
    assert answer.status_code == 200, answer.text
    assert "NaN" not in answer.text, "not JSON: strict parsers (browsers, jq) refuse it"
    note = next(e for e in answer.json()["events"] if e["kind"] == "Note")
    assert note["data"] == {"n": 2**70, "loss": None}, "NaN as null, as orjson writes it"


def test_a_job_whose_stored_spec_no_longer_validates_is_still_described(
    store: Store, tmp_path: Path
) -> None:
    """A spec an older muster stored (here a timeout this version bounds) is shown with the
    reason instead of a 500; what needs the spec (logs of one node) says which job and why."""
    job = store.submit_job(parse_job({"name": "old", "entrypoint": "t.py"}))
    with store.db.transaction() as s:
        s.execute(update(Job).where(Job.id == job.id).values(spec={**job.spec, "timeout": 2**40}))
    with serve(store, tmp_path, tls=False) as client:
        described = client.get(f"/v1/jobs/{job.id}")
        logs = client.get(f"/v1/jobs/{job.id}/logs", params={"node": 0})
    assert described.status_code == 200, described.text
    assert described.json()["world_size"] is None
    assert "its stored spec no longer validates (timeout" in described.json()["spec_error"]
    assert logs.status_code == 409, logs.text
    assert f"job {job.id}: its stored spec no longer validates" in logs.text
