"""Agent work-dir retention: remove ``<work_dir>/<job>/`` of jobs long gone from this agent.

A job's directory goes when nothing under it (the directory included) was modified within
the retention and the job is not running on this agent. Files in the work dir itself (the
``.agent-alive`` heartbeat file), hidden entries and symlinks are never touched. A
retention of zero keeps everything.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Collection
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

log = logging.getLogger("muster.agent.retention")


@dataclass(frozen=True)
class WorkDirReport:
    """The job directories a pass removed, and how many bytes they held."""

    removed: tuple[str, ...]
    bytes: int


def newest_change(path: Path) -> tuple[float, int]:
    """(the newest mtime of ``path`` and everything under it, the bytes of its files)."""
    newest = path.lstat().st_mtime
    size = 0
    for top, dirs, names in os.walk(path):
        for name in [*dirs, *names]:
            try:
                st = os.lstat(os.path.join(top, name))
            except FileNotFoundError:
                continue
            newest = max(newest, st.st_mtime)
            if name in names:
                size += st.st_size
    return newest, size


def stale_job_dirs(
    work_dir: Path, retention: timedelta, running: Collection[str], now: float | None = None
) -> list[tuple[Path, int]]:
    """The job directories past ``retention`` and not in ``running``, with their sizes."""
    if retention <= timedelta(0):
        return []
    cutoff = (time.time() if now is None else now) - retention.total_seconds()
    try:
        entries = sorted(os.scandir(work_dir), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    stale = []
    for entry in entries:
        if entry.name.startswith(".") or entry.name in running:
            continue
        if not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        newest, size = newest_change(path)
        if newest < cutoff:
            stale.append((path, size))
    return stale


def remove_stale_job_dirs(
    work_dir: Path, retention: timedelta, running: Collection[str] = (), now: float | None = None
) -> WorkDirReport:
    """Delete the stale job directories; one that cannot be removed is logged and kept."""
    removed: list[str] = []
    total = 0
    for path, size in stale_job_dirs(work_dir, retention, running, now):
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("retention: cannot remove %s: %s", path, exc.strerror)
            continue
        removed.append(path.name)
        total += size
    if removed:
        log.info("retention: removed %d job dir(s), %d bytes: %s", len(removed), total, removed)
    return WorkDirReport(tuple(removed), total)
