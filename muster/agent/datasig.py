"""A walk-in's dataset signature (seed 003): the sha256 of a manifest of every file under its
data root (relative path, size, sha256 of the content), in path order. Two boxes with the same
signature hold the same data; the window refuses a box whose signature differs.

Hashing every byte is the honest check and the slow one (a 100 GB root is a minute or more),
so each file's digest is kept in a cache beside the agent's work (keyed by size, mtime, ctime
and inode, as git and rsync decide a file is unchanged): a box computes the whole signature
once, and again before every dial only for what changed. Symlinked directories are followed
(dataset caches are built of them) under each name they have, never into a directory's own
ancestors; names are walked in sorted order, whatever order the filesystem lists them in.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

CACHE_VERSION = 1
_BLOCK = 1 << 20


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _files(root: Path) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every regular file under ``root``, in name order,
    following symlinked directories (an alias is listed under each of its names) but never
    into one of its own ancestors (a link back up the tree)."""
    found: list[tuple[str, Path]] = []

    def walk(directory: Path, relative: str, ancestors: frozenset[tuple[int, int]]) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            path = Path(entry.path)
            name = f"{relative}{entry.name}"
            if entry.is_dir(follow_symlinks=True):
                st = path.stat()
                key = (st.st_dev, st.st_ino)
                if key not in ancestors:
                    walk(path, f"{name}/", ancestors | {key})
            elif entry.is_file(follow_symlinks=True):  # (a dangling link is no file)
                found.append((name, path))

    st = root.stat()
    walk(root, "", frozenset({(st.st_dev, st.st_ino)}))
    return sorted(found)


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def data_signature(root: Path, cache_dir: Path | None = None) -> str:
    """The signature of the files under ``root``; with ``cache_dir``, files whose stamp has
    not moved since the last call are not read again."""
    cache_file = None
    known: dict[str, list[object]] = {}
    if cache_dir is not None:
        key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:32]
        cache_file = cache_dir / f"{key}.json"
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stored = json.loads(cache_file.read_text())
            if stored.get("version") == CACHE_VERSION:
                known = dict(stored["files"])
    manifest = hashlib.sha256()
    fresh: dict[str, list[object]] = {}
    for relative, path in _files(root):
        stamp = _stamp(path.stat())
        size = stamp[0]
        cached = known.get(relative)
        if cached is not None and cached[:4] == stamp and isinstance(cached[4], str):
            content = cached[4]
        else:
            content = _digest(path)
            # Written while read, or so recently that a rewrite within the filesystem's
            # timestamp granularity (1 s on sshfs) would keep this stamp: not cached.
            if _stamp(path.stat()) != stamp or time.time_ns() - stamp[1] < 2 * 10**9:
                stamp = [-1]
        fresh[relative] = [*stamp, content]
        manifest.update(f"{relative}\t{size}\t{content}\n".encode())
    if cache_file is not None and fresh != known:
        with contextlib.suppress(OSError):
            cache_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            partial = cache_file.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps({"version": CACHE_VERSION, "files": fresh}))
            partial.replace(cache_file)
    return manifest.hexdigest()
