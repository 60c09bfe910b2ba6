"""verify-fabric on NCCL output written the way NCCL and kubectl --prefix print it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from muster.k8s.verify import analyse

SAMPLES = Path(__file__).parent / "nccl"


def read(name: str) -> list[str]:
    return (SAMPLES / name).read_text().splitlines()


def test_tcpxo_attached_per_pod_and_rank() -> None:
    report = analyse(read("tcpxo-attached.log"), "tcpxo")
    assert report.verdict == "attached"
    assert report.exit_code == 0
    assert [r.name for r in report.ranks] == [
        "llama-ft-node-0-0-x7k2p pid 152",
        "llama-ft-node-0-0-x7k2p pid 153",
        "llama-ft-node-0-1-q9z3m pid 148",
        "llama-ft-node-0-1-q9z3m pid 149",
    ]
    assert "4 rank(s) attached to FasTrak" in report.summary


def test_efa_attached_without_a_kubectl_prefix() -> None:
    report = analyse(read("efa-attached.log"), "efa")
    assert report.verdict == "attached"
    assert {r.network for r in report.ranks} == {"AWS Libfabric"}


def test_socket_is_a_fallback_with_the_fabrics_likely_cause() -> None:
    report = analyse(read("ib-fallback.log"), "ib")
    assert report.verdict == "fallback"
    assert report.exit_code == 1
    assert "2 of 2 rank(s) use network Socket" in report.summary
    assert report.cause is not None
    assert "rdma-core" in report.cause
    assert "NET/IB : No device found." in report.cause


def test_one_rank_falling_back_fails_the_job() -> None:
    report = analyse(read("mixed.log"), "efa")
    assert report.verdict == "fallback"
    assert "ip-10-1-7-9 pid 51" in report.summary
    assert "Failed to initialize libfabric provider efa" in (report.cause or "")


def test_warn_level_output_is_inconclusive_never_fallback() -> None:
    report = analyse(read("warn-only.log"), "tcpxo")
    assert report.verdict == "inconclusive"
    assert report.exit_code == 3
    assert "NCCL_DEBUG is below INFO" in report.summary
    assert "WARN" in report.summary


def test_info_without_a_banner_points_at_cut_output_or_an_mpi_launcher() -> None:
    report = analyse(read("info-no-banner.log"))
    assert report.verdict == "inconclusive"
    assert "--tail=-1" in report.summary
    assert "launcher" in report.summary


def test_no_output_at_all() -> None:
    assert analyse([]).summary == "inconclusive: no output to read"


def test_muster_rank_tags_name_the_rank() -> None:
    lines = ["[rank3] host:9:9 [1] NCCL INFO Using network IB"]
    (rank,) = analyse(lines, "ib").ranks
    assert rank.name == "rank3 pid 9"


def test_another_fabric_than_expected_is_not_attached() -> None:
    report = analyse(read("efa-attached.log"), "ib")
    assert report.verdict == "other fabric"
    assert report.exit_code == 5
    assert "another network than IB" in report.summary
    assert "AWS Libfabric" in report.summary
    assert report.cause is not None
    assert "--fabric" in report.cause
    assert analyse(read("efa-attached.log"), "efa").exit_code == 0


@pytest.mark.parametrize(
    ("sample", "code", "words"),
    [
        ("tcpxo-attached.log", 0, "attached"),
        ("ib-fallback.log", 1, "likely cause"),
        ("warn-only.log", 3, "inconclusive"),
    ],
)
def test_cli_exit_codes(sample: str, code: int, words: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "muster", "verify-fabric", str(SAMPLES / sample)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == code, done.stderr
    assert words in done.stdout


def test_cli_reads_stdin() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "muster", "verify-fabric", "-", "--fabric", "efa"],
        input=(SAMPLES / "efa-attached.log").read_text(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "AWS Libfabric" in done.stdout


def test_every_name_aws_ofi_nccl_gives_itself_is_efa() -> None:
    for name in ("AWS Libfabric", "Libfabric", "OFI"):
        line = f"[pod/job-node-0-0-a/node] ip-10-0-0-1:5:5 [0] NCCL INFO Using network {name}"
        report = analyse([line], "efa")
        assert report.verdict == "attached", (name, report.summary)
        assert report.exit_code == 0
