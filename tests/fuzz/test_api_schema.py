"""schemathesis over the controller's served OpenAPI: no input makes it answer 5xx.

Every operation is called with generated path, query, header and body values (half of the
time on a job that exists, with log lines), once with the API token and once with no
credential at all. With the token, any answer but a server error will do; without one,
every route but /v1/health answers 401 before it looks at the input.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import Case
from schemathesis.schemas import APIOperation

from muster.controller.app import ControllerConfig, create_app
from muster.controller.credentials import credentials
from muster.store import Store, open_store
from tests.fuzz.specs import mutated_specs, values

BOUNDED = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
OPEN = {("GET", "/v1/health")}


@dataclass
class Served:
    store: Store
    config: ControllerConfig
    token: str
    job_id: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("controller")
    store = open_store(str(root / "muster.db"))
    config = ControllerConfig(store=store, artifacts=root / "artifacts", tls=True)
    job = store.submit_job({"name": "fuzz", "entrypoint": "train.py"})
    store.append_logs(job.id, [("rank", 0, seq, time.time(), "stdout", "x") for seq in (1, 2)])
    yield Served(store, config, credentials(store).api_token, job.id)
    store.db.dispose()


@pytest.fixture(scope="module")
def operations(served: Served) -> list[APIOperation]:
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(served.config))
    found = [result.ok() for result in schema.get_all_operations()]
    assert len(found) >= 10, "the served OpenAPI lost its routes"
    return found


def each_operation(
    operations: list[APIOperation], served: Served, check: Callable[[Case], None]
) -> None:
    """Run ``check`` on generated cases of every operation, a bounded number each."""
    for operation in operations:

        @BOUNDED
        @given(case=operation.as_strategy(), on_the_job=st.booleans())
        def run(case: Case, on_the_job: bool) -> None:
            if on_the_job and "job_id" in (case.path_parameters or {}):
                case.path_parameters = {**(case.path_parameters or {}), "job_id": served.job_id}
            check(case)

        run()


def where(case: Case, status: int, who: str) -> str:
    return f"{case.method} {case.formatted_path} as {who}: {status}\n{case.as_curl_command()}"


def test_no_server_error_with_the_api_token(served: Served, operations: list[APIOperation]) -> None:
    def check(case: Case) -> None:
        response = case.call(headers={"Authorization": f"Bearer {served.token}"})
        assert response.status_code < 500, where(case, response.status_code, "user")

    each_operation(operations, served, check)


def test_only_401_without_credentials(served: Served, operations: list[APIOperation]) -> None:
    def check(case: Case) -> None:
        headers = case.headers or {}
        case.headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        response = case.call()
        want = 200 if (case.method, case.operation.path) in OPEN else 401
        if response.status_code == 404 and response.json() == {"detail": "Not Found"}:
            return  # no route matched the URL (say, a newline in {rel}): no handler ran
        assert response.status_code == want, where(case, response.status_code, "nobody")

    each_operation(operations, served, check)


def as_json(value: object) -> bytes:
    return json.dumps(value).encode()


# The submit route reads its body itself, so the OpenAPI gives schemathesis nothing to build
# one from: arbitrary bytes, JSON of any shape, and objects whose spec is nearly valid.
bodies = st.one_of(
    st.binary(max_size=200),
    values.map(as_json),
    st.fixed_dictionaries({"spec": values}, optional={"bundle_sha256": values}).map(as_json),
    st.fixed_dictionaries({"spec": mutated_specs()}).map(as_json),
)


@pytest.fixture(scope="module")
def user_client(served: Served) -> Iterator[TestClient]:
    with TestClient(create_app(served.config)) as client:
        client.headers["Authorization"] = f"Bearer {served.token}"
        yield client


@settings(BOUNDED, max_examples=200)
@given(body=bodies)
def test_submit_answers_any_body_without_a_server_error(
    user_client: TestClient, body: bytes
) -> None:
    response = user_client.post(
        "/v1/jobs", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code < 500, (body, response.status_code, response.text)
    if response.status_code >= 400:
        assert response.json()["error"], body


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (b"", "empty"),
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON list"),
        (b'"spec"', "JSON str"),
        (b'{"name": "x"}', "no 'spec'"),
        (b"[" * 100_000, "not JSON"),
    ],
)
def test_submit_names_a_body_that_is_not_a_job(
    user_client: TestClient, body: bytes, named: str
) -> None:
    response = user_client.post("/v1/jobs", content=body)
    assert response.status_code == 400
    assert named in response.json()["error"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("priority", 2**31), ("priority", 2**63), ("distributed", {"num_workers": 10**12})],
)
def test_submit_refuses_numbers_the_store_cannot_hold(
    user_client: TestClient, field: str, value: object
) -> None:
    spec = {"name": "big", "entrypoint": "train.py", field: value}
    response = user_client.post("/v1/jobs", json={"spec": spec})
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"].startswith(field)


def test_logs_refuse_ranks_and_cursors_out_of_range(
    served: Served, user_client: TestClient
) -> None:
    logs = f"/v1/jobs/{served.job_id}/logs"
    assert len(user_client.get(logs).json()["lines"]) == 2
    huge_cursor = base64.urlsafe_b64encode(str(2**70).encode()).decode()
    for query in ({"rank": 2**70}, {"node": 2**70}, {"limit": 0}, {"after": huge_cursor}):
        response = user_client.get(logs, params=query)
        assert 400 <= response.status_code < 500, (query, response.text)
