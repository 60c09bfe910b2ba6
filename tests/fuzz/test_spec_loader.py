"""hypothesis over the job-spec loader: whatever data or YAML a user hands it, the only
error that escapes is SpecError, and it names at least one problem."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from muster.errors import SpecError
from muster.spec import JobSpec, load_job_file, parse_job
from tests.fuzz.specs import FIELDS, VALID, mutated_specs, values

FUZZ = settings(max_examples=200, deadline=None)


def parses_or_refuses(data: object) -> None:
    try:
        spec = parse_job(data)
    except SpecError as exc:
        errors = exc.errors
    else:
        assert isinstance(spec, JobSpec)
        return
    assert errors, f"a SpecError naming no problem for {data!r}"


def loads_or_refuses(text: str | bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        if isinstance(text, str):
            path.write_text(text, encoding="utf-8")
        else:
            path.write_bytes(text)
        try:
            load_job_file(path)
        except SpecError as exc:
            errors = exc.errors
        else:
            return
    assert errors, f"a SpecError naming no problem for {text!r}"


def test_the_valid_spec_parses() -> None:
    assert parse_job(VALID).name == "train"


@FUZZ
@given(values)
def test_any_data_parses_or_is_refused(data: object) -> None:
    parses_or_refuses(data)


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS[:12]), values, max_size=8))
def test_any_top_level_fields_parse_or_are_refused(data: dict[str, Any]) -> None:
    parses_or_refuses(data)


@FUZZ
@given(mutated_specs())
def test_mutated_specs_parse_or_are_refused(data: dict[str, Any]) -> None:
    parses_or_refuses(data)


@FUZZ
@given(st.text(max_size=200))
@example("name: 2001-13-45\n")  # a YAML timestamp that is no date
@example("entrypoint: !!python/object:os.system x\n")
@example("a: &a [*a]\n")
@example("args: " + "[" * 5000)
@example("timeout: !!int x\n")
@example("timeout: " + "9" * 5000 + "\n")
def test_any_yaml_text_loads_or_is_refused(text: str) -> None:
    loads_or_refuses(text)


@FUZZ
@given(mutated_specs(), st.data())
def test_mutated_yaml_files_load_or_are_refused(spec: dict[str, Any], data: st.DataObject) -> None:
    text = yaml.safe_dump(spec)
    at = data.draw(st.integers(0, len(text)))
    cut = data.draw(st.integers(0, len(text) - at))
    loads_or_refuses(text[:at] + data.draw(st.text(max_size=8)) + text[at + cut :])


@FUZZ
@given(st.binary(max_size=200))
@example(b"name: \xff\xfe\n")
def test_any_file_bytes_load_or_are_refused(raw: bytes) -> None:
    loads_or_refuses(raw)
