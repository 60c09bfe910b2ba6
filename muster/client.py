"""Typed HTTP client for the controller API (CLI, tests, Python SDK), and bundle packing.

The Python SDK::

    from muster import launch, Client

    result = launch("examples/ddp/job.yaml")      # submits, prints [rankN] lines, waits
    result.state, result.exit_codes, result.artifacts
    Client().jobs()                               # everything else (AsyncClient: the same, async)

``launch`` raises ``muster.errors.JobFailed`` (carrying the result) when the job fails or is
cancelled, and the other ``MusterError`` kinds for what stops it earlier (a SpecError for a
bad spec, an InfrastructureError for an unreachable controller, ...).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import hmac
import io
import os
import re
import ssl
import sys
import tarfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from muster.errors import (
    BadRequest,
    FieldError,
    InfrastructureError,
    JobFailed,
    MusterError,
    NotFound,
    SpecError,
    UserError,
)
from muster.spec import JobSpec, load_job_file, parse_job

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
PAGE = 10_000  # log lines per request

DEFAULT_URL = "http://127.0.0.1:7070"
SKIP_DIRS = {
    ".git",
    ".hg",
    ".venv",
    "venv",
    "env",
    "__pycache__",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    "node_modules",
    ".tox",
}


def controller_url(url: str | None = None) -> str:
    return (url or os.environ.get("MUSTER_CONTROLLER") or DEFAULT_URL).rstrip("/")


def split_token(token: str) -> tuple[str, str | None]:
    """``SECRET.sha256:HEX`` (what `muster token` prints) -> (secret, fingerprint or None)."""
    secret, _, pin = token.strip().partition(".")
    return secret, pin.removeprefix("sha256:").lower() or None


def pinned_ssl_context(url: str, fingerprint: str | None) -> ssl.SSLContext:
    """Trust exactly the controller certificate whose sha256 the join string carries.

    Without a fingerprint the system's CAs decide (a certificate the user gave the
    controller from a real CA).
    """
    if fingerprint is None:
        return ssl.create_default_context()
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 443
    try:
        pem = ssl.get_server_certificate((host, port), timeout=10)
    except OSError as exc:
        raise InfrastructureError(f"cannot reach the controller at {url}: {exc}") from exc
    seen = hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()
    if not hmac.compare_digest(seen, fingerprint):
        raise InfrastructureError(
            f"the controller at {url} presented certificate sha256:{seen}, not the "
            f"sha256:{fingerprint} in the token: refusing to talk to it (copy the string "
            "again from `muster token` on the controller, or check the URL)"
        )
    context = ssl.create_default_context(cadata=pem)
    context.check_hostname = False  # the pin names the exact certificate
    return context


def _credentials(token: str | None) -> tuple[dict[str, str], str | None]:
    """The Authorization header for ``token`` (or MUSTER_API_TOKEN), and its certificate pin."""
    token = token or os.environ.get("MUSTER_API_TOKEN")
    secret, pin = split_token(token) if token else ("", None)
    return ({"Authorization": f"Bearer {secret}"} if secret else {}), pin


def _log_params(
    rank: int | None,
    node: int | None,
    after: str,
    limit: int,
    ranks: str,
    origin: str | None,
    before: str,
    tail: bool,
) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": limit}
    for key, value in (("after", after), ("ranks", ranks), ("before", before)):
        if value:
            params[key] = value
    if tail:
        params["tail"] = "true"
    for key, number in (("rank", rank), ("node", node)):
        if number is not None:
            params[key] = number
    if origin is not None:
        params["origin"] = origin
    return params


class Client:
    """One controller's API. Errors come back as muster's own (SpecError for 422, ...)."""

    def __init__(
        self, url: str | None = None, token: str | None = None, timeout: float = 60.0
    ) -> None:
        self.url = controller_url(url)
        headers, pin = _credentials(token)
        verify: ssl.SSLContext | bool = True
        if self.url.startswith("https://"):
            verify = pinned_ssl_context(self.url, pin)
        self.http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers, verify=verify)

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise _unreachable(self.url, exc) from exc
        return _answer(response)

    def follow(
        self,
        job_id: str,
        *,
        rank: int | None = None,
        poll: float = 0.3,
        timeout: float | None = None,
    ) -> Iterator[dict[str, Any]]:
        """The job's log lines (dicts: rank, origin, text, ...) as they arrive, until it ends
        (TimeoutError after ``timeout`` seconds, printing or not; the job goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        cursor = ""
        while True:
            page = self.logs(job_id, rank=rank, after=cursor, limit=PAGE)
            cursor = page["next"]
            yield from page["lines"]
            if len(page["lines"]) >= PAGE:
                continue
            if page["state"] in TERMINAL:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {page['state']} after {timeout:g}s")
            time.sleep(poll)

    def wait(self, job_id: str, timeout: float | None = None, poll: float = 0.5) -> JobResult:
        """Block until the job ends (``timeout`` seconds at most: then TimeoutError)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (job := self.job(job_id))["state"] not in TERMINAL:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job['state']} after {timeout:g}s")
            time.sleep(poll)
        return JobResult.of(job, self.artifacts(job_id))

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/v1/health")
        return result

    def upload_bundle(self, data: bytes) -> str:
        return str(self._call("POST", "/v1/bundles", content=data)["sha256"])

    def submit(self, spec: dict[str, Any], bundle_sha256: str | None) -> dict[str, Any]:
        result: dict[str, Any] = self._call(
            "POST", "/v1/jobs", json={"spec": spec, "bundle_sha256": bundle_sha256}
        )
        return result

    def submit_with_bundle(self, spec: JobSpec, workdir: Path) -> dict[str, Any]:
        """Pack ``workdir`` as the source bundle, upload it, and queue ``spec`` with it."""
        bundle, digest = pack_bundle(workdir)
        if self.upload_bundle(bundle) != digest:
            raise MusterError("the controller stored a different bundle digest; try again")
        return self.submit(spec.model_dump(mode="json"), digest)

    def jobs(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/v1/jobs")
        return result

    def job(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/v1/jobs/{job_id}")
        return result

    def cancel(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/v1/jobs/{job_id}/cancel")
        return result

    def start(self, job_id: str) -> dict[str, Any]:
        """Fire the job's staging join window (``muster start``)."""
        return dict(self._call("POST", f"/v1/jobs/{job_id}/start"))

    def window(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/jobs/{job_id}/window"))

    def usage(self, job_id: str) -> dict[str, Any]:
        """What the job's members sent through the relays (``GET .../usage``)."""
        return dict(self._call("GET", f"/v1/jobs/{job_id}/usage"))

    def stacks(
        self, job_id: str, *, rank: int | None = None, native: bool = False
    ) -> dict[str, Any]:
        """Every running rank's Python stack (or ``rank``'s): see ``GET .../stacks``."""
        params: dict[str, Any] = {"native": "true" if native else "false"}
        if rank is not None:
            params["rank"] = rank
        result: dict[str, Any] = self._call("POST", f"/v1/jobs/{job_id}/stacks", params=params)
        return result

    def logs(
        self,
        job_id: str,
        *,
        rank: int | None = None,
        node: int | None = None,
        after: str = "",
        limit: int = 10_000,
        ranks: str = "",
        origin: str | None = None,
        before: str = "",
        tail: bool = False,
    ) -> dict[str, Any]:
        """A page of a job's lines: forwards from ``after`` (the previous page's ``next``), or
        backwards with ``tail=True`` (the newest) and ``before`` (a page's ``prev``). Filters:
        ``rank`` or ``ranks`` ("0-3,7"), ``node``, ``origin`` ("rank", or "node" for torchrun's
        own lines)."""
        params = _log_params(rank, node, after, limit, ranks, origin, before, tail)
        result: dict[str, Any] = self._call("GET", f"/v1/jobs/{job_id}/logs", params=params)
        return result

    def artifacts(self, job_id: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", f"/v1/jobs/{job_id}/artifacts")
        return result

    def download_artifact(self, job_id: str, path: str, dest: Path) -> None:
        node, _, rel = path.partition("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        url = f"/v1/jobs/{job_id}/artifacts/{node.removeprefix('node')}/{rel}"
        with self.http.stream("GET", url) as response, open(dest, "wb") as out:
            if response.status_code != 200:
                raise NotFound(f"artifact {path} of job {job_id}: HTTP {response.status_code}")
            for chunk in response.iter_bytes():
                out.write(chunk)

    def workers(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/v1/workers")
        return result


def _unreachable(url: str, exc: Exception) -> MusterError:
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return UserError(
            f"the controller at {url} has a certificate this machine does not "
            "trust: give the whole string `muster token --api` prints (--token-file or "
            "MUSTER_API_TOKEN); its sha256 part pins the certificate"
        )
    return InfrastructureError(
        f"cannot reach the controller at {url} ({exc}); start it with "
        "`muster server` or point --controller / MUSTER_CONTROLLER at it"
    )


def _answer(response: httpx.Response) -> Any:
    """The body of a good answer, or muster's own error for a bad one."""
    if response.status_code < 400:
        return response.json() if response.content else None
    try:
        body = response.json()
    except ValueError:
        body = {"error": response.text}
    message = str(body.get("error", response.text))
    if response.status_code == 422 and "errors" in body:
        raise SpecError([FieldError(e["field"], e["message"]) for e in body["errors"]])
    if response.status_code == 404:
        raise NotFound(message)
    if response.status_code in (401, 403):
        raise UserError(
            f"{message} (pass --token-file, or set MUSTER_API_TOKEN, to what "
            "`muster token --api` prints on the controller)"
        )
    if response.status_code < 500:
        raise BadRequest(message)
    raise MusterError(f"controller error {response.status_code}: {message}")


class AsyncClient:
    """:class:`Client`'s calls, awaitable (httpx.AsyncClient); use ``async with``."""

    def __init__(
        self, url: str | None = None, token: str | None = None, timeout: float = 60.0
    ) -> None:
        self.url = controller_url(url)
        self._headers, self._pin = _credentials(token)
        self._timeout = timeout
        self._http: httpx.AsyncClient | None = None
        self._making = asyncio.Lock()  # two first calls at once make one client

    async def _client(self) -> httpx.AsyncClient:
        async with self._making:
            return await self._make()

    async def _make(self) -> httpx.AsyncClient:
        if self._http is None:
            verify: ssl.SSLContext | bool = True
            if self.url.startswith("https://"):  # (reads the certificate: off the loop)
                verify = await asyncio.to_thread(pinned_ssl_context, self.url, self._pin)
            self._http = httpx.AsyncClient(
                base_url=self.url, timeout=self._timeout, headers=self._headers, verify=verify
            )
        return self._http

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        http = await self._client()
        try:
            response = await http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise _unreachable(self.url, exc) from exc
        return _answer(response)

    async def health(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/v1/health"))

    async def submit_with_bundle(self, spec: JobSpec, workdir: Path) -> dict[str, Any]:
        bundle, digest = await asyncio.to_thread(pack_bundle, workdir)
        stored = await self._call("POST", "/v1/bundles", content=bundle)
        if str(stored["sha256"]) != digest:
            raise MusterError("the controller stored a different bundle digest; try again")
        body = {"spec": spec.model_dump(mode="json"), "bundle_sha256": digest}
        return dict(await self._call("POST", "/v1/jobs", json=body))

    async def jobs(self) -> list[dict[str, Any]]:
        return list(await self._call("GET", "/v1/jobs"))

    async def job(self, job_id: str) -> dict[str, Any]:
        return dict(await self._call("GET", f"/v1/jobs/{job_id}"))

    async def cancel(self, job_id: str) -> dict[str, Any]:
        return dict(await self._call("POST", f"/v1/jobs/{job_id}/cancel"))

    async def logs(
        self,
        job_id: str,
        *,
        rank: int | None = None,
        node: int | None = None,
        after: str = "",
        limit: int = PAGE,
        ranks: str = "",
        origin: str | None = None,
        before: str = "",
        tail: bool = False,
    ) -> dict[str, Any]:
        """As ``Client.logs``."""
        params = _log_params(rank, node, after, limit, ranks, origin, before, tail)
        return dict(await self._call("GET", f"/v1/jobs/{job_id}/logs", params=params))

    async def artifacts(self, job_id: str) -> list[dict[str, Any]]:
        return list(await self._call("GET", f"/v1/jobs/{job_id}/artifacts"))

    async def workers(self) -> list[dict[str, Any]]:
        return list(await self._call("GET", "/v1/workers"))

    async def follow(
        self, job_id: str, *, rank: int | None = None, poll: float = 0.3
    ) -> AsyncIterator[dict[str, Any]]:
        """The job's log lines as they arrive, until it ends."""
        cursor = ""
        while True:
            page = await self.logs(job_id, rank=rank, after=cursor)
            cursor = page["next"]
            for line in page["lines"]:
                yield line
            if len(page["lines"]) >= PAGE:
                continue
            if page["state"] in TERMINAL:
                return
            await asyncio.sleep(poll)

    async def wait(self, job_id: str, timeout: float | None = None, poll: float = 0.5) -> JobResult:
        """Until the job ends (``timeout`` seconds at most: then TimeoutError)."""
        async with asyncio.timeout(timeout):
            while (job := await self.job(job_id))["state"] not in TERMINAL:
                await asyncio.sleep(poll)
        return JobResult.of(job, await self.artifacts(job_id))


# How the controller words the rank torchrun blamed (muster.gang.causes.root_cause).
_BLAMED = re.compile(
    r"^node\d+ \(worker [^)]*\): global rank (?P<rank>\d+) "
    r"(?:exited with code (?P<code>-?\d+)|was killed by (?P<signal>\S+))"
)


@dataclass(frozen=True)
class JobResult:
    """What a job did, once it is over."""

    id: str
    state: str  # succeeded, failed or cancelled
    root_cause: str | None
    # Global rank -> exit code: 0 for every rank of a node that succeeded; the code of the
    # rank torchrun blamed; None where a rank was stopped (fail-fast, cancel) or is unknown.
    exit_codes: dict[int, int | None]
    signals: dict[int, str]  # rank -> the signal that killed it, where one did
    artifacts: list[dict[str, Any]]  # path (nodeN/...), size, sha256
    job: dict[str, Any] = field(repr=False)  # the whole description (members, events, ...)

    @property
    def ok(self) -> bool:
        return self.state == "succeeded"

    @classmethod
    def of(cls, job: Mapping[str, Any], artifacts: list[dict[str, Any]]) -> JobResult:
        codes: dict[int, int | None] = {}
        for member in job.get("members") or []:
            if not member.get("ranks"):  # a spec this version no longer reads (spec_error)
                continue
            first, last = member["ranks"]
            done = member["state"] == "succeeded"
            for rank in range(first, last + 1):
                codes[rank] = 0 if done else None
        signals: dict[int, str] = {}
        blamed = _BLAMED.match(job.get("root_cause") or "")
        if blamed:
            rank = int(blamed["rank"])
            if blamed["signal"]:
                signals[rank] = blamed["signal"]
            else:
                codes[rank] = int(blamed["code"])
        return cls(
            id=str(job["id"]),
            state=str(job["state"]),
            root_cause=job.get("root_cause"),
            exit_codes=codes,
            signals=signals,
            artifacts=list(artifacts),
            job=dict(job),
        )


def _spec_of(
    spec: str | Path | Mapping[str, Any] | JobSpec, workdir: Path | None
) -> tuple[JobSpec, Path]:
    """The spec, and the directory its workdir is relative to (the file's, else the cwd)."""
    if isinstance(spec, JobSpec):
        parsed, base = spec, Path.cwd()
    elif isinstance(spec, Mapping):
        parsed, base = parse_job(dict(spec)), Path.cwd()
    else:
        path = Path(spec)
        parsed, base = load_job_file(path), path.parent
    return parsed, (workdir or base / parsed.workdir).resolve()


def _printed(line: Mapping[str, Any]) -> str:
    label = f"rank{line['rank']}" if line["origin"] == "rank" else f"node{line['rank']}"
    return f"[{label}] {line['text']}"


def launch(
    spec: str | Path | Mapping[str, Any] | JobSpec,
    follow: bool = True,
    *,
    controller: str | None = None,
    token: str | None = None,
    workdir: str | Path | None = None,
    output: Callable[[str], None] | None = None,
    timeout: float | None = None,
) -> JobResult:
    """Submit a job (a YAML path, a dict, or a JobSpec), packing its workdir, and wait for it.

    With ``follow`` every log line is handed to ``output`` as ``[rank3] text`` (stdout by
    default) while the job runs. Returns the result of a job that succeeded; raises
    :class:`~muster.errors.JobFailed` (its ``result`` attached) for one that failed or was
    cancelled, and TimeoutError (the job goes on) after ``timeout`` seconds.
    """
    parsed, where = _spec_of(spec, Path(workdir) if workdir is not None else None)
    write = output or (lambda text: print(text, file=sys.stdout, flush=True))
    client = Client(controller, token)
    try:
        job_id = str(client.submit_with_bundle(parsed, where)["id"])
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        try:
            if follow:
                for line in client.follow(job_id, timeout=left()):
                    write(_printed(line))
            result = client.wait(job_id, timeout=left())
        except TimeoutError:
            raise TimeoutError(
                f"job {job_id} did not end within {timeout:g}s; it goes on "
                f"(`muster cancel {job_id}` stops it)"
            ) from None
    finally:
        client.close()
    if not result.ok:
        cause = (result.root_cause or "").split("\n")[0]
        raise JobFailed(f"job {job_id} {result.state}" + (f": {cause}" if cause else ""), result)
    return result


def pack_bundle(workdir: Path) -> tuple[bytes, str]:
    """The workdir as a reproducible tar.gz (no .git, virtual envs or caches) and its sha256."""
    if not workdir.is_dir():
        raise UserError(f"workdir {workdir} is not a directory; fix the job's workdir")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for base, dirs, names in os.walk(workdir):
            dirs[:] = sorted(
                d
                for d in dirs
                if d not in SKIP_DIRS and not (Path(base) / d / "pyvenv.cfg").exists()
            )
            for name in sorted(names):
                path = Path(base) / name
                if path.is_symlink() or not path.is_file():
                    continue
                info = tar.gettarinfo(str(path), arcname=path.relative_to(workdir).as_posix())
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
    data = gzip.compress(raw.getvalue(), mtime=0)
    return data, hashlib.sha256(data).hexdigest()
