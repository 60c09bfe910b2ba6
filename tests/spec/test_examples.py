"""Every job file the README points a new user to loads, and says what it claims."""

from __future__ import annotations

from pathlib import Path

import pytest

from muster.spec import load_job_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*/job.yaml")), ids=lambda p: p.parent.name)
def test_every_example_job_loads(path: Path) -> None:
    spec = load_job_file(path)
    if spec.image is None and not spec.entrypoint.startswith("-m "):
        # (a script the job's bundle carries; the plan and k8s examples name a module)
        assert (path.parent / spec.workdir / spec.entrypoint).is_file()


def test_the_window_example_waits_for_two_boxes_and_a_start() -> None:
    spec = load_job_file(EXAMPLES / "window" / "job.yaml")
    assert spec.gang.membership == "window"
    assert spec.gang.window is not None
    assert spec.gang.window.start == "manual"
    assert spec.gang.window.quorum == 4
    assert spec.gang.world_size == 4
