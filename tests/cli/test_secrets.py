"""Secrets come from a 0600 file or the environment, never from argv; two credentials."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from muster.cli.common import read_secret
from muster.errors import UserError


def muster(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ["PATH"], "MUSTER_DATA_DIR": str(tmp_path / "data"), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "muster", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**base, **(env or {})},
    )


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    path.chmod(0o644)
    with pytest.raises(UserError, match="chmod 600"):
        read_secret(path, "MUSTER_TOKEN", "the join string")
    path.chmod(0o600)
    assert read_secret(path, "MUSTER_TOKEN", "the join string") == "s3cret"


def test_the_environment_is_the_other_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MUSTER_API_TOKEN", " tok ")
    assert read_secret(None, "MUSTER_API_TOKEN", "the API token") == "tok"
    monkeypatch.delenv("MUSTER_API_TOKEN")
    assert read_secret(None, "MUSTER_API_TOKEN", "the API token") is None


def test_join_string_and_api_token_differ_and_the_data_dir_is_private(tmp_path: Path) -> None:
    join = muster(tmp_path, "token")
    api = muster(tmp_path, "token", "--api")
    assert join.returncode == 0, join.stderr
    assert api.returncode == 0, api.stderr
    join_secret, _, pin = join.stdout.strip().partition(".")
    api_secret, _, api_pin = api.stdout.strip().partition(".")
    assert join_secret != api_secret
    assert len(join_secret) >= 32
    assert len(api_secret) >= 32
    assert pin == api_pin
    assert pin.startswith("sha256:")
    # Printing again gives the same secrets (kept in the database).
    assert muster(tmp_path, "token", "--api").stdout == api.stdout
    data = tmp_path / "data"
    assert data.stat().st_mode & 0o777 == 0o700
    assert (data / "muster.db").stat().st_mode & 0o777 == 0o600


def test_the_agent_has_no_token_option_and_names_both_ways(tmp_path: Path) -> None:
    done = muster(tmp_path, "agent", "--token", "x")
    assert done.returncode == 2
    assert "No such option: --token" in done.stderr
    done = muster(tmp_path, "agent", "--controller", "http://127.0.0.1:9")
    assert done.returncode == 2
    assert "--token-file" in done.stderr
    assert "MUSTER_TOKEN" in done.stderr
    loose = tmp_path / "loose"
    loose.write_text("x")
    loose.chmod(0o664)
    done = muster(tmp_path, "agent", "--token-file", str(loose))
    assert done.returncode == 2
    assert "chmod 600" in done.stderr
