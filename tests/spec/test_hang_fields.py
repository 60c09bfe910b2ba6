"""hang_timeout and on_hang: refused by name where they cannot work."""

from __future__ import annotations

import pytest

from muster.errors import SpecError
from muster.spec import parse_job

BASE = {"name": "a", "entrypoint": "train.py"}


def test_hang_fields_parse_and_default_to_off() -> None:
    assert parse_job(BASE).hang_timeout is None
    assert parse_job(BASE).on_hang == "warn"
    spec = parse_job({**BASE, "hang_timeout": "10m", "on_hang": "fail"})
    assert (spec.hang_timeout, spec.on_hang) == (600, "fail")


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"on_hang": "fail"}, "on_hang", "'fail' needs hang_timeout"),
        ({"hang_timeout": 3}, "hang_timeout", "under 10s"),
        ({"hang_timeout": "10m", "on_hang": "kill"}, "on_hang", ""),
    ],
)
def test_hang_fields_refused_by_name(fields: dict[str, object], field: str, words: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_job({**BASE, **fields})
    assert field in caught.value.fields
    assert words in str(caught.value)
