"""docs/troubleshooting.md lists every kind of error muster raises, with its HTTP status and
exit code as the code has them: a new error class, or a changed status, fails here."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import muster.errors as errors

PAGE = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"


def test_every_error_class_is_in_the_table_with_its_status_and_exit_code() -> None:
    rows = {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(r"^\| `(\w+)` \| ([\d-]+) \| (\d) \|", PAGE.read_text(), re.M)
    }
    classes = [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, errors.MusterError) and c.__module__ == errors.__name__
    ]
    assert {c.__name__ for c in classes} == set(rows), "each error class has one row"
    for c in classes:
        http, exit_code = rows[c.__name__]
        assert exit_code == str(c.exit_code), c.__name__
        if c is not errors.JobFailed:
            assert http == str(c.http_status), c.__name__


def test_every_named_failure_is_documented() -> None:
    from muster.gang.catalogue import CATALOGUE, KILLED

    text = PAGE.read_text()
    for entry in [*CATALOGUE, KILLED]:
        assert f"\n| {entry.name} | " in text, entry.name
