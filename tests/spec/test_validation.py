"""Every submission rule refuses with the field named and a fix; good specs pass."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from muster.errors import SpecError
from muster.spec import JobSpec, parse_duration, parse_job
from muster.spec.rules import DNS_LABEL, PLATFORM_ENV

BASE: dict[str, Any] = {"name": "ddp", "entrypoint": "train.py"}


def job(**overrides: Any) -> dict[str, Any]:
    return {**BASE, **overrides}


def dist(**overrides: Any) -> dict[str, Any]:
    return {"num_workers": 2, **overrides}


def refused(data: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_job(data)
    return info.value


REFUSALS = [
    # (case, data, field named, words the message must contain)
    (
        "mps distributed",
        job(resources={"device": "mps"}, distributed=dist()),
        "resources.device",
        "mps",
    ),
    ("nccl on cpu", job(distributed=dist(backend="nccl")), "distributed.backend", "CUDA"),
    (
        "procs over gpus",
        job(resources={"gpus": 2}, distributed=dist(procs_per_worker=4)),
        "distributed.procs_per_worker",
        "exceeds resources.gpus=2",
    ),
    ("retries on a gang", job(retries=1, distributed=dist()), "retries", "never retries"),
    ("num_workers 0", job(distributed=dist(num_workers=0)), "distributed.num_workers", ">= 1"),
    (
        "num_workers negative",
        job(distributed=dist(num_workers=-3)),
        "distributed.num_workers",
        ">= 1",
    ),
    (
        "num_workers missing",
        job(distributed={"procs_per_worker": 2}),
        "distributed.num_workers",
        "required",
    ),
    ("timeout past 68 years", job(timeout=2**70), "timeout", "2147483647 s (about 68 years)"),
    (
        "a duration past 68 years in days",
        job(hang_timeout="100000d"),
        "hang_timeout",
        "8640000000 s ('100000d') is past the most a duration may be",
    ),
    ("gpus past int32", job(resources={"gpus": 2**40}), "resources.gpus", "< 2147483648"),
    (
        "quorum past every rank there can be",
        job(distributed=dist(membership="window", window={"quorum": 2**40})),
        "distributed.window.quorum",
        "<= 10240000",
    ),
    ("name uppercase", job(name="My_Job"), "name", "DNS label"),
    ("name too long", job(name="a" * 64), "name", "DNS label"),
    ("name trailing dash", job(name="job-"), "name", "DNS label"),
    ("unknown top field", job(distrbuted=dist()), "distrbuted", "did you mean 'distributed'"),
    (
        "unknown nested field",
        job(distributed=dist(num_worker=2)),
        "distributed.num_worker",
        "did you mean 'num_workers'",
    ),
    ("unknown resources field", job(resources={"gpu": 1}), "resources.gpu", "'gpus'"),
    (
        "wrong type int",
        job(distributed=dist(num_workers="two")),
        "distributed.num_workers",
        "integer",
    ),
    ("string number is a wrong type", job(priority="5"), "priority", "integer"),
    (
        "bool is not an int",
        job(distributed=dist(procs_per_worker=True)),
        "distributed.procs_per_worker",
        "integer",
    ),
    ("env value not a string", job(env={"SEED": 1}), "env.SEED", "quote it"),
    ("bad backend", job(distributed=dist(backend="mpi")), "distributed.backend", "'gloo'"),
    (
        "bad network class",
        job(distributed=dist(network="planet")),
        "distributed.network",
        "'regional'",
    ),
    (
        "bad transport",
        job(distributed=dist(transport="relayed")),
        "distributed.transport",
        "'auto'",
    ),
    (
        "bad port",
        job(distributed=dist(rendezvous={"port": 70000})),
        "distributed.rendezvous.port",
        "<= 65535",
    ),
    (
        "ld_preload with auto",
        job(env={"LD_PRELOAD": "libx.so"}, distributed=dist(transport="auto")),
        "env.LD_PRELOAD",
        "shim",
    ),
    ("entrypoint with args", job(entrypoint="train.py --lr 3"), "entrypoint", "args"),
    ("entrypoint bad module", job(entrypoint="-m 3bad"), "entrypoint", "-m package.module"),
    ("output_dir escapes", job(output_dir="../up"), "output_dir", "relative"),
    ("bad timeout", job(timeout="soon"), "timeout", "duration"),
    ("zero timeout", job(timeout=0), "timeout", "must be > 0"),
    ("cuda without gpus", job(resources={"device": "cuda"}), "resources.gpus", "gpus: 1"),
    ("gpus on cpu", job(resources={"gpus": 2, "device": "cpu"}), "resources.device", "cuda"),
    (
        "window block on a pool job",
        job(distributed=dist(window={"start": "manual"})),
        "distributed.window",
        "membership: window",
    ),
    (
        "node_procs on a pool job",
        job(distributed=dist(node_procs=[1, 2])),
        "distributed.node_procs",
        "membership: window",
    ),
    (
        "node_procs of the wrong length",
        job(distributed=dist(membership="window", node_procs=[1])),
        "distributed.node_procs",
        "num_workers (2)",
    ),
    (
        "a visibility mask in a window job",
        job(distributed=dist(membership="window"), env={"CUDA_VISIBLE_DEVICES": "1"}),
        "env.CUDA_VISIBLE_DEVICES",
        "muster join --devices",
    ),
    (
        "manual window with a target",
        job(distributed=dist(membership="window", window={"start": "manual", "target_ranks": 2})),
        "distributed.window.target_ranks",
        "start: hybrid",
    ),
]


@pytest.mark.parametrize(("case", "data", "field", "words"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusal_names_field_and_fix(
    case: str, data: dict[str, Any], field: str, words: str
) -> None:
    error = refused(data)
    named = {e.field: e.message for e in error.errors}
    assert field in named, f"{case}: expected {field} among {named}"
    assert words.lower() in named[field].lower(), named[field]
    assert error.exit_code == 2
    assert error.http_status == 422


@pytest.mark.parametrize(
    "key",
    [*sorted(PLATFORM_ENV), "PET_NNODES", "PET_RDZV_ENDPOINT", "MUSTER_OUTPUT_DIR", "MUSTER_X"],
)
def test_platform_env_keys_are_refused(key: str) -> None:
    error = refused(job(env={key: "x"}, distributed=dist()))
    assert error.fields == [f"env.{key}"]
    assert "set by muster" in error.errors[0].message


def test_user_nccl_and_ld_preload_on_direct_are_accepted() -> None:
    spec = parse_job(
        job(env={"NCCL_DEBUG": "INFO", "LD_PRELOAD": "libjemalloc.so"}, distributed=dist())
    )
    assert spec.env["NCCL_DEBUG"] == "INFO"


def test_every_problem_is_reported_at_once() -> None:
    error = refused(
        job(
            retries=2,
            resources={"gpus": 1},
            distributed=dist(procs_per_worker=2, backend="nccl", transport="auto"),
            env={"RANK": "0", "LD_PRELOAD": "x"},
        )
    )
    assert set(error.fields) == {
        "retries",
        "distributed.procs_per_worker",
        "env.RANK",
        "env.LD_PRELOAD",
    }


def test_raw_rules_still_run_when_types_are_wrong() -> None:
    error = refused(job(name="Bad Name", env={"MASTER_ADDR": "x"}, distributed=dist(num_workers=0)))
    assert {"name", "env.MASTER_ADDR", "distributed.num_workers"} <= set(error.fields)


def test_defaults_follow_the_device() -> None:
    cpu = parse_job(job(distributed=dist()))
    assert (cpu.backend, cpu.resources.effective_device) == ("gloo", "cpu")
    gpu = parse_job(job(resources={"gpus": 8}, distributed=dist(procs_per_worker=8)))
    assert (gpu.backend, gpu.resources.effective_device) == ("nccl", "cuda")
    assert gpu.gang.world_size == 16
    assert gpu.gang.network == "regional"
    assert gpu.gang.transport == "direct"


def test_single_job_may_retry_and_is_a_gang_of_one() -> None:
    spec = parse_job(job(retries=3))
    assert spec.gang.num_workers == 1
    assert spec.gang.world_size == 1


def test_python_api_spec_goes_through_the_same_rules() -> None:
    spec = JobSpec(name="x", entrypoint="t.py", retries=1, distributed={"num_workers": 2})  # type: ignore[arg-type]
    with pytest.raises(SpecError) as info:
        parse_job(spec)
    assert info.value.fields == ["retries"]


def test_module_entrypoint() -> None:
    assert parse_job(job(entrypoint="-m pkg.train")).module == "pkg.train"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("30m", 1800),
        ("2h", 7200),
        ("1h30m", 5400),
        ("1d", 86400),
        ("45", 45),
        (600, 600),
    ],
)
def test_durations(text: str | int, seconds: int) -> None:
    assert parse_duration(text) == seconds
    assert parse_job(job(timeout=text)).timeout == seconds


@given(st.text(min_size=1, max_size=70))
def test_names_accepted_exactly_when_dns_labels(name: str) -> None:
    if DNS_LABEL.match(name):
        assert parse_job(job(name=name)).name == name
    else:
        with pytest.raises(SpecError) as info:
            parse_job(job(name=name))
        assert "name" in info.value.fields
