"""Validate objects against the vendored Trainer CRD schemas, strictly.

Strict: ``additionalProperties: false`` is added to every object schema that lists its
properties and says nothing of extra ones, except the object's own ``metadata`` (ObjectMeta is
free-form in a CRD). A misspelt field then fails, as it would not on a real API server that
prunes it silently.
"""

from __future__ import annotations

import copy
import gzip
import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

CRDS = Path(__file__).parent / "crds"


def _strict(node: Any, top: bool = True) -> Any:
    if isinstance(node, dict):
        out = {k: _strict(v, top=False) for k, v in node.items() if k != "properties"}
        if "properties" in node:
            out["properties"] = {
                name: (sub if top and name == "metadata" else _strict(sub, top=False))
                for name, sub in node["properties"].items()
            }
            if "additionalProperties" not in node and not node.get(
                "x-kubernetes-preserve-unknown-fields"
            ):
                out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(item, top=False) for item in node]
    return node


@cache
def validator(kind: str, version: str) -> jsonschema.protocols.Validator:
    schema = json.loads(gzip.decompress((CRDS / f"{kind}-{version}.json.gz").read_bytes()))
    strict = _strict(copy.deepcopy(schema))
    cls = jsonschema.validators.validator_for(strict, default=jsonschema.Draft7Validator)
    return cls(strict)  # type: ignore[no-any-return]


def errors(obj: dict[str, Any], version: str) -> list[str]:
    found = validator(obj["kind"], version).iter_errors(obj)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in found]
