"""The cluster file: every key refused by name with its fix; defaults follow the capacity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from muster.errors import SpecError
from muster.spec import load_cluster_file, parse_cluster

EXAMPLE = Path(__file__).parents[2] / "examples" / "cluster" / "muster.cluster.yml"


def refused(data: object) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_cluster(data)
    return info.value


def workers(*entries: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"interface": "eth0", **e} for e in entries]


def test_the_shipped_example_is_valid_and_says_what_it_holds() -> None:
    cluster = load_cluster_file(EXAMPLE)
    assert [w.host for w in cluster.workers] == ["node-a", "node-b"]
    assert cluster.workers[1].ssh.options == ["ProxyJump=bastion"]
    assert cluster.controller.join.join_timeout == 300
    assert cluster.capacity is None  # node-b's devices are probed at dispatch
    assert cluster.quorum(capacity=6) == 6
    assert cluster.target(capacity=6) == 6


def test_a_seed_style_file_wrapped_in_cluster_is_read_the_same() -> None:
    data = {"controller": {"port": 1337}, "workers": workers({"host": "a", "procs": 2})}
    assert parse_cluster({"cluster": data}) == parse_cluster(data)


def test_quorum_and_target_default_to_the_capacity_and_target_never_below_quorum() -> None:
    cluster = parse_cluster(
        {"workers": workers({"host": "a", "devices": [0, 1]}, {"host": "b", "procs": 3})}
    )
    assert cluster.capacity == 5
    assert (cluster.quorum(), cluster.target()) == (5, 5)
    walk_ins = parse_cluster(
        {"controller": {"join": {"quorum": 8}}, "workers": workers({"host": "a", "procs": 2})}
    )
    assert walk_ins.target() == 8  # waits for walk-ins rather than form below quorum
    manual = parse_cluster(
        {"controller": {"join": {"start": "manual"}}, "workers": workers({"host": "a", "procs": 2})}
    )
    assert manual.target() is None


def test_gpu_ram_share_of_a_host_beats_the_cluster_default() -> None:
    cluster = parse_cluster(
        {
            "gpu_ram_share": 0.5,
            "workers": workers(
                {"host": "a", "procs": 1, "gpu_ram_share": 0.75}, {"host": "b", "procs": 1}
            ),
        }
    )
    assert [cluster.gpu_ram_share_of(w) for w in cluster.workers] == [0.75, 0.5]


REFUSALS = [
    # (case, data, field named, words the message must contain)
    (
        "manual with a target",
        {"controller": {"join": {"start": "manual", "target_ranks": 4}}},
        "controller.join.target_ranks",
        "start: hybrid",
    ),
    (
        "cap below timeout",
        {"controller": {"join": {"join_timeout": "10m", "max_join_timeout": 60}}},
        "controller.join.max_join_timeout",
        "(60s) is below join_timeout (600s)",
    ),
    (
        "target below quorum",
        {"controller": {"join": {"quorum": 4, "target_ranks": 2}}},
        "controller.join.target_ranks",
        "below quorum",
    ),
    (
        "interface missing across hosts",
        {"workers": [{"host": "a", "procs": 1}, {"host": "b", "procs": 1, "interface": "e"}]},
        "workers[0].interface",
        "span hosts",
    ),
    (
        "host twice",
        {"workers": workers({"host": "a", "procs": 1}, {"host": "a", "procs": 1})},
        "workers[1].host",
        "also workers[0]",
    ),
    (
        "devices and procs",
        {"workers": workers({"host": "a", "procs": 1, "devices": [0]})},
        "workers[0].procs",
        "not both",
    ),
    (
        "devices empty",
        {"workers": workers({"host": "a", "devices": []})},
        "workers[0].devices",
        "is empty",
    ),
    (
        "devices repeated",
        {"workers": workers({"host": "a", "devices": [0, 0]})},
        "workers[0].devices",
        "distinct",
    ),
    (
        "devices neither list nor all",
        {"workers": workers({"host": "a", "devices": "some"})},
        "workers[0].devices",
        "or all",
    ),
    (
        "relative path",
        {"workers": workers({"host": "a", "procs": 1, "data_path": "data"})},
        "workers[0].data_path",
        "absolute",
    ),
    (
        "ssh option as a flag",
        {"workers": workers({"host": "a", "procs": 1, "ssh": {"options": ["-oX=y"]}})},
        "workers[0].ssh.options[0]",
        "Key=Value",
    ),
    (
        "a command-running ssh option",
        {"workers": workers({"host": "a", "procs": 1, "ssh": {"options": ["ProxyCommand=sh"]}})},
        "workers[0].ssh.options[0]",
        "runs a command on this machine",
    ),
    (
        "a host ssh would read as an option",
        {"workers": workers({"host": "-oProxyCommand=sh", "procs": 1})},
        "workers[0].host",
        "would reach ssh as an option",
    ),
    (
        "a target with a space",
        {"workers": workers({"host": "a", "procs": 1, "ssh": {"target": "a -v"}})},
        "workers[0].ssh.target",
        "would reach ssh as an option",
    ),
    ("visibility mask", {"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env.CUDA_VISIBLE_DEVICES", "mask"),
    ("a trailing newline", {"env": {"A\n": "0"}}, "env.A\n", "not a valid variable name"),
    ("rank variable", {"env": {"RANK": "0"}}, "env.RANK", "set by muster"),
    (
        "platform variable on a host",
        {"workers": workers({"host": "a", "procs": 1, "env": {"MUSTER_DATA_PATH": "/d"}})},
        "workers[0].env.MUSTER_DATA_PATH",
        "set by muster",
    ),
    (
        "unknown key",
        {"workers": workers({"host": "a", "procs": 1, "devcies": [0]})},
        "workers[0].devcies",
        "did you mean 'devices'",
    ),
    ("bad start", {"controller": {"join": {"start": "now"}}}, "controller.join.start", "auto"),
    ("no mapping", [], "", "mapping"),
]


@pytest.mark.parametrize(("case", "data", "field", "words"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_each_rule_names_the_key_and_the_fix(case: str, data: Any, field: str, words: str) -> None:
    error = refused(data)
    assert field in error.fields, f"{case}: {error}"
    assert words in str(error), f"{case}: {error}"


def test_every_problem_is_reported_at_once() -> None:
    error = refused(
        {
            "controller": {"join": {"start": "manual", "target_ranks": 2}},
            "env": {"RANK": "1"},
            "workers": [{"host": "a", "procs": 1}, {"host": "b", "procs": 1}],
        }
    )
    assert len(error.errors) == 4
