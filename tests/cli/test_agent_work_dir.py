"""One agent per work dir: a second one there would sweep the first one's ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from muster.cli.agent import claim_work_dir


def test_a_second_agent_in_a_work_dir_is_refused_and_names_the_first(tmp_path: Path) -> None:
    work = tmp_path / "work"
    first = claim_work_dir(work)  # as a running agent holds it
    try:
        assert work.stat().st_mode & 0o777 == 0o700
        env = {
            "PATH": os.environ["PATH"],
            "MUSTER_DATA_DIR": str(tmp_path / "data"),
            "MUSTER_TOKEN": "s" * 40,
            "COLUMNS": "200",
        }
        argv = [sys.executable, "-m", "muster", "agent", "--controller", "http://127.0.0.1:9"]
        done = subprocess.run(
            [*argv, "--name", "gpu-7", "--work-dir", str(work)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=env,
        )
        assert done.returncode != 0
        said = " ".join(done.stderr.split())
        assert f"another muster agent (pid {os.getpid()}) runs in {work}" in said, said
        assert "--work-dir" in said
    finally:
        first.close()
    again = claim_work_dir(work)  # the first one gone (even killed: the lock goes with it)
    again.close()


def test_a_work_dir_that_takes_no_writes_says_so(tmp_path: Path) -> None:
    import pytest

    from muster.errors import UserError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UserError, match=r"a-file/w takes no writes .*--work-dir"):
        claim_work_dir(blocker / "w")
