"""Each named failure replays a sample in the real format of its message (as torch, NCCL,
gloo and Python print it) and comes out named, with its fix, in the job's root cause."""

from __future__ import annotations

import pytest

from muster.gang.catalogue import CATALOGUE, KILLED, classify
from muster.gang.causes import root_cause
from muster.gang.events import MemberExited

TRACE = "Traceback (most recent call last):"
SAMPLES = {
    "NCCL watchdog timeout": (
        "[rank1]:[E1130 14:02:11.123456789 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=262144, "
        "NumelOut=262144, Timeout(ms)=600000) ran for 600081 milliseconds before timing out.",
        "collective ALLREDUCE number 12",
    ),
    "gloo collective timed out": (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
        "waiting 1800000ms for recv operation to complete",
        "a gloo recv waited 1800000 ms",
    ),
    "peer rank died mid-collective": (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
        "[10.0.0.2]:43021: Connection reset by peer",
        "rank at 10.0.0.2",
    ),
    "rendezvous timed out": (
        "torch.distributed.DistNetworkError: The client socket has timed out after 60000ms "
        "while trying to connect to (10.1.2.3, 29500).",
        "at 10.1.2.3:29500",
    ),
    "rendezvous refused": (
        "torch.distributed.DistNetworkError: The client socket has failed to connect to "
        "[10.1.2.3]:29500 (errno: 111 - Connection refused).",
        "nothing listened on 10.1.2.3:29500",
    ),
    "address already in use": (
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any "
        "local network address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, "
        "message: address already in use",
        "was taken",
    ),
    "CUDA out of memory": (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a "
        "total capacity of 79.11 GiB of which 3.06 GiB is free. Including non-PyTorch memory, "
        "this process has 76.04 GiB memory in use.",
        "allocation failed",
    ),
    "two ranks on one GPU": (
        "misc/utils.cc:247 NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA "
        "device 1000",
        "ranks 1 and 0 chose the same GPU",
    ),
    "world size or rank mismatch": (
        "ValueError: Invalid rank 5, rank should be in the interval [0, 3]",
        "rank 5 was given a world of 3 + 1",
    ),
    "killed by the OOM killer": (
        "kernel: Out of memory: Killed process 48213 (python) total-vm:61234560kB, "
        "anon-rss:58112012kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:113840kB "
        "oom_score_adj:0",
        "ended process 48213 (python)",
    ),
    "a module is missing": (
        "ModuleNotFoundError: No module named 'transformers'",
        "no module transformers",
    ),
}


def test_every_entry_has_a_sample() -> None:
    assert {e.name for e in CATALOGUE} == set(SAMPLES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_sample_is_named_with_its_fix_in_the_root_cause(name: str) -> None:
    line, what = SAMPLES[name]
    tail = ("step 41 loss 2.3", TRACE, '  File "train.py", line 9, in <module>', line)
    exited = MemberExited(node=1, exit_code=1, failed_rank=3, failed_exit=1, tail=tail)
    cause = root_cause(1, "w1", exited)
    first, named, fix = cause.split("\n")[:3]
    assert first == "node1 (worker w1): global rank 3 exited with code 1"
    assert named.startswith(f"{name}: ")
    assert what in named
    assert fix.startswith("fix: ")
    assert "{" not in named + fix, "every field filled"
    assert line in cause, "the last lines still follow"


def test_the_newest_matching_line_decides_and_unknown_failures_stay_unnamed() -> None:
    oom, _ = SAMPLES["CUDA out of memory"]
    watchdog, _ = SAMPLES["NCCL watchdog timeout"]
    # A rank ran out of memory; its peers' watchdogs fired after: each names its own.
    assert classify([oom, "cleanup", watchdog]).name == "NCCL watchdog timeout"  # type: ignore[union-attr]
    assert classify([watchdog, oom]).name == "CUDA out of memory"  # type: ignore[union-attr]
    assert classify(["ValueError: my own bug"]) is None
    cause = root_cause(0, "w0", MemberExited(node=0, exit_code=1, tail=("ValueError: x",)))
    assert "fix:" not in cause


def test_a_silent_sigkill_is_the_oom_killers_mark() -> None:
    exited = MemberExited(node=0, exit_code=-9, signal="SIGKILL", failed_rank=2, tail=("step 9",))
    cause = root_cause(0, "w0", exited)
    assert "global rank 2 was killed by SIGKILL" in cause
    assert f"{KILLED.name}: " in cause
    assert "dmesg" in cause
    # A SIGKILL after a known error is that error.
    line, _ = SAMPLES["CUDA out of memory"]
    assert classify([line], "SIGKILL").name == "CUDA out of memory"  # type: ignore[union-attr]


def test_an_error_caught_before_the_last_traceback_is_not_the_cause() -> None:
    oom, _ = SAMPLES["CUDA out of memory"]
    tail = [TRACE, oom, "batch 64 too big, retrying with 32", TRACE, "ValueError: my bug"]
    assert classify(tail) is None


# NCCL 2.2x's banner at NCCL_DEBUG=INFO, as a rank prints it (host:pid:tid [device]).
SOCKET_BANNER = "gpu-node-1:4711:4790 [0] NCCL INFO Using network Socket"
IB_BANNER = "gpu-node-1:4711:4790 [0] NCCL INFO Using network IB"


def test_an_nccl_timeout_on_a_rank_that_fell_back_to_sockets_says_so() -> None:
    watchdog, _ = SAMPLES["NCCL watchdog timeout"]
    named = classify([SOCKET_BANNER, "step 1", watchdog])
    assert named is not None
    assert named.name == "NCCL watchdog timeout"
    assert "Also: NCCL ran over TCP sockets on this rank" in named.fix
    # on a fabric, or on muster's direct path (NCCL_NET=Socket on purpose): no such note
    assert "TCP sockets" not in classify([IB_BANNER, watchdog]).fix  # type: ignore[union-attr]
    quiet = classify([SOCKET_BANNER, watchdog], sockets_expected=True)
    assert quiet is not None
    assert "TCP sockets" not in quiet.fix
    # the banner alone is no failure, and does not name one
    assert classify([SOCKET_BANNER, "ValueError: mine"]) is None
    exited = MemberExited(node=1, exit_code=1, failed_rank=3, tail=(SOCKET_BANNER, watchdog))
    assert "TCP sockets" in root_cause(1, "w1", exited)
    assert "TCP sockets" not in root_cause(1, "w1", exited, sockets_expected=True)
