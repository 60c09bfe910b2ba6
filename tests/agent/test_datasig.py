"""The dataset signature of a walk-in's data root, and its per-file cache."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

import muster.agent.datasig
from muster.agent.datasig import data_signature


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_signature_is_of_names_sizes_and_contents(tmp_path: Path) -> None:
    a = tree(tmp_path / "a", {"shard/0.bin": "zero", "shard/1.bin": "one", "meta.json": "{}"})
    b = tree(tmp_path / "b", {"shard/0.bin": "zero", "shard/1.bin": "one", "meta.json": "{}"})
    assert data_signature(a) == data_signature(b)
    # By hand: the sha256 of "path<TAB>size<TAB>sha256(content)" lines in path order.
    lines = "".join(
        f"{name}\t{len(text)}\t{hashlib.sha256(text.encode()).hexdigest()}\n"
        for name, text in sorted(
            {"meta.json": "{}", "shard/0.bin": "zero", "shard/1.bin": "one"}.items()
        )
    )
    assert data_signature(a) == hashlib.sha256(lines.encode()).hexdigest()
    (b / "shard" / "1.bin").write_text("uno")  # same size, other bytes
    assert data_signature(a) != data_signature(b)
    (b / "shard" / "1.bin").write_text("one")
    (b / "shard" / "1.bin").rename(b / "shard" / "2.bin")  # same bytes, other name
    assert data_signature(a) != data_signature(b)


def test_symlinked_directories_are_followed_once_each(tmp_path: Path) -> None:
    real = tree(tmp_path / "blobs", {"x.bin": "payload"})
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "snapshot").symlink_to(real, target_is_directory=True)
    (linked / "snapshot" / "loop").symlink_to(linked, target_is_directory=True)  # a cycle
    copied = tree(tmp_path / "copied", {"snapshot/x.bin": "payload"})
    assert data_signature(linked) == data_signature(copied)


def test_unchanged_files_are_not_read_again_and_a_change_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tree(tmp_path / "data", {f"shard/{i}.bin": f"rows {i}" for i in range(20)})
    past = time.time() - 100  # (a file written in the last 2 s is never cached: see below)
    for shard in (root / "shard").iterdir():
        os.utime(shard, (past, past))
    cache = tmp_path / "cache"
    read: list[str] = []
    real_digest = muster.agent.datasig._digest

    def counting(path: Path) -> str:
        read.append(path.name)
        return real_digest(path)

    monkeypatch.setattr(muster.agent.datasig, "_digest", counting)
    first = data_signature(root, cache)
    assert len(read) == 20
    read.clear()
    assert data_signature(root, cache) == first
    assert read == []  # every digest came from the cache
    changed = root / "shard" / "7.bin"
    changed.write_text("rows 7, amended")
    os.utime(changed, (past + 50, past + 50))
    second = data_signature(root, cache)
    assert read == ["7.bin"]
    assert second != first
    assert second == data_signature(
        tree(
            tmp_path / "fresh",
            {
                **{f"shard/{i}.bin": f"rows {i}" for i in range(20)},
                "shard/7.bin": "rows 7, amended",
            },
        )
    )


def test_a_damaged_cache_is_ignored(tmp_path: Path) -> None:
    root = tree(tmp_path / "data", {"a.bin": "a"})
    cache = tmp_path / "cache"
    honest = data_signature(root, cache)
    for stored in cache.iterdir():
        stored.write_text('{"version": 1, "files": {"a.bin": [1, 2, 3, 4, "forged"]}')
    assert data_signature(root, cache) == honest
    for stored in cache.iterdir():
        stored.write_text("not json")
    assert data_signature(root, cache) == honest


def test_an_alias_is_listed_under_each_name_in_name_order(tmp_path: Path) -> None:
    real = tree(tmp_path / "data", {"a/f.bin": "x"})
    (real / "b").symlink_to(real / "a", target_is_directory=True)
    copied = tree(tmp_path / "copy", {"a/f.bin": "x", "b/f.bin": "x"})
    assert data_signature(real) == data_signature(copied)
