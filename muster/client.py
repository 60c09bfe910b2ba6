"""Typed HTTP client for the controller API (CLI, tests, Python SDK), and bundle packing."""

from __future__ import annotations

import gzip
import hashlib
import hmac
import io
import os
import ssl
import tarfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from muster.errors import (
    BadRequest,
    FieldError,
    InfrastructureError,
    MusterError,
    NotFound,
    SpecError,
    UserError,
)
from muster.spec import JobSpec

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


class Client:
    """One controller's API. Errors come back as muster's own (SpecError for 422, ...)."""

    def __init__(
        self, url: str | None = None, token: str | None = None, timeout: float = 60.0
    ) -> None:
        self.url = controller_url(url)
        token = token or os.environ.get("MUSTER_API_TOKEN")
        secret, pin = split_token(token) if token else ("", None)
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
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
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                raise UserError(
                    f"the controller at {self.url} has a certificate this machine does not "
                    "trust: give the whole string `muster token --api` prints (--token-file or "
                    "MUSTER_API_TOKEN); its sha256 part pins the certificate"
                ) from exc
            raise InfrastructureError(
                f"cannot reach the controller at {self.url} ({exc}); start it with "
                "`muster server` or point --controller / MUSTER_CONTROLLER at it"
            ) from exc
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

    def logs(
        self,
        job_id: str,
        *,
        rank: int | None = None,
        node: int | None = None,
        after: str = "",
        limit: int = 10_000,
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"after": after, "limit": limit}
        if rank is not None:
            params["rank"] = rank
        if node is not None:
            params["node"] = node
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
