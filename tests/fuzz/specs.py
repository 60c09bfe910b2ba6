"""Spec data for the fuzz tests: a valid job spec, and strategies that break it."""

from __future__ import annotations

from typing import Any

import yaml
from hypothesis import strategies as st

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["1h30m", "0", "-1", "90s", "cuda", "gloo", "nccl", "-m pkg", "auto"])
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
VALID: dict[str, Any] = {
    "name": "train",
    "entrypoint": "train.py",
    "args": ["--epochs", "1"],
    "env": {"SEED": "1"},
    "timeout": "1h",
    "labels": {"team": "ml"},
    "resources": {"gpus": 1, "device": "cuda"},
    "distributed": {
        "num_workers": 2,
        "procs_per_worker": 1,
        "backend": "nccl",
        "rendezvous": {"port": 29500},
        "network": "regional",
        "transport": "direct",
        "membership": "pool",
    },
}
FIELDS = [
    *VALID,
    "image",
    "workdir",
    "output_dir",
    "priority",
    "retries",
    "distributed.num_workers",
    "distributed.procs_per_worker",
    "distributed.backend",
    "distributed.rendezvous",
    "distributed.rendezvous.port",
    "distributed.network",
    "distributed.transport",
    "distributed.membership",
    "resources.gpus",
    "resources.device",
    "unknown",
    "distributed.unknwon",
]


@st.composite
def mutated_specs(draw: st.DrawFn) -> dict[str, Any]:
    """The valid spec with a few fields replaced by anything, or dropped."""
    spec = yaml.safe_load(yaml.safe_dump(VALID))
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4)):
        *parents, leaf = field.split(".")
        node: Any = spec
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        if draw(st.booleans()) and leaf in node:
            del node[leaf]
        else:
            node[leaf] = draw(values)
    return spec  # type: ignore[no-any-return]
