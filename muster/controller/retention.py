"""Retention: what `muster gc` and `muster server --retention` delete, and when.

A job is past retention when it is terminal (succeeded, failed, cancelled) and finished
more than the retention ago. For such a job retention deletes

- its uploaded outputs, ``<artifacts>/artifacts/<job>/``, and their artifact rows;
- its log lines, only when asked (``--logs`` / ``--retention-logs``);

and it deletes every bundle ``<artifacts>/bundles/<sha256>.tar.gz`` that no job short of
retention refers to (``jobs.bundle_sha256``) and that was uploaded before the cutoff, so a
bundle uploaded for a job about to be submitted stays. Job rows and events stay. A job that
is not terminal is never touched, whatever its age.

``plan_bundles`` is the decision (pure); ``collect`` reads the store and the disk, applies
it and returns a ``RetentionReport``; ``collect_every`` runs ``collect`` on a timer.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from muster.controller.files import SHA256
from muster.errors import InfrastructureError
from muster.store import Store

log = logging.getLogger("muster.retention")

HOURLY = 3600.0


@dataclass(frozen=True)
class RetentionReport:
    """What one pass removed (or, in a dry run, would remove)."""

    cutoff: datetime
    dry_run: bool
    jobs: tuple[str, ...]
    artifact_files: int
    artifact_bytes: int
    artifact_rows: int
    log_lines: int
    bundles: tuple[str, ...]
    bundle_bytes: int

    def summary(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        return (
            f"{len(self.jobs)} job(s) finished before {self.cutoff:%Y-%m-%d %H:%M:%S} UTC: "
            f"{verb} {self.artifact_files} artifact file(s) ({_size(self.artifact_bytes)}), "
            f"{self.artifact_rows} artifact row(s), {self.log_lines} log line(s), "
            f"{len(self.bundles)} bundle(s) ({_size(self.bundle_bytes)})"
        )


def cutoff_for(retention: timedelta, now: datetime | None = None) -> datetime:
    """The instant before which a terminal job is past ``retention``."""
    return (now or datetime.now(UTC)) - retention


def plan_bundles(
    on_disk: Mapping[str, float], in_use: Iterable[str], cutoff: datetime
) -> list[str]:
    """The bundles to delete: on disk (sha256 -> mtime), used by no live job, older than cutoff."""
    keep = set(in_use)
    before = cutoff.timestamp()
    return sorted(sha for sha, mtime in on_disk.items() if sha not in keep and mtime < before)


def collect(
    store: Store, root: Path, cutoff: datetime, *, logs: bool = False, dry_run: bool = False
) -> RetentionReport:
    """Apply the retention policy to the store and the file store at ``root``."""
    jobs = tuple(job.id for job in store.jobs_finished_before(cutoff))
    dirs = [d for d in (_artifact_dir(root, job) for job in jobs) if d is not None]
    files, size = _measure(dirs)
    bundles = plan_bundles(_bundles_on_disk(root), store.bundles_in_use(cutoff), cutoff)
    bundle_paths = [root / "bundles" / f"{sha}.tar.gz" for sha in bundles]
    bundle_bytes = _measure(bundle_paths)[1]
    if dry_run:
        rows = store.count_artifacts(jobs)
        lines = store.count_log_lines(jobs) if logs else 0
    else:
        rows = store.delete_artifacts(jobs)
        lines = store.delete_log_lines(jobs) if logs else 0
        for path in [*dirs, *bundle_paths]:
            _remove(path)
    return RetentionReport(
        cutoff, dry_run, jobs, files, size, rows, lines, tuple(bundles), bundle_bytes
    )


def collect_every(
    store: Store,
    root: Path,
    retention: timedelta,
    *,
    logs: bool = False,
    every: float = HOURLY,
    stop: threading.Event | None = None,
) -> None:
    """Run ``collect`` now and then every ``every`` seconds until ``stop`` is set."""
    stop = stop or threading.Event()
    while True:
        try:
            report = collect(store, root, cutoff_for(retention), logs=logs)
            if report.jobs or report.bundles:
                log.info("retention: %s", report.summary())
        except Exception:
            # One failed pass (a locked database, a file in use) must not end the timer.
            log.exception("retention pass failed; the next one runs in %.0f s", every)
        if stop.wait(every):
            return


def start_collecting(
    store: Store, root: Path, retention: timedelta, *, logs: bool = False
) -> threading.Event:
    """``collect_every`` in a daemon thread; set the returned event to stop it."""
    stop = threading.Event()
    threading.Thread(
        target=collect_every,
        args=(store, root, retention),
        kwargs={"logs": logs, "stop": stop},
        name="muster-retention",
        daemon=True,
    ).start()
    return stop


def _artifact_dir(root: Path, job_id: str) -> Path | None:
    if not job_id or job_id in (".", "..") or "/" in job_id or "\0" in job_id:
        return None  # not a name a job's directory can have
    path = root / "artifacts" / job_id
    return path if path.is_dir() and not path.is_symlink() else None


def _bundles_on_disk(root: Path) -> dict[str, float]:
    found: dict[str, float] = {}
    try:
        entries = list(os.scandir(root / "bundles"))
    except FileNotFoundError:
        return found
    for entry in entries:
        sha = entry.name.removesuffix(".tar.gz")
        if entry.name.endswith(".tar.gz") and SHA256.match(sha) and entry.is_file():
            found[sha] = entry.stat(follow_symlinks=False).st_mtime
    return found


def _measure(paths: Iterable[Path]) -> tuple[int, int]:
    """(files, bytes) under ``paths`` (files or directories), symlinks not followed."""
    files = size = 0
    for path in paths:
        if path.is_file():
            files, size = files + 1, size + path.lstat().st_size
            continue
        for top, _dirs, names in os.walk(path):
            for name in names:
                files += 1
                size += os.lstat(os.path.join(top, name)).st_size
    return files, size


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:
        raise InfrastructureError(f"retention could not remove {path}: {exc.strerror}") from exc


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"
