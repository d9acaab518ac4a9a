"""camelCase dicts (YAML, the TrainingRun spec) <-> the API's dataclasses, checked field by field
from their declarations (fields.fields_of): types, enumerations, constraints, required fields,
unknown keys. Cross-field rules are each group's ``validate()``."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, get_args, get_origin

from .fields import ConfigError, FieldInfo, IntOrString, api_fields, camel, snake

_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def build(cls: type, data: Any, path: str = "") -> Any:
    """An instance of ``cls`` from its camelCase dict form (snake_case keys are accepted too:
    command-line overrides), or ConfigError naming the field."""
    shorthand = getattr(cls, "SHORTHAND", None)
    if shorthand and isinstance(data, str):
        data = {shorthand: data}
    if not isinstance(data, Mapping):
        raise ConfigError(path or "config", f"must be a mapping, got {type(data).__name__}")
    infos = api_fields(cls)
    # camelCase keys, and the snake_case and camelCase of the Python names (command-line overrides)
    by_key = ({f.key: f for f in infos} | {f.name: f for f in infos} | {camel(f.name): f for f in infos}
              | {snake(f.key): f for f in infos})
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        info = by_key.get(str(key))
        if info is None:
            if getattr(cls, "OPEN", False):
                continue
            known = ", ".join(sorted(f.key for f in infos))
            raise ConfigError(where, f"unknown field (known: {known})")
        kwargs[info.name] = convert(info, value, where)
    for info in infos:
        if info.required and info.name not in kwargs:
            raise ConfigError(f"{path}.{info.key}" if path else info.key, "is required")
    if getattr(cls, "KUBE_OBJECT", False):
        return dict(data)
    return cls(**kwargs)


def convert(info: FieldInfo, value: Any, where: str) -> Any:
    if value is None and info.optional:
        return None
    if info.mark(IntOrString):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(where, f"must be a number or a string, got {value!r}")
        out = value if isinstance(value, str) else str(value)
    else:
        out = _value(info.type, value, where)
    for mark in info.marks:
        refuses = getattr(mark, "refuses", None)
        why = refuses(out) if refuses else None
        if why:
            raise ConfigError(where, why)
    return out


def _value(tp: Any, value: Any, where: str) -> Any:
    from .fields import literal_values
    enum = literal_values(tp)
    if enum is not None:
        if not isinstance(value, str) or value not in enum:
            shown = ", ".join(repr(v) if v == "" else v for v in enum)
            raise ConfigError(where, f"must be one of {shown}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, {} if value is None else value, where)
    if get_origin(tp) is list:
        (item,) = get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(where, f"must be a list of {_plural(item)}, got {value!r}")
        return [_value(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if get_origin(tp) is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(where, f"must be an object, got {value!r}")
        item = get_args(tp)[1]
        return {str(k): _value(item, v, f"{where}.{k}") for k, v in value.items()}
    if tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(where, f"must be an object, got {value!r}")
        return dict(value)
    if tp in _SCALARS:
        return _scalar(tp, value, where)
    raise TypeError(f"{where}: the API has no loader for type {tp!r}")  # a declaration error, not input


def _plural(tp: Any) -> str:
    if dataclasses.is_dataclass(tp):
        return "{" + ", ".join(f.key for f in api_fields(tp)) + "}"
    return {int: "integers", float: "numbers", bool: "booleans"}.get(tp, "strings")


def _scalar(tp: type, value: Any, where: str) -> Any:
    if tp in (int, float):
        ok = not isinstance(value, bool) and (isinstance(value, int) or (
            isinstance(value, float) and (tp is float or value.is_integer())))
    else:
        ok = isinstance(value, tp)
    if not ok:
        raise ConfigError(where, f"must be {_SCALARS[tp]}, got {value!r}")
    return tp(value)


def to_dict(obj: Any, drop_none: bool = False) -> Any:
    """Dataclass -> camelCase dict (the YAML/CRD form); derived fields are left out, and with
    ``drop_none`` so are fields that are not set (None)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.key: to_dict(getattr(obj, f.name), drop_none) for f in api_fields(type(obj))
                if not (drop_none and getattr(obj, f.name) is None)}
    if isinstance(obj, list):
        return [to_dict(x, drop_none) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v, drop_none) for k, v in obj.items()}
    return obj


def lenient(cls: type, data: Any) -> Any:
    """Like :func:`build`, for what the operator wrote itself (the status): a field that does
    not load (edited by hand, written by another version) takes its default, and a list item
    that does not load is left out, so a malformed status never stops the operator."""
    if not isinstance(data, Mapping):
        data = {}
    kwargs: dict[str, Any] = {}
    for info in api_fields(cls):
        if info.key not in data:
            continue
        value = data[info.key]
        item = get_args(info.type)[0] if get_origin(info.type) is list else None
        try:
            if item is not None and dataclasses.is_dataclass(item) and isinstance(value, list):
                kwargs[info.name] = [x for x in (_try(lenient, item, v) for v in value) if x is not None]
            elif dataclasses.is_dataclass(info.type) and isinstance(value, Mapping):
                kwargs[info.name] = lenient(info.type, value)
            else:
                kwargs[info.name] = convert(info, value, info.key)
        except ConfigError:
            continue
    try:
        return cls(**kwargs)
    except TypeError:  # a required field is missing
        raise ConfigError(cls.__name__, "required fields missing") from None


def _try(fn, *args):
    try:
        return fn(*args)
    except ConfigError:
        return None


def changed_fields(old: Any, new: Any) -> dict:
    """The camelCase merge patch that turns ``old`` into ``new`` (same dataclass): every
    top-level field whose value differs, null where it was cleared. A merge patch merges
    objects key by key (so a cleared key inside one is written as null) and replaces lists
    whole (so unset keys of their items are simply left out)."""
    out = {}
    for f in api_fields(type(new)):
        value = getattr(new, f.name)
        if getattr(old, f.name) != value:
            out[f.key] = to_dict(value, drop_none=isinstance(value, list))
    return out
