"""Where an agent's host is: `muster agent --provider --region --region-class`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from muster.agent.inventory import collect
from muster.spec import WorkerInventory


def agent(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "muster", "agent", "--controller", "http://127.0.0.1:9", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={
            "PATH": os.environ["PATH"],
            "MUSTER_DATA_DIR": str(tmp_path / "data"),
            "MUSTER_TOKEN": "s" * 40,
            "COLUMNS": "200",
            **env,
        },
    )


def test_a_malformed_region_is_refused_naming_the_flag(tmp_path: Path) -> None:
    done = agent(tmp_path, "--region", "us east 1")
    assert done.returncode != 0
    said = " ".join(done.stderr.split())
    assert "--region 'us east 1'" in said, said
    assert "letters, digits" in said
    done = agent(tmp_path, MUSTER_PROVIDER="-aws")  # the environment's value, named by flag
    assert done.returncode != 0
    assert "--provider '-aws'" in " ".join(done.stderr.split())


def test_the_inventory_carries_the_declared_location() -> None:
    inv = collect("w1", sys.executable, "127.0.0.1", location=("aws", "us-east-1", "us"))
    assert (inv.provider, inv.region, inv.region_class) == ("aws", "us-east-1", "us")
    assert collect("w1", sys.executable, "127.0.0.1").region == "local"  # undeclared


def test_the_controller_refuses_an_inventory_with_a_malformed_location() -> None:
    with pytest.raises(ValidationError, match="region"):
        WorkerInventory.model_validate({"id": "w", "hostname": "h", "region": "a/../b c"})
