"""The generated reference pages are current: a new field or flag without a regenerated page
fails here (run `.venv/bin/python docs/gen_reference.py`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_reference_pages_match_the_code() -> None:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, text in module.pages().items():
        assert (DOCS / name).read_text() == text, (
            f"docs/{name} is stale: run .venv/bin/python docs/gen_reference.py"
        )


def test_every_spec_field_and_command_is_in_the_reference() -> None:
    from muster.spec.job import JobSpec

    spec_page = (DOCS / "reference/job-spec.md").read_text()
    for name in JobSpec.model_fields:
        assert f"| `{name}` |" in spec_page
    cli_page = (DOCS / "reference/cli.md").read_text()
    for command in ("muster submit", "muster k8s apply", "muster join", "muster verify-fabric"):
        assert f"## `{command}`" in cli_page
