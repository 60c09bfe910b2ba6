"""Run a script under real torchrun (CPU, gloo) for the muster.train tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from muster.cli.local import local_torchrun

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 180) -> str:
    """Run ``script`` on ``nproc`` local ranks; returns stdout, fails with stderr's tail."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        local_torchrun(script, *args, nproc=nproc),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    # A rank's own error comes first, torchrun's summary last: show both ends.
    shown = (
        done.stderr
        if len(done.stderr) < 6000
        else done.stderr[:3000] + "\n...\n" + done.stderr[-3000:]
    )
    assert done.returncode == 0, shown
    return done.stdout
