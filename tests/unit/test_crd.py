"""The committed CRD against the API's declarations: every field of every spec and status type
is in the schema with its type, enumeration, minimum, default and required-ness, and the schema
has no field the API does not declare."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import get_args, get_origin

import pytest
import yaml

from trainium_api.fields import Above, Aliases, IntOrString, Min, MinLen, NoServerDefault, OneOrList, Positive, api_fields
from trainium_api.spec import TrainingRunSpec
from trainium_api.status import TrainingRunStatus
from trainium_operator import crd

ROOT = Path(__file__).resolve().parents[2]
JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}


def _committed(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


@pytest.mark.parametrize("path", crd.COMMITTED)
def test_committed_crd_is_the_generated_one(path):
    assert (ROOT / path).read_text() == crd.render(), "run: python -m trainium_operator.crd --write"


def _check(cls: type, schema: dict, where: str, seen: list[str]) -> None:
    """Compare one object schema with the declarations of ``cls``, recursively."""
    fields = api_fields(cls)
    props = schema.get("properties") or {}
    assert set(props) == {f.key for f in fields}, f"{where}: schema and declarations differ"
    assert sorted(schema.get("required", [])) == sorted(f.key for f in fields if f.required), where
    for f in fields:
        at, prop = f"{where}.{f.key}", props[f.key]
        seen.append(at)
        if f.mark(IntOrString):
            assert prop.get("x-kubernetes-int-or-string") is True, at
            continue
        tp = f.type
        if f.enum is not None:  # the current words, then the older ones still accepted
            older = [old for old, _ in f.mark(Aliases).words] if f.mark(Aliases) else []
            assert prop == {**prop, "type": "string", "enum": [*f.enum, *older]}, at
        elif dataclasses.is_dataclass(tp):
            assert prop["type"] == "object", at
            _check(tp, prop, at, seen)
        elif f.mark(OneOrList):
            # one item or a list: more than one type for a structural schema, so the node keeps
            # what it is given and the operator's loader checks it
            assert prop.get("x-kubernetes-preserve-unknown-fields") is True and "type" not in prop, at
            seen += [f"{at}[].{i.key}" for i in api_fields(get_args(tp)[0])]
        elif get_origin(tp) is list:
            assert prop["type"] == "array", at
            (item,) = get_args(tp)
            if dataclasses.is_dataclass(item):
                _check(item, prop["items"], f"{at}[]", seen)
            elif item is dict:  # Kubernetes objects passed through (tolerations, init containers)
                assert prop["items"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}, at
            else:
                assert prop["items"]["type"] == JSON_TYPES[item], at
        elif get_origin(tp) is dict:
            value = get_args(tp)[1]
            if get_origin(value) is list:  # e.g. cause -> times
                assert prop["additionalProperties"] == {"type": "array",
                                                        "items": {"type": JSON_TYPES[get_args(value)[0]]}}, at
            else:
                assert prop["additionalProperties"]["type"] == JSON_TYPES[value], at
        elif tp is dict:
            assert prop.get("x-kubernetes-preserve-unknown-fields") is True, at
        else:
            assert prop["type"] == JSON_TYPES[tp], at
        minimum, above = f.mark(Min), f.mark(Above)
        assert prop.get("minimum") == (minimum.bound if minimum else 0 if f.mark(Positive) else
                                       above.bound if above else None), at
        assert prop.get("exclusiveMinimum", False) == bool(f.mark(Positive) or above), at
        min_len = f.mark(MinLen) if "type" in prop else None  # the loader checks an untyped node's
        assert prop.get("minItems", prop.get("minLength")) == (min_len.length if min_len else None), at
        assert prop.get("nullable", False) == (f.optional and f.enum is None), at
        writes_default = (getattr(cls, "SERVER_DEFAULTS", True) and not f.mark(NoServerDefault)
                          and not f.required and f.default not in (None, [], {})
                          and not dataclasses.is_dataclass(f.default))
        assert prop.get("default") == (f.default if writes_default else None), at
        # a group's description: the field's docstring, else the class's
        own = tp.__doc__ if dataclasses.is_dataclass(tp) and not tp.__doc__.startswith(tp.__name__ + "(") else ""
        assert prop.get("description", "") == (f.doc or " ".join(own.split())), at


@pytest.mark.parametrize("path", crd.COMMITTED)
def test_every_declared_field_is_in_the_crd_as_declared(path):
    version = _committed(path)["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]["properties"]
    seen: list[str] = []
    _check(TrainingRunSpec, root["spec"], "spec", seen)
    _check(TrainingRunStatus, root["status"], "status", seen)
    assert len(seen) > 150  # every group, nested, of both
    # the printer columns read declared status fields
    for col in version["additionalPrinterColumns"]:
        parts = col["jsonPath"].lstrip(".").split(".")
        if parts[0] == "status":
            node = root["status"]
            for key in parts[1:]:
                node = node["properties"][key]
            assert node["type"] == col["type"], col
