"""Where the controller keeps source bundles and uploaded artifacts on disk."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from muster.errors import BadRequest, NotFound, TooLarge

SHA256 = re.compile(r"^[0-9a-f]{64}$")

# What a job id can be (muster.store.jobs.new_job_id: the job's name, "-", 10 hex digits).
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")


class FileStore:
    """``bundles/<sha256>.tar.gz`` and ``artifacts/<job>/node<r>/<path>`` under one root."""

    def __init__(
        self, root: Path, *, max_bundle_bytes: int = 512 << 20, max_artifact_bytes: int = 8 << 30
    ) -> None:
        self.root = root
        self.max_bundle_bytes = max_bundle_bytes
        self.max_artifact_bytes = max_artifact_bytes
        for sub in (root, root / "bundles", root / "artifacts"):
            sub.mkdir(mode=0o700, parents=True, exist_ok=True)

    def bundle_path(self, sha256: str) -> Path:
        if not SHA256.match(sha256):
            raise BadRequest(f"{sha256!r} is not a sha256 hex digest")
        return self.root / "bundles" / f"{sha256}.tar.gz"

    def has_bundle(self, sha256: str) -> bool:
        return self.bundle_path(sha256).is_file()

    def bundle_limit(self) -> Limit:
        return Limit(self.max_bundle_bytes, "a source bundle", "--max-bundle-mb")

    def artifact_limit(self, rel: str) -> Limit:
        return Limit(self.max_artifact_bytes, f"artifact {rel}", "--max-artifact-mb")

    async def save_bundle(self, chunks: AsyncIterator[bytes]) -> tuple[str, int]:
        """Store an uploaded bundle under its own digest; returns (sha256, size)."""
        limit = self.bundle_limit()
        tmp, digest, size = await _spool(chunks, self.root / "bundles", limit)
        target = self.bundle_path(digest)
        os.replace(tmp, target)
        return digest, size

    def artifact_path(self, job_id: str, node_rank: int, rel: str) -> Path:
        if not JOB_ID.fullmatch(job_id):  # never a path of its own ("..", too long, ...)
            raise NotFound(f"there is no job {job_id[:80]!r}")
        clean = safe_relative(rel)
        return self.root / "artifacts" / job_id / f"node{node_rank}" / clean

    async def save_artifact(
        self, job_id: str, node_rank: int, rel: str, chunks: AsyncIterator[bytes], sha256: str
    ) -> int:
        """Stream an artifact to disk; refuse it (keeping nothing) if its sha256 differs."""
        target = self.artifact_path(job_id, node_rank, rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        limit = self.artifact_limit(rel)
        tmp, digest, size = await _spool(chunks, target.parent, limit)
        if digest != sha256:
            os.unlink(tmp)
            raise BadRequest(f"artifact {rel}: sha256 {digest} does not match {sha256}")
        os.replace(tmp, target)
        return size

    def open_artifact(self, job_id: str, node_rank: int, rel: str) -> Path:
        path = self.artifact_path(job_id, node_rank, rel)
        try:
            found = path.is_file()
        except OSError:  # a name longer than the file system takes, say: no such file
            found = False
        if not found:
            raise NotFound(f"job {job_id} has no artifact node{node_rank}/{rel[:200]}")
        return path


def safe_relative(rel: str) -> PurePosixPath:
    """A relative path with no '..', absolute part or empty name."""
    path = PurePosixPath(rel)
    if not rel or "\0" in rel or path.is_absolute() or ".." in path.parts or "" in path.parts:
        raise BadRequest(f"{rel!r} is not a relative path inside the output directory")
    return path


@dataclass(frozen=True)
class Limit:
    """An upload's size limit, with what it is and the server flag that sets it."""

    most: int
    what: str
    flag: str

    def check(self, size: int) -> None:
        if size > self.most:
            raise TooLarge(
                f"{self.what} is over the controller's limit of {self.most >> 20} MiB; "
                f"raise it with `muster server {self.flag} N`"
            )


async def _spool(chunks: AsyncIterator[bytes], where: Path, limit: Limit) -> tuple[str, str, int]:
    """Stream to a temporary file, refusing (and keeping nothing) past ``limit``."""
    digest = hashlib.sha256()
    size = 0
    fd, tmp = tempfile.mkstemp(dir=where, prefix=".upload-")
    try:
        with os.fdopen(fd, "wb") as out:
            async for chunk in chunks:
                size += len(chunk)
                limit.check(size)
                digest.update(chunk)
                out.write(chunk)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp, digest.hexdigest(), size
