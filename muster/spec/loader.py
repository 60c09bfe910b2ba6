"""Turn YAML or Python data into checked specs, with every error named and fixable."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from muster.errors import FieldError, SpecError
from muster.spec.cluster import ClusterFile, check_cluster
from muster.spec.job import JobSpec
from muster.spec.rules import check_job, check_raw
from muster.spec.worker import WorkerInventory

M = TypeVar("M", bound=BaseModel)


def parse_job(data: object, source: str = "job spec") -> JobSpec:
    """Validate job data (a mapping or a JobSpec): shape, types, then every rule."""
    if isinstance(data, JobSpec):
        spec = data
    else:
        try:
            spec = parse_model(JobSpec, data, source)
        except SpecError as exc:
            if isinstance(data, Mapping):
                exc = SpecError([*check_raw(data), *exc.errors], source)
            raise exc from None
    errors = check_job(spec)
    if errors:
        raise SpecError(errors, source)
    return spec


def load_job_file(path: str | Path) -> JobSpec:
    """Read and validate a job YAML file."""
    return parse_job(read_yaml(path), source=str(path))


def parse_cluster(data: object, source: str = "cluster file") -> ClusterFile:
    """Validate a cluster file's data (seed 003): shape, types, then every rule. A top-level
    ``cluster:`` key, as seed 003 writes the file, is unwrapped."""
    if isinstance(data, Mapping) and set(data) == {"cluster"}:
        data = data["cluster"]
    cluster = parse_model(ClusterFile, data, source)
    errors = check_cluster(cluster)
    if errors:
        raise SpecError(errors, source)
    return cluster


def load_cluster_file(path: str | Path) -> ClusterFile:
    """Read and validate ``muster.cluster.yml``."""
    return parse_cluster(read_yaml(path), source=str(path))


def load_inventory_file(path: str | Path) -> list[WorkerInventory]:
    """Read a list of workers (a YAML list, or a mapping with a ``workers`` list)."""
    data = read_yaml(path)
    if isinstance(data, Mapping) and "workers" in data:
        data = data["workers"]
    if not isinstance(data, list):
        raise SpecError([FieldError("workers", "must be a list of workers")], str(path))
    workers: list[WorkerInventory] = []
    errors: list[FieldError] = []
    for i, item in enumerate(data):
        try:
            workers.append(parse_model(WorkerInventory, item, str(path)))
        except SpecError as exc:
            errors += [FieldError(f"workers[{i}].{e.field}", e.message) for e in exc.errors]
    seen: set[object] = set()
    for i, item in enumerate(data):
        wid = item.get("id") if isinstance(item, Mapping) else None
        if wid is not None and wid in seen:
            errors.append(FieldError(f"workers[{i}].id", f"{wid!r} appears twice; ids are unique"))
        seen.add(wid)
    if errors:
        raise SpecError(errors, str(path))
    return workers


def read_yaml(path: str | Path) -> object:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError([FieldError("", f"cannot read {p}: {exc.strerror}")], str(p)) from exc
    except UnicodeDecodeError as exc:
        problem = f"byte {exc.start} is not UTF-8; save the file as UTF-8"
        raise SpecError([FieldError("", problem)], str(p)) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([FieldError("", f"not valid YAML{where}: {problem}")], str(p)) from exc
    except ValueError as exc:
        # A scalar YAML resolves but cannot build: a date like 2001-13-45, an !!int that
        # is no number, an integer of thousands of digits. Quoting it makes it a string.
        problem = f"a value YAML cannot read ({exc}); quote it to make it a string"
        raise SpecError([FieldError("", problem)], str(p)) from None
    except RecursionError:
        problem = "nested too deeply for YAML to read; flatten it"
        raise SpecError([FieldError("", problem)], str(p)) from None


def parse_model(model: type[M], data: object, source: str) -> M:
    """Validate ``data`` against ``model``; pydantic's errors become named FieldErrors."""
    if not isinstance(data, Mapping):
        kind = "empty" if data is None else type(data).__name__
        raise SpecError([FieldError("", f"must be a mapping of fields, got {kind}")], source)
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise SpecError([_field_error(model, e) for e in exc.errors()], source) from None


def load_stored_job(data: object, job_id: str) -> JobSpec:
    """A spec as the store holds it (JSON: strict=False lets its strings be enums and its
    lists tuples). Raises SpecError naming each field where this version no longer accepts
    what an older one stored (or a spec past a bound added since)."""
    try:
        return JobSpec.model_validate(data, strict=False)
    except ValidationError as exc:
        source = f"job {job_id}'s stored spec"
        raise SpecError([_field_error(JobSpec, e) for e in exc.errors()], source) from None


def first_problems(exc: SpecError, most: int = 2) -> str:
    """The first fields a SpecError names, on one line (a job's state message, a 409)."""
    shown = "; ".join(str(e) for e in exc.errors[:most])
    more = len(exc.errors) - most
    return shown + (f"; and {more} more" if more > 0 else "")


def _field_error(model: type[BaseModel], err: ErrorDetails) -> FieldError:
    loc = [str(part) for part in err["loc"] if not isinstance(part, int)]
    field = _dotted(err["loc"])
    kind = err["type"]
    got = err.get("input")
    if kind == "extra_forbidden":
        known = sorted(_fields_at(model, loc[:-1]))
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(known)}"
        return FieldError(field, f"unknown field; {hint}")
    if kind == "missing":
        return FieldError(field, "is required; add it")
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return FieldError(field, f"must be one of {expected} (got {got!r})")
    bound = _BOUNDS.get(kind)
    if bound is not None:
        limit = next(iter(err.get("ctx", {}).values()), "?")
        return FieldError(field, f"must be {bound} {limit} (got {got!r})")
    if kind == "value_error":
        return FieldError(field, str(err.get("ctx", {}).get("error", err["msg"])))
    message = err["msg"][0].lower() + err["msg"][1:]
    if kind.endswith("_type") or kind.endswith("_parsing"):
        hint = " (quote it in YAML)" if kind == "string_type" and got is not None else ""
        return FieldError(field, f"{message}, got {got!r}{hint}")
    return FieldError(field, f"{message} (got {got!r})")


_BOUNDS = {
    "greater_than_equal": ">=",
    "greater_than": ">",
    "less_than_equal": "<=",
    "less_than": "<",
}


def _dotted(loc: tuple[int | str, ...]) -> str:
    """``("workers", 2, "host")`` -> ``workers[2].host``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _fields_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    """The field names of the nested model at ``loc`` (empty when it is not a model)."""
    current: Any = model
    for part in loc:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        info = current.model_fields.get(part)
        if info is None:
            return []
        current = _model_in(info.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is list:
        return _model_in(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None
