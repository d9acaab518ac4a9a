"""camelCase dicts (YAML, the TrainingRun spec) <-> the API's dataclasses, checked field by field
from their declarations (fields.fields_of): types, enumerations, constraints, required fields,
unknown keys. Cross-field rules are each group's ``validate()``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, get_args, get_origin

from .fields import Aliases, ConfigError, FieldInfo, IntOrString, Newer, OneOrList, api_fields, camel, literal_values, snake

_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def build(cls: type, data: Any, path: str = "") -> Any:
    """An instance of ``cls`` from its camelCase dict form (snake_case keys are accepted too:
    command-line overrides), or ConfigError naming the field."""
    shorthand = getattr(cls, "SHORTHAND", None)
    if shorthand and isinstance(data, str):
        data = {shorthand: data}
    if not isinstance(data, Mapping):
        raise ConfigError(path or "config", f"must be a mapping, got {type(data).__name__}")
    by_key = _keys(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        known = by_key.get(str(key))
        if known is None:
            if getattr(cls, "OPEN", False):
                continue
            names = ", ".join(sorted(f.key for f in api_fields(cls)))
            raise ConfigError(where, f"unknown field (known: {names})")
        info, conv = known
        kwargs[info.name] = conv(value, where)
    for info in api_fields(cls):
        if info.required and info.name not in kwargs:
            raise ConfigError(f"{path}.{info.key}" if path else info.key, "is required")
    if getattr(cls, "KUBE_OBJECT", False):
        return dict(data)
    return cls(**kwargs)


@functools.cache
def _keys(cls: type) -> dict[str, tuple[FieldInfo, Callable[[Any, str], Any]]]:
    """Every key a field of ``cls`` answers to, with its converter: the camelCase key, and the
    snake_case and camelCase of the Python name (command-line overrides)."""
    out: dict[str, tuple[FieldInfo, Callable[[Any, str], Any]]] = {}
    for f in api_fields(cls):
        entry = (f, _field_converter(f))
        for key in (snake(f.key), camel(f.name), f.name, f.key):
            out[key] = entry
    return out


def convert(info: FieldInfo, value: Any, where: str) -> Any:
    """One field's value, checked against its declaration."""
    return _field_converter(info)(value, where)


def _field_converter(info: FieldInfo) -> Callable[[Any, str], Any]:
    """The converter of one field: its type's, then its constraints; None where it is optional."""
    checks = tuple(m.refuses for m in info.marks if hasattr(m, "refuses"))
    if info.mark(IntOrString):
        def base(value: Any, where: str) -> Any:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ConfigError(where, f"must be a number or a string, got {value!r}")
            return value if isinstance(value, str) else str(value)
    elif info.mark(OneOrList):
        listed, item = _converter(info.type), get_args(info.type)[0]
        shorthand = getattr(item, "SHORTHAND", None)
        one = f"a {shorthand}, a list of them, or a list of {_plural(item)}" if shorthand else \
            f"one of {_plural(item)} or a list of them"

        def base(value: Any, where: str) -> Any:
            if isinstance(value, (str, Mapping)):  # one item: `heldOut: s3://bucket/eval/`
                value = [value]
            if not isinstance(value, list):
                raise ConfigError(where, f"must be {one}, got {value!r}")
            return listed(value, where)
    else:
        base = _converter(info.type)
    aliases = info.mark(Aliases)
    if aliases is not None:  # an older word (or a YAML 1.1 boolean) for one of the enumeration's
        current = base

        def base(value: Any, where: str) -> Any:
            return current(aliases.of(value), where)
    if not checks and not info.optional:
        return base
    optional = info.optional

    def checked(value: Any, where: str) -> Any:
        if value is None and optional:
            return None
        out = base(value, where)
        for check in checks:
            why = check(out)
            if why:
                raise ConfigError(where, why)
        return out
    return checked


def _value(tp: Any, value: Any, where: str) -> Any:
    return _converter(tp)(value, where)


@functools.cache
def _converter(tp: Any) -> Callable[[Any, str], Any]:
    """The function that checks and converts a value of type ``tp``, decided once per type (the
    operator reads every run's status on every pass)."""
    enum = literal_values(tp)
    if enum is not None:
        allowed, shown = frozenset(enum), ", ".join(repr(v) if v == "" else v for v in enum)

        def one_of(value: Any, where: str) -> Any:
            if not isinstance(value, str) or value not in allowed:
                raise ConfigError(where, f"must be one of {shown}, got {value!r}")
            return value
        return one_of
    if dataclasses.is_dataclass(tp):
        return lambda value, where: build(tp, {} if value is None else value, where)
    if get_origin(tp) is list:
        (item,) = get_args(tp)
        each, plural = _converter(item), _plural(item)

        def list_of(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise ConfigError(where, f"must be a list of {plural}, got {value!r}")
            return [each(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return list_of
    if get_origin(tp) is dict:
        each = _converter(get_args(tp)[1])

        def map_of(value: Any, where: str) -> Any:
            if not isinstance(value, Mapping):
                raise ConfigError(where, f"must be an object, got {value!r}")
            return {str(k): each(v, f"{where}.{k}") for k, v in value.items()}
        return map_of
    if tp is dict:
        def free_object(value: Any, where: str) -> Any:
            if not isinstance(value, Mapping):
                raise ConfigError(where, f"must be an object, got {value!r}")
            return dict(value)
        return free_object
    if tp in _SCALARS:
        return lambda value, where: _scalar(tp, value, where)
    raise TypeError(f"the API has no loader for type {tp!r}")  # a declaration error, not input


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


def to_dict(obj: Any, drop_none: bool = False, older_words: bool = False) -> Any:
    """Dataclass -> camelCase dict (the YAML/CRD form); derived fields are left out, and with
    ``drop_none`` so are fields that are not set (None). ``older_words``: an enumeration with
    Aliases is written with its older word, which every release reads (the trainer image a run
    names may predate the current words), and a field marked Newer is left out at its default."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in api_fields(type(obj)):
            value = getattr(obj, f.name)
            if drop_none and value is None:
                continue
            if older_words and f.mark(Newer) is not None and value == f.default:
                continue  # an older trainer image refuses the key it does not know
            aliases = f.mark(Aliases) if older_words else None
            if aliases is not None:
                value = aliases.older(value)
            out[f.key] = to_dict(value, drop_none, older_words)
        return out
    if isinstance(obj, list):
        return [to_dict(x, drop_none, older_words) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v, drop_none, older_words) for k, v in obj.items()}
    return obj


def lenient(cls: type, data: Any) -> Any:
    """Like :func:`build`, for what the operator wrote itself (the status): a field that does
    not load (edited by hand, written by another version) takes its default, and a list item
    that does not load is left out, so a malformed status never stops the operator."""
    if not isinstance(data, Mapping):
        data = {}
    kwargs: dict[str, Any] = {}
    for info, conv, items_of, nested in _lenient_plan(cls):
        value = data.get(info.key, _ABSENT)
        if value is _ABSENT:
            continue
        try:
            if items_of is not None and isinstance(value, list):
                kwargs[info.name] = [x for x in (_try(lenient, items_of, v) for v in value) if x is not None]
            elif nested and isinstance(value, Mapping):
                kwargs[info.name] = lenient(info.type, value)
            else:
                kwargs[info.name] = conv(value, info.key)
        except ConfigError:
            continue
    try:
        return cls(**kwargs)
    except TypeError:  # a required field is missing
        raise ConfigError(cls.__name__, "required fields missing") from None


_ABSENT = object()


@functools.cache
def _lenient_plan(cls: type) -> tuple[tuple[FieldInfo, Callable[[Any, str], Any], type | None, bool], ...]:
    """Each field with its converter, the dataclass of its list items when it is a list of
    them, and whether it is itself a dataclass (decided once per class)."""
    def items_of(tp: Any) -> type | None:
        item = get_args(tp)[0] if get_origin(tp) is list else None
        return item if item is not None and dataclasses.is_dataclass(item) else None
    return tuple((info, _field_converter(info), items_of(info.type), dataclasses.is_dataclass(info.type))
                 for info in api_fields(cls))


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
