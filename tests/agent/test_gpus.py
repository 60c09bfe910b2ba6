"""This machine's GPUs as nvidia-smi or rocm-smi lists them (each tool a seam: a script on
PATH printing what the real one prints), and what the inventory makes of them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from muster.agent.gpus import list_gpus
from muster.agent.inventory import probe_gpus
from muster.errors import InfrastructureError
from muster.membership.admission import Hello, refusal

ROCM_SMI = """#!/bin/sh
cat <<'OUT'
============================ ROCm System Management Interface ============================
====================================== Product Info ======================================
GPU[0]		: Card Series: 		AMD Instinct MI300X
GPU[0]		: Card Vendor: 		Advanced Micro Devices, Inc. [AMD/ATI]
GPU[1]		: Card Series: 		AMD Instinct MI300X
GPU[1]		: Card Vendor: 		Advanced Micro Devices, Inc. [AMD/ATI]
==========================================================================================
================================== Memory Usage (Bytes) ==================================
GPU[0]		: VRAM Total Memory (B): 206141652992
GPU[0]		: VRAM Total Used Memory (B): 297828352
GPU[1]		: VRAM Total Memory (B): 206141652992
GPU[1]		: VRAM Total Used Memory (B): 297828352
==========================================================================================
================================== End of ROCm SMI Log ===================================
OUT
"""


def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, script: str) -> None:
    tool = tmp_path / "bin" / name
    tool.parent.mkdir(exist_ok=True)
    tool.write_text(script)
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}/usr/bin:/bin")


def test_an_amd_box_is_seen_through_rocm_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path(tmp_path, monkeypatch, "rocm-smi", ROCM_SMI)
    found = list_gpus()
    assert (found.vendor, found.tool, found.indices) == ("amd", "rocm-smi", [0, 1])
    gpus = probe_gpus()
    assert (gpus.count, gpus.vendor, gpus.model) == (2, "amd", "AMD Instinct MI300X")
    assert gpus.memory_mb == 206141652992 // (1024 * 1024)


def test_an_nvidia_box_is_seen_through_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = (
        "#!/bin/sh\nprintf '0, NVIDIA H100 80GB HBM3, 81559\\n1, NVIDIA H100 80GB HBM3, 81559\\n'\n"
    )
    on_path(tmp_path, monkeypatch, "nvidia-smi", script)
    on_path(tmp_path, monkeypatch, "rocm-smi", ROCM_SMI)  # nvidia-smi is asked first
    gpus = probe_gpus()
    assert (gpus.count, gpus.vendor, gpus.model, gpus.memory_mb) == (
        2,
        "nvidia",
        "NVIDIA H100 80GB HBM3",
        81559,
    )


def test_a_failing_tool_is_an_error_to_the_gate_and_no_gpus_to_the_inventory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path(
        tmp_path, monkeypatch, "nvidia-smi", "#!/bin/sh\necho 'driver not loaded' >&2\nexit 9\n"
    )
    with pytest.raises(InfrastructureError, match="nvidia-smi failed"):
        list_gpus()
    assert probe_gpus().count == 0


def test_the_door_refuses_an_amd_box_to_an_nvidia_cohort_under_nccl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path(tmp_path, monkeypatch, "rocm-smi", ROCM_SMI)
    vendor = probe_gpus().vendor
    cohort = Hello(host="n1", vendor="nvidia", torch="2.13.0", run="r", model_sig="m")
    box = Hello(host="a1", vendor=vendor, torch="2.13.0", run="r", model_sig="m")
    why = refusal(cohort, box, "nccl")
    assert "a1" in why
    assert "n1" in why
    assert "AMD (ROCm)" in why
    assert refusal(cohort, box, "gloo") == ""
