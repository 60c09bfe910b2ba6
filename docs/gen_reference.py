"""Write the generated reference pages: the job spec and the cluster file from their pydantic
models, the CLI from its typer app. `make docs` runs it; tests/docs checks the pages are current.

    .venv/bin/python docs/gen_reference.py          # rewrites docs/reference/*.md
"""

from __future__ import annotations

import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from muster.spec.cluster import ClusterFile  # noqa: E402
from muster.spec.job import JobSpec  # noqa: E402


def _type(annotation: Any) -> str:
    """A short, readable type: int, str | None, list[str], 'auto' | 'manual', a model's name."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args)
    if origin in (list, tuple, set):
        return f"list[{', '.join(_type(a) for a in args if a is not Ellipsis)}]"
    if origin is dict:
        return f"map[{_type(args[0])}, {_type(args[1])}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (a model, a list of them, one or None...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += _models(arg)
    return found


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows, nested = [], []
    for name, info in model.model_fields.items():
        if info.default is not PydanticUndefined:
            default = "" if info.default is None else f"`{info.default!r}`"
        elif info.default_factory is not None:
            default = "(empty)" if not info.default_factory() else "(see below)"  # type: ignore[call-arg]
        else:
            default = "**required**"
        description = (info.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{prefix}{name}` | {_type(info.annotation)} | {default} | {description} |")
        nested += [(f"{prefix}{name}.", m) for m in _models(info.annotation)]
    for path, sub in nested:
        rows += _rows(sub, path)
    return rows


def model_page(title: str, intro: str, model: type[BaseModel]) -> str:
    head = ["| Field | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
    return f"# {title}\n\n{intro}\n\n" + "\n".join(head + _rows(model, "")) + "\n"


def cli_page() -> str:
    from typer.main import get_command

    from muster.cli.main import load_commands

    root = get_command(load_commands())
    out = [
        "# The `muster` command",
        "",
        "Generated from the CLI itself (`muster COMMAND --help` prints the same).",
        "",
    ]

    def walk(command: Any, path: list[str]) -> None:
        # (typer ships its own copy of click: duck-typed, not isinstance)
        if hasattr(command, "commands"):
            for name in sorted(command.commands):
                walk(command.commands[name], [*path, name])
            return
        context = command.context_class(command, info_name=" ".join(path))
        out.append(f"## `{' '.join(path)}`\n")
        helptext = (command.help or "").strip()
        if helptext:
            out.append(helptext.split("\n\n")[0].replace("\n", " ") + "\n")
        usage = " ".join(command.collect_usage_pieces(context))
        out.append(f"```\n{' '.join(path)} {usage}\n```\n")
        rows = []
        for param in command.params:
            record = param.get_help_record(context)
            if record is None:
                if param.param_type_name == "argument":
                    rows.append(f"| `{param.human_readable_name}` | (argument) |")
                continue
            flags, text = record
            text = re.sub(r"\s+", " ", text).replace("|", "\\|")
            rows.append(f"| `{flags}` | {text} |")
        if rows:
            out.extend(["| Option | Meaning |", "| --- | --- |", *rows, ""])

    walk(root, ["muster"])
    # Defaults computed on this machine (the running Python) read the same everywhere.
    return "\n".join(out).rstrip().replace(sys.executable, "the Python muster runs on") + "\n"


def pages() -> dict[str, str]:
    return {
        "reference/job-spec.md": model_page(
            "Job spec",
            "Every field of a job's YAML file (`muster submit job.yaml`), generated from "
            "`muster.spec.job.JobSpec`. Unknown fields are refused, naming the field.",
            JobSpec,
        ),
        "reference/cluster-file.md": model_page(
            "Cluster file: `muster.cluster.yml`",
            "Every key of the cluster file (`muster up`, fan-out and walk-ins), generated "
            "from `muster.spec.cluster.ClusterFile`.",
            ClusterFile,
        ),
        "reference/cli.md": cli_page(),
    }


def main() -> None:
    for name, text in pages().items():
        path = HERE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
