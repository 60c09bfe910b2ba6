"""The Unplaceable events of a waiting job: each kind of reason once, however often the
queue flips it between kinds (the why_pending column always says the latest)."""

from __future__ import annotations

from muster.controller.placer import told_before


def test_a_kind_told_before_is_quiet_and_a_new_one_is_told() -> None:
    said: dict[str, set[str]] = {}
    assert told_before(said, {"a": "held back by queue order; 3 ahead", "b": None}) == set()
    assert told_before(said, {"a": "needs 2 idle workers; 1 idle"}) == set()
    assert told_before(said, {"a": "held back by queue order; 1 ahead"}) == {"a"}
    assert told_before(said, {"a": "needs 2 idle workers; 0 idle", "c": "x; y"}) == {"a"}
    assert told_before(said, {"a": "IPCollision: 10.0.0.1 is in use"}) == set()
    assert "b" not in said  # placed (None): nothing to remember
