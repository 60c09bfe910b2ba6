"""Bundle unpack refuses every entry that would land outside the run directory."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import pytest

from muster.agent.launcher import unpack_bundle
from muster.client import pack_bundle
from muster.errors import InfrastructureError


def bundle(*entries: tarfile.TarInfo, data: bytes = b"x") -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for info in entries:
            if info.isreg():
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return gzip.compress(raw.getvalue())


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


@pytest.mark.parametrize(
    ("what", "entries"),
    [
        ("absolute path", [entry("/tmp/muster-planted")]),
        ("dot-dot", [entry("../planted")]),
        ("dot-dot inside", [entry("a/../../planted")]),
        ("symlink out", [entry("out", tarfile.SYMTYPE, "/etc")]),
        ("relative symlink out", [entry("out", tarfile.SYMTYPE, "../../..")]),
        ("hard link out", [entry("passwd", tarfile.LNKTYPE, "/etc/passwd")]),
        ("hard link up", [entry("up", tarfile.LNKTYPE, "../outside")]),
        ("device", [entry("null", tarfile.CHRTYPE)]),
    ],
)
def test_an_entry_leaving_the_tree_is_refused(
    tmp_path: Path, what: str, entries: list[tarfile.TarInfo]
) -> None:
    dest = tmp_path / "run" / "src"
    dest.mkdir(parents=True)
    (tmp_path / "outside").write_text("secret")
    with pytest.raises(InfrastructureError, match="unsafe to unpack"):
        unpack_bundle(bundle(*entries), dest)
    assert not (tmp_path / "planted").exists(), what
    assert not (tmp_path / "run" / "planted").exists(), what
    assert not Path("/tmp/muster-planted").exists(), what


def test_a_workdir_round_trips(tmp_path: Path) -> None:
    src = tmp_path / "w"
    (src / "pkg").mkdir(parents=True)
    (src / "train.py").write_text("print('hi')\n")
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    data, _digest = pack_bundle(src)
    dest = tmp_path / "out"
    dest.mkdir()
    unpack_bundle(data, dest)
    assert (dest / "train.py").read_text() == "print('hi')\n"
    assert (dest / "pkg" / "mod.py").read_text() == "X = 1\n"


def test_a_link_inside_the_tree_is_kept(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    unpack_bundle(bundle(entry("a.txt"), entry("b.txt", tarfile.SYMTYPE, "a.txt")), dest)
    assert (dest / "b.txt").read_bytes() == b"x"
