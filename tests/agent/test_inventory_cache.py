"""The jobs' Python is probed once (importing torch takes seconds) and the answer kept under a
fingerprint of what it depends on: a second agent start asks nothing, a change to torch or to
the import path asks again. A fake torch on PYTHONPATH counts how often it is imported."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from muster.agent.inventory import probe_cache_dir, probe_python
from muster.spec import Gpus

FAKE_TORCH = """
import os
with open(os.environ["IMPORTS"], "a") as f:
    f.write("x")
__version__ = "{version}+cpu"
"""
FAKE_DIST = """
def is_available(): return True
def is_gloo_available(): return True
def is_nccl_available(): return {nccl}
"""
FAKE_CUDA = "def is_available(): return True\n"


def fake_torch(root: Path, version: str, nccl: bool = False) -> None:
    (root / "torch" / "distributed").mkdir(parents=True, exist_ok=True)
    (root / "torch" / "__init__.py").write_text(
        FAKE_TORCH.format(version=version) + "from torch import cuda, distributed\n"
    )
    (root / "torch" / "cuda.py").write_text(FAKE_CUDA)
    (root / "torch" / "distributed" / "__init__.py").write_text(FAKE_DIST.format(nccl=nccl))
    (root / "torch" / "distributed" / "run.py").write_text("")


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("IMPORTS", str(tmp_path / "imports"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # (the fake torch is rewritten within a second: a .pyc checked by whole seconds and size
    # could answer for the old one; the versions differ in length too)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    return site


def imports(tmp_path: Path) -> int:
    path = tmp_path / "imports"
    return len(path.read_text()) if path.exists() else 0


def test_a_second_probe_is_answered_from_the_cache(env: Path, tmp_path: Path) -> None:
    fake_torch(env, "9.1.0")
    first = probe_python(sys.executable, Gpus())
    assert first["torch"] == "9.1.0"
    assert first["torchrun"] is True
    assert first["backends"] == ["gloo"]
    assert imports(tmp_path) == 1
    assert probe_python(sys.executable, Gpus()) == first
    assert imports(tmp_path) == 1, "the second probe imported torch again"
    kept = list(probe_cache_dir().iterdir())
    assert str(probe_cache_dir()).startswith(str(tmp_path / "cache"))
    assert len(kept) == 1
    assert oct(probe_cache_dir().stat().st_mode & 0o777) == "0o700"


def test_an_upgraded_torch_or_a_new_package_is_probed_again(env: Path, tmp_path: Path) -> None:
    fake_torch(env, "9.1.0")
    assert probe_python(sys.executable, Gpus())["torch"] == "9.1.0"
    time.sleep(0.01)  # (mtimes in ns, but a coarse filesystem clock could hide one change)
    fake_torch(env, "9.10.0")  # torch's own __init__.py changes size and mtime
    assert probe_python(sys.executable, Gpus())["torch"] == "9.10.0"
    assert imports(tmp_path) == 2
    (env / "newpkg").mkdir()  # an install beside it moves the directory's mtime
    probe_python(sys.executable, Gpus())
    assert imports(tmp_path) == 3


def test_other_gpus_or_devices_ask_again_and_broken_cuda_is_not_kept(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_torch(env, "9.1.0")
    probe_python(sys.executable, Gpus())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    probe_python(sys.executable, Gpus())
    assert imports(tmp_path) == 2
    # GPUs listed, but the probe finds no NCCL: CUDA is not working (a driver being
    # installed?): not kept, so the next start asks again.
    two = Gpus(count=2, vendor="nvidia", model="H100", memory_mb=81559)
    assert "nccl" not in probe_python(sys.executable, two)["backends"]
    assert "nccl" not in probe_python(sys.executable, two)["backends"]
    assert imports(tmp_path) == 4
    fake_torch(env, "9.1.0", nccl=True)
    assert probe_python(sys.executable, two)["backends"] == ["gloo", "nccl"]
    assert probe_python(sys.executable, two)["backends"] == ["gloo", "nccl"]
    assert imports(tmp_path) == 5


def test_a_stale_or_spoilt_answer_is_not_used(env: Path, tmp_path: Path) -> None:
    fake_torch(env, "9.1.0")
    probe_python(sys.executable, Gpus())
    (kept,) = probe_cache_dir().iterdir()
    kept.write_text("{not json")
    assert probe_python(sys.executable, Gpus())["torch"] == "9.1.0"
    assert imports(tmp_path) == 2
    old = time.time() - 2 * 24 * 3600
    os.utime(kept, (old, old))
    assert probe_python(sys.executable, Gpus())["torch"] == "9.1.0"
    assert imports(tmp_path) == 3
    ahead = time.time() + 2 * 24 * 3600  # a clock set back since it was written
    os.utime(kept, (ahead, ahead))
    probe_python(sys.executable, Gpus())
    assert imports(tmp_path) == 4


def test_an_answer_someone_else_could_have_written_is_not_believed(
    env: Path, tmp_path: Path
) -> None:
    fake_torch(env, "9.1.0")
    probe_python(sys.executable, Gpus())
    (kept,) = probe_cache_dir().iterdir()
    kept.write_text('{"python": "3.11", "torch": "99.0", "torchrun": true, "backends": ["nccl"]}')
    kept.chmod(0o666)  # (what another user would need to plant it)
    assert probe_python(sys.executable, Gpus())["torch"] == "9.1.0"
    assert imports(tmp_path) == 2


def test_a_wrapper_script_as_the_python_is_fingerprinted_with_its_environment(
    env: Path, tmp_path: Path
) -> None:
    """`muster agent --python wrapper.sh`: what the wrapper sets is seen, and editing it asks
    again."""
    fake_torch(env, "9.1.0")
    wrapper = tmp_path / "python.sh"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    probe_python(str(wrapper), Gpus())
    probe_python(str(wrapper), Gpus())
    assert imports(tmp_path) == 1
    wrapper.write_text(f'#!/bin/sh\nCUDA_VISIBLE_DEVICES=3 exec {sys.executable} "$@"\n')
    probe_python(str(wrapper), Gpus())
    assert imports(tmp_path) == 2


def test_a_python_that_is_not_there_offers_no_torch(tmp_path: Path) -> None:
    answer = probe_python(str(tmp_path / "no-python"), Gpus())
    assert answer == {"python": "", "torch": None, "torchrun": False, "backends": []}
