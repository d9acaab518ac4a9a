"""The CRD's structural OpenAPI schema, derived from the API's dataclasses (fields.fields_of):
types, enumerations, minimums, required fields, defaults and descriptions all come from the
field declarations. Cross-field rules the API server can check itself are CEL rules (RULES);
the operator's checks (spec.parse) are the complete set."""

from __future__ import annotations

import dataclasses
from typing import Any, get_args, get_origin

from .fields import Above, Aliases, FieldInfo, IntOrString, Min, MinLen, NoServerDefault, OneOrList, Positive, api_fields

_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}


def type_schema(tp: Any) -> dict:
    from .fields import literal_values
    enum = literal_values(tp)
    if enum is not None:
        return {"type": "string", "enum": list(enum)}
    if dataclasses.is_dataclass(tp):
        return schema_for(tp)
    if get_origin(tp) is list:
        return {"type": "array", "items": type_schema(get_args(tp)[0])}
    if get_origin(tp) is dict:
        return {"type": "object", "additionalProperties": type_schema(get_args(tp)[1])}
    if tp is dict:
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {"type": _TYPES[tp]}


def field_schema(cls: type, f: FieldInfo) -> dict:
    if f.mark(IntOrString):
        s: dict = {"x-kubernetes-int-or-string": True}
    elif f.mark(OneOrList):  # one type per node: the operator's loader checks the shape
        s = {"x-kubernetes-preserve-unknown-fields": True}
    else:
        s = type_schema(f.type)
    aliases = f.mark(Aliases)
    if aliases is not None:  # stored runs written with an older word keep validating
        s["enum"] = [*s["enum"], *(old for old, _ in aliases.words)]
    if f.optional and f.enum is None:
        s["nullable"] = True
    for mark in f.marks:
        if isinstance(mark, Min):
            s["minimum"] = mark.bound if isinstance(mark.bound, float) and not mark.bound.is_integer() else int(mark.bound)
        elif isinstance(mark, Positive):
            s.update(minimum=0, exclusiveMinimum=True)
        elif isinstance(mark, Above):
            s.update(minimum=mark.bound, exclusiveMinimum=True)
        elif isinstance(mark, MinLen) and "type" in s:
            s["minItems" if s["type"] == "array" else "minLength"] = mark.length
    if f.doc:
        s["description"] = f.doc
    if getattr(cls, "SERVER_DEFAULTS", True) and not f.mark(NoServerDefault) and _plain_default(f.default):
        s["default"] = f.default
    return s


def _plain_default(value: Any) -> bool:
    """A default worth writing into the schema: a scalar, or a non-empty list of scalars."""
    if value is None or value is dataclasses.MISSING or dataclasses.is_dataclass(value):
        return False
    return not isinstance(value, (list, dict)) or bool(value)


def schema_for(cls: type) -> dict:
    fields = api_fields(cls)
    out: dict = {"type": "object", "properties": {f.key: field_schema(cls, f) for f in fields}}
    required = [f.key for f in fields if f.required]
    if required:
        out["required"] = required
    if getattr(cls, "OPEN", False):
        out["x-kubernetes-preserve-unknown-fields"] = True
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
        out["description"] = " ".join(cls.__doc__.split())
    return out


_COMMAND = "(has(self.trainer) && has(self.trainer.kind) && self.trainer.kind == 'command')"
# Cross-field rules the API server checks at admission (CEL): (rule, message, field path).
# An integer written as a JSON float (a Python client's 8.0) passes the API server's integer
# schema, but no CEL rule can read it ("invalid data, expected int, got float64"), and a refusal
# from a rule at spec's level names only `spec`. So every integer field of the spec carries its
# own rule (WHOLE_NUMBER): such a value is refused naming its field. kubectl and YAML write 8.
RULES = [
    ("has(self.checkpoint) && has(self.checkpoint.uri) && size(self.checkpoint.uri) > 0",
     "checkpoint.uri is required: a restarted gang resumes from it", "spec.checkpoint.uri"),
    (f"!{_COMMAND} || (has(self.trainer.command) && size(self.trainer.command) > 0)",
     "trainer.command is required with trainer.kind command", "spec.trainer.command"),
    (f"!{_COMMAND} || (has(self.trainer.progressFormat) && size(self.trainer.progressFormat) > 0)",
     "trainer.progressFormat is required with trainer.kind command", "spec.trainer.progressFormat"),
    (f"{_COMMAND} || (has(self.data) && has(self.data.sources))",
     "data.sources is required by the builtin trainer", "spec.data.sources"),
    (f"{_COMMAND} || (has(self.data) && has(self.data.tokenizer) && size(self.data.tokenizer) > 0) || (has(self.init) && "
     "has(self.init.from) && size(self.init.from) > 0 && !self.init.from.matches('(^|/)step_[0-9]+/?$'))",
     "data.tokenizer is required (or init.from a Hugging Face directory with a tokenizer)", "spec.data.tokenizer"),
    ("!has(self.training) || !has(self.training.globalBatchSize) || !has(self.training.microBatchSize) || "
     "self.training.globalBatchSize % self.training.microBatchSize == 0",
     "training.globalBatchSize must be a multiple of training.microBatchSize", "spec.training.globalBatchSize"),
    ("!has(self.training) || !has(self.training.lr) || !has(self.training.minLr) || "
     "self.training.minLr <= self.training.lr", "training.minLr must not exceed training.lr", "spec.training.minLr"),
    ("!has(self.parallelism) || !has(self.parallelism.tensor) || !has(self.model) || !has(self.model.numHeads) || "
     "self.model.numHeads % self.parallelism.tensor == 0",
     "parallelism.tensor must divide model.numHeads", "spec.parallelism.tensor"),
]


WHOLE_NUMBER = {"rule": "type(self) == int",
                "message": "must be written as an integer (8, not 8.0): the API server's rules read it as one"}


def _whole_numbers_only(schema: dict) -> None:
    """WHOLE_NUMBER on every integer in schema, however deep (objects, lists, maps)."""
    if schema.get("type") == "integer":
        schema.setdefault("x-kubernetes-validations", []).append(dict(WHOLE_NUMBER))
    for sub in [*schema.get("properties", {}).values(), schema.get("items"), schema.get("additionalProperties")]:
        if isinstance(sub, dict):
            _whole_numbers_only(sub)


IMMUTABLE = ("is immutable while the run exists (only {mutable} may change, and {suspended} while the run is "
             "suspended; delete and re-create the run to change it)")


def spec_schema() -> dict:
    from .spec import TrainingRunSpec
    out = schema_for(TrainingRunSpec)
    _whole_numbers_only(out)
    mutable = {f.key for f in api_fields(TrainingRunSpec) if f.name in TrainingRunSpec.MUTABLE}
    suspended = {f.key for f in api_fields(TrainingRunSpec) if f.name in TrainingRunSpec.MUTABLE_WHILE_SUSPENDED}
    why = IMMUTABLE.format(mutable=" and ".join(sorted(mutable)), suspended=" and ".join(sorted(suspended)))
    transitions = []
    was_suspended = "(has(oldSelf.suspend) && oldSelf.suspend)"
    for key in sorted(suspended):  # checked one level up: the rule needs oldSelf.suspend
        transitions.append({"rule": f"{was_suspended} || (has(self.{key}) == has(oldSelf.{key}) && "
                                    f"(!has(self.{key}) || self.{key} == oldSelf.{key}))",
                            "message": f"spec.{key} may change only while the run is suspended (spec.suspend: "
                                       "true): a running gang cannot follow it", "fieldPath": f".{key}"})
    for f in api_fields(TrainingRunSpec):
        if f.key in mutable or f.key in suspended:
            continue
        # CEL transition rules: evaluated on updates, where the field is in both versions ...
        out["properties"][f.key].setdefault("x-kubernetes-validations", []).append(
            {"rule": "self == oldSelf", "message": why})
        if not f.required:  # ... so adding or removing it is caught one level up
            transitions.append({"rule": f"has(self.{f.key}) == has(oldSelf.{f.key})",
                                "message": f"spec.{f.key} {why}", "fieldPath": f".{f.key}"})
    out["x-kubernetes-validations"] = [{"rule": r, "message": m, "fieldPath": p.removeprefix("spec")}
                                       for r, m, p in RULES] + transitions
    return out


def root_rules() -> list[dict]:
    """Rules on the whole object (CEL sees metadata.name at the root): the run's name."""
    from .spec import RUN_NAME_MAX, RUN_NAME_PATTERN, RUN_NAME_RULE
    # checked when a run is created only (optionalOldSelf): a run named so before this rule
    # existed must still take updates (its finalizer's removal, the operator's status)
    return [{"rule": f"oldSelf.hasValue() || (size(self.metadata.name) <= {RUN_NAME_MAX} && "
                     f"self.metadata.name.matches('{RUN_NAME_PATTERN}'))",
             "message": RUN_NAME_RULE, "optionalOldSelf": True}]


def status_schema() -> dict:
    from .status import TrainingRunStatus
    return schema_for(TrainingRunStatus)
