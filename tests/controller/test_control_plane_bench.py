"""bench/control_plane.py keeps measuring: its quick run places every gang.

It once printed "0 gangs/s, 39 failed" for weeks after a protocol change (its simulated
agents never answered MASTER_CHECK) and nothing noticed: the bench is not run in CI, this
smoke run is (about 10 s: 50 simulated agents, 200 gangs, SQLite)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_control_plane_bench_places_every_gang_of_its_quick_run() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench/control_plane.py"), "--quick", "--no-postgres"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    drained = re.search(r"(\d+) of (\d+) gangs had every member assigned, (\d+) failed", out)
    assert drained, out[-3000:]
    assert drained.group(1) == drained.group(2) == "200", drained.group(0)
    assert drained.group(3) == "0", drained.group(0)
    assert re.search(r"placed [1-9][\d.]* gangs/s", out), out[-3000:]
