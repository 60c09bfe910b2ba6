"""The walk-in's checks before each dial: the GPU gate and the stage directory."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
from pathlib import Path

import pytest

from muster.agent.agent import Agent, AgentConfig
from muster.agent.gpus import GpuList, list_gpus
from muster.agent.prepare import NotReady, Preparation, gpu_gate, stage_dir_problem
from muster.spec import WorkerInventory
from muster.spec.worker import WalkIn

FAKE_SMI = """#!/bin/sh
# nvidia-smi as a box with GPUs 0 and 1 answers muster's one query (index,name,memory.total)
printf '0, Fake GPU, 16384\\n1, Fake GPU, 16384\\n'
"""


@pytest.fixture
def two_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A seam for CPU machines: an nvidia-smi on PATH that lists GPUs 0 and 1."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")


def test_the_gpu_gate_names_a_device_the_box_does_not_have(two_gpus: None) -> None:
    present = list_gpus()
    assert present.indices == [0, 1]
    assert gpu_gate([1, 0], present) == ""
    problem = gpu_gate([0, 3], present)
    assert "--devices 0,3: GPU 3 is not on this box (nvidia-smi lists 0,1)" in problem


def test_the_gpu_gate_sends_a_box_without_gpus_to_procs() -> None:
    problem = gpu_gate([0], GpuList())
    assert "no GPU that nvidia-smi or rocm-smi lists" in problem
    assert "--procs N" in problem


def test_a_stage_dir_that_takes_no_writes_or_is_full_is_named(tmp_path: Path) -> None:
    assert stage_dir_problem(tmp_path / "new" / "stage") == ""
    assert (tmp_path / "new" / "stage").is_dir()
    assert list((tmp_path / "new" / "stage").iterdir()) == []  # the probe file is gone
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    problem = stage_dir_problem(blocker / "stage")
    assert f"the stage directory {blocker / 'stage'} takes no writes" in problem
    assert "--work-dir" in problem
    full = stage_dir_problem(tmp_path, free_min=1 << 60)
    assert "MiB free" in full
    assert "--work-dir" in full


def _agent(tmp_path: Path, prepare: Preparation, persist: bool) -> Agent:
    with socket.socket() as s:  # a port nothing listens on: a dial fails at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = AgentConfig(
        controller=f"http://127.0.0.1:{port}",
        token="x" * 32,
        worker_id="walkin-box",
        work_dir=tmp_path / "work",
        python="python3",
        inventory=lambda: WorkerInventory(id="walkin-box", hostname="box"),
        persist=persist,
        backoff=(0.01, 0.02),
    )
    config.prepare = prepare
    return Agent(config)


class Flaky(Preparation):
    """Fails its first ``fails`` checks, then passes; counts them."""

    def __init__(self, stage_dir: Path, fails: int) -> None:
        super().__init__(stage_dir)
        self.fails, self.calls = fails, 0

    def check(self) -> None:
        self.calls += 1
        if self.calls <= self.fails:
            raise NotReady("--devices 3: GPU 3 is not on this box")


def test_a_box_that_fails_its_checks_does_not_dial_and_exits_2(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prepare = Flaky(tmp_path, fails=1)
    with caplog.at_level(logging.INFO, "muster.agent"):
        code = asyncio.run(_agent(tmp_path, prepare, persist=False)._serve())
    assert code == 2
    assert prepare.calls == 1
    assert "not dialing: --devices 3: GPU 3 is not on this box" in caplog.text
    assert "control link" not in caplog.text  # it never dialled


def test_a_persistent_box_checks_again_before_every_dial(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prepare = Flaky(tmp_path, fails=2)
    agent = _agent(tmp_path, prepare, persist=True)

    async def until_dialled() -> None:
        task = asyncio.create_task(agent._serve())
        for _ in range(500):
            if prepare.calls >= 4:  # two refusals, a dial (refused: no controller), again
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, "muster.agent"):
        asyncio.run(until_dialled())
    assert prepare.calls >= 4
    said = caplog.text
    assert said.count("not ready to walk in: --devices 3") == 2
    assert "control link ended" in said  # it dialled once the checks passed


def test_a_box_whose_data_changed_between_dials_offers_the_new_signature(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "0.bin").write_text("first")
    prepare = Preparation(tmp_path / "stage", data_path=data)
    prepare.check()
    before = prepare.data_sig
    offer = WorkerInventory(
        id="walkin-box", hostname="box", join=WalkIn(host="box", ranks=1, data_sig=before)
    )
    assert prepare.stamp(offer) is offer
    (data / "1.bin").write_text("a shard added for the next run")
    prepare.check()
    assert prepare.data_sig != before
    assert prepare.stamp(offer).join.data_sig == prepare.data_sig  # type: ignore[union-attr]
    shutil.rmtree(data)  # the data root went away
    with pytest.raises(NotReady, match="is not a directory"):
        prepare.check()
