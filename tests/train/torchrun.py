"""Run a script under real torchrun (CPU, gloo) for the muster.train tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from muster.cli.local import local_torchrun

ROOT = Path(__file__).resolve().parents[2]


# torch 2.x with gloo: a rank sometimes aborts while the interpreter shuts down, after its
# work and destroy_process_group are done (a C++ worker thread still joinable at exit:
# "terminate called without an active exception", SIGABRT). Seen about once in a few dozen
# full runs here; see pytorch/pytorch#190489 and #179291. Such a run is tried once more; any
# other failure, or this one twice, fails the test.
TEARDOWN_ABORT = "terminate called without an active exception"
# The master port is picked free, then bound by torchrun a moment later; on a busy machine
# another process can take it in between. Such a run is tried once more, on a new port.
PORT_TAKEN = ("Address already in use", "EADDRINUSE")


def torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 180) -> str:
    """Run ``script`` on ``nproc`` local ranks; returns stdout, fails with stderr's tail."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for attempt in range(2):
        done = subprocess.run(
            local_torchrun(script, *args, nproc=nproc),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        retried = [m for m in (TEARDOWN_ABORT, *PORT_TAKEN) if m in done.stderr]
        if done.returncode == 0 or not retried or attempt == 1:
            break
        print(f"torchrun failed with {retried[0]!r}; running once more")
    # A rank's own error comes first, torchrun's summary last: show both ends.
    shown = (
        done.stderr
        if len(done.stderr) < 6000
        else done.stderr[:3000] + "\n...\n" + done.stderr[-3000:]
    )
    assert done.returncode == 0, shown
    return done.stdout
