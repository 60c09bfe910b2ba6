"""The collective backend loses a rank: the survivors re-form (real torchrun nodes, gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from muster.errors import CohortStopped
from muster.train.reform import decide
from tests.train.test_star import nodes
from tests.train.torchrun import ROOT, torchrun

WORKER = ROOT / "tests/train/reform_worker.py"


def results(out: Path, ranks: list[int]) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in ranks]


@pytest.mark.parametrize("killed", [2, 0])
def test_cadence_survivors_re_form_and_train_on(tmp_path: Path, killed: int) -> None:
    alive = [r for r in range(3) if r != killed]
    codes = nodes(tmp_path, "cadence", [1, 1, 1], str(killed), survivors=2, expect=alive,
                  exits=(killed,), worker=WORKER)  # fmt: skip
    assert codes[killed] not in (None, 0), codes
    a, b = results(tmp_path, alive)
    for group_rank, seen in enumerate((a, b)):
        assert seen["stopped"] is None, seen
        assert [r["members"] for r in seen["reforms"]] == [alive], seen["reforms"]
        assert seen["reforms"][0]["lost"] == [killed]
        assert seen["reforms"][0]["seconds"] < 15  # (5 s per candidate at most)
        assert seen["group"] == [group_rank, 2]  # (the new default group: 2 ranks)
        later = [r for r in seen["rounds"] if r["window"] > seen["reforms"][0]["window"]]
        assert later, seen["rounds"]
        for round_ in later:  # the lost rank is neither counted nor planned for
            assert round_["alive"] == alive, round_
            assert round_["counts"][killed] == 0, round_
        assert seen["rounds"][0]["alive"] == [0, 1, 2]
        assert seen["last"] < 0.8 * seen["first"]  # (it trained on)
    gap = (torch.tensor(a["model"]) - torch.tensor(b["model"])).abs().max()
    assert float(gap) < 1e-5  # the survivors ended on one model


def test_a_silent_rank_is_found_by_its_pings_and_left_out(tmp_path: Path) -> None:
    """A rank frozen (or its host gone without a word) fails no collective: the survivors'
    long wait pings the members, the frozen one does not answer, and they re-form."""
    nodes(tmp_path, "freeze", [1, 1, 1], "2", survivors=2, worker=WORKER)
    a, b = results(tmp_path, [0, 1])
    for seen in (a, b):
        assert seen["stopped"] is None, seen
        assert seen["reforms"][0]["members"] == [0, 1], seen["reforms"]
        assert seen["reforms"][0]["lost"] == [2]
        assert seen["rounds"][-1]["alive"] == [0, 1]
    gap = (torch.tensor(a["model"]) - torch.tensor(b["model"])).abs().max()
    assert float(gap) < 1e-5


def test_sync_survivors_re_form_and_keep_one_model(tmp_path: Path) -> None:
    codes = nodes(tmp_path, "sync", [1, 1, 1], "1", survivors=2, expect=[0, 2], exits=(1,),
                  worker=WORKER)  # fmt: skip
    assert codes[1] not in (None, 0), codes
    a, b = results(tmp_path, [0, 2])
    for seen in (a, b):
        assert seen["stopped"] is None, seen
        assert seen["reforms"][0]["members"] == [0, 2]
        assert seen["rounds"][-1]["alive"] == [0, 2]
        assert seen["rounds"][-1]["counts"] == [1, 0, 1]
    assert a["windows"] == b["windows"]
    gap = (torch.tensor(a["model"]) - torch.tensor(b["model"])).abs().max()
    assert float(gap) < 1e-6  # sync: the survivors hold the same model, step after step


def test_a_minority_stops_with_a_save(tmp_path: Path) -> None:
    save = tmp_path / "run"
    nodes(tmp_path, "minority", [1, 1, 1], "-", str(save), survivors=1, exits=(1, 2),
          worker=WORKER)  # fmt: skip
    (seen,) = results(tmp_path, [0])
    assert "a peer was lost in a collective" in seen["stopped"], seen
    assert "needs a majority" in seen["stopped"], seen
    meta = json.loads(Path(f"{save}.rank0.meta.json").read_text())
    assert "majority" in meta["reason"]
    assert Path(f"{save}.rank0.pt").exists()


def test_a_stalled_collective_ends_in_a_save_with_the_reason(tmp_path: Path) -> None:
    save = tmp_path / "run"
    torchrun(WORKER, str(tmp_path), "stall", "-", str(save), nproc=2, timeout=120)
    first, second = results(tmp_path, [0, 1])
    assert "a collective stalled" in first["stopped"], first
    assert first["after_s"] < 15  # (stall_s 3 s, not gloo's own timeout of 30 minutes)
    meta = json.loads(Path(f"{save}.rank0.meta.json").read_text())
    assert "stalled" in meta["reason"]
    assert Path(f"{save}.rank0.pt").exists()
    assert second["stopped"], second  # (rank 1 woke to a cohort that had stopped)


def r(rank: int, window: int, stage: str) -> dict[str, object]:
    return {"rank": rank, "window": window, "stage": stage, "counts": [1, 1, 1]}


@pytest.mark.parametrize(
    ("reports", "sync", "expected"),
    [
        # all in one round, nobody through it: run it again / skip the step
        ([r(0, 4, "count"), r(1, 4, "data")], False, {0: ("redo", None), 1: ("redo", None)}),
        ([r(0, 4, "count"), r(1, 4, "data")], True, {0: ("void", None), 1: ("void", None)}),
        # one rank through it: the others take its model
        ([r(0, 4, "data"), r(2, 4, "closing")], False, {0: ("adopt", 2), 2: ("adopt", 2)}),
        # sync: a rank that stepped is ahead of one that did not
        ([r(0, 4, "data"), r(2, 4, "stepped")], True, {0: ("adopt", 2), 2: ("adopt", 2)}),
        ([r(0, 4, "closing"), r(2, 4, "stepped")], True, {0: ("adopt", 0), 2: ("adopt", 0)}),
        # cadence: "stepped" is not a sync stage; both through: keep
        ([r(0, 4, "closing"), r(1, 4, "closing")], False, {0: ("keep", None), 1: ("keep", None)}),
        # one round apart: the rank behind keeps its round, the one ahead runs its own again
        ([r(0, 4, "closing"), r(1, 5, "count")], False, {0: ("keep", None), 1: ("redo", None)}),
        ([r(0, 4, "closing"), r(1, 5, "data")], True, {0: ("keep", None), 1: ("void", None)}),
    ],
)
def test_every_survivor_repairs_the_round_the_same_way(
    reports: list[dict[str, object]], sync: bool, expected: dict[int, tuple[str, int | None]]
) -> None:
    for me, (kind, source) in expected.items():
        decision = decide(reports, me, sync)
        assert (decision.kind, decision.source) == (kind, source), me
    if sync and len({rep["window"] for rep in reports}) == 2:
        assert decide(reports, 0, sync).void_next  # (the rank behind skips the next step too)


def test_survivors_that_cannot_agree_stop() -> None:
    with pytest.raises(CohortStopped, match="more than one apart"):
        decide([r(0, 3, "closing"), r(1, 5, "count")], 0, False)
    with pytest.raises(CohortStopped, match="behind had not finished"):
        decide([r(0, 4, "data"), r(1, 5, "count")], 0, False)


def test_a_call_to_re_form_needs_the_runs_key(tmp_path: Path) -> None:
    """Anyone who reaches a rank's call port could otherwise make the cohort re-form at will,
    or pass for a live rank: a call or ping without the run's MAC is refused, counted, wakes
    nothing and gets no answer."""
    import socket
    import time

    import torch.distributed as dist

    from muster.cli.local import free_port
    from muster.train.collective import Seat
    from muster.train.reformwire import Reformer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)  # fmt: skip
    reformer = Reformer(Seat(0, 1, (0,)), "gloo", wait_s=5.0)
    try:
        host, _, calls = reformer.seats[0]

        def send(payload: bytes) -> bytes:
            with socket.create_connection((host, calls), 2.0) as peer:
                peer.sendall(payload)
                peer.settimeout(2.0)
                try:
                    answer = peer.recv(64)
                except OSError:
                    answer = b""
            time.sleep(0.2)
            return answer

        forged = Reformer.__new__(Reformer)
        forged._key = b"k" * 32  # (the right form under another run's key)
        assert send(b"C" + b"\x00" * 7 + b"\x01" + b"x" * 32) == b""  # (a made-up MAC)
        assert send(b"hello") == b""  # (short, then closed)
        assert send(forged._frame(b"C", 1)) == b""
        assert send(forged._frame(b"P", 1)) == b""  # (no pong for another run's ping)
        assert not reformer.kicked
        assert reformer.refused == 4
        assert reformer.answers(0, 2.0, kick=False)  # (the run's own ping: its MAC back)
        assert not reformer.kicked  # (a plain ping calls no re-form)
        send(reformer._frame(b"C", 1))  # (the run's own call: a peer lost a peer)
        assert reformer.kicked
    finally:
        reformer.close()
        dist.destroy_process_group()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, calls), 1.0).close()  # (closed for good)
