"""How a field of the TrainingRun API is declared, and the one walker that reads it.

A field is a dataclass attribute: its Python type says the JSON type (``int``, ``float``,
``bool``, ``str``, a ``Literal`` enumeration, ``list[...]``, ``dict``, a nested dataclass,
``X | None`` where null means "derive it"), ``Annotated`` markers below add constraints, and
the string literal written under it is its documentation. :func:`fields_of` turns all of that
into :class:`FieldInfo` records; the loader (``load``) and the CRD schema (``schema``) read only
those, so a minimum, an enumeration or a default is written once, at the field.

Class-level switches (``ClassVar``s of a dataclass):
  SERVER_DEFAULTS  the API server fills in this group's defaults (False where a default would
                   mislead: a model shape would override its preset)
  SHORTHAND        a plain string stands for an object with just this field (a data source URI)
  KUBE_OBJECT      a Kubernetes object passed through as a dict (the fields here are only the
                   ones we check); OPEN: other keys are allowed (a volume's source)
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    """An invalid configuration value. ``field`` is the dotted camelCase path of the culprit."""

    def __init__(self, field_path: str, message: str):
        super().__init__(f"{field_path}: {message}")
        self.field = field_path
        self.message = message


# --------------------------------------------------------------------------------------------
# Markers for Annotated[...]
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Min:
    """value >= bound."""
    bound: float

    def refuses(self, value: Any) -> str | None:
        if not value >= self.bound:  # NaN compares false: refused too
            return "must not be negative" if self.bound == 0 else f"must be at least {self.bound:g}"
        return None


@dataclass(frozen=True)
class Positive:
    """value > 0."""

    def refuses(self, value: Any) -> str | None:
        return "must be positive" if not value > 0 else None  # NaN compares false: refused too


@dataclass(frozen=True)
class Above:
    """value > bound (Positive is Above(0))."""
    bound: float

    def refuses(self, value: Any) -> str | None:
        return f"must be more than {self.bound:g}" if not value > self.bound else None


@dataclass(frozen=True)
class MinLen:
    """At least this many characters (a string) or items (a list)."""
    length: int

    def refuses(self, value: Any) -> str | None:
        if len(value) >= self.length:
            return None
        if isinstance(value, str):
            return "must not be empty"
        return f"needs at least {self.length} item{'s' if self.length > 1 else ''}"


@dataclass(frozen=True)
class IntOrString:
    """A number or a string (stored as its string), e.g. ``hangTimeoutSeconds: auto`` or ``600``."""


@dataclass(frozen=True)
class OneOrList:
    """A list field whose value may also be one item, or one string where the item has a
    SHORTHAND (``heldOut: s3://bucket/eval/``). A structural schema gives a node one type, so
    the CRD keeps this node as it is given and the operator's loader checks it, naming the field."""


@dataclass(frozen=True)
class Aliases:
    """Older words an enumeration still accepts, each with the word it now stands for. The
    enumerations use Kubernetes' CamelCase words, none of them a YAML 1.1 boolean: kubectl reads
    an unquoted ``on`` or ``off`` as true or false, which the API server refuses for a string.
    The CRD's enum lists the old words too (a stored run keeps validating); the loader, and the
    group's ``__post_init__`` (canonical_words), turn them into the new ones. ``false`` and
    ``true``: what a boolean means, where a config file read as YAML 1.1 gives one."""
    words: tuple[tuple[str, str], ...]
    false: str | None = None
    true: str | None = None

    def of(self, value: Any) -> Any:
        if isinstance(value, bool):
            meant = self.true if value else self.false
            return value if meant is None else meant
        return dict(self.words).get(value, value) if isinstance(value, str) else value

    def older(self, value: Any) -> Any:
        """The older word for ``value`` (every release reads it), or ``value`` itself."""
        return next((old for old, new in self.words if new == value), value)


def canonical_words(obj: Any) -> None:
    """Every field of ``obj`` (a dataclass) declared with Aliases set to its current word, so that
    code compares one spelling however the object was made."""
    for f in fields_of(type(obj)):
        aliases = f.mark(Aliases)
        if aliases is not None:
            object.__setattr__(obj, f.name, aliases.of(getattr(obj, f.name)))


@dataclass(frozen=True)
class Doc:
    """The field's description when it is computed (from other facts), not a docstring."""
    text: str


@dataclass(frozen=True)
class NoServerDefault:
    """The API server leaves this field out when it is not given (its default means 'not set'
    and a rule requires it)."""


@dataclass(frozen=True)
class Newer:
    """A field trainer images older than ``release`` do not know (they refuse an unknown key).
    Where an older image may read the config (the operator renders it for the image a run
    names: load.to_dict ``older_words``), the field is written only when set away from its
    default, so a run that does not use it still starts on an older image."""
    release: str


@dataclass(frozen=True)
class Key:
    """The YAML/CRD key when it is not the camelCase of the Python name (``async``, ``from``)."""
    name: str


DERIVED = {"derived": True}
"""``field(metadata=DERIVED)``: computed by the operator or the trainer, not part of the API."""


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------


def camel(name: str) -> str:
    head, *rest = name.rstrip("_").split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


# --------------------------------------------------------------------------------------------
# The walker
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldInfo:
    name: str
    """Python attribute name."""
    key: str
    """YAML/CRD key."""
    type: Any
    """The type without Optional and Annotated: int, float, bool, str, dict, list[X], a
    dataclass, or a Literal (enum)."""
    optional: bool
    marks: tuple
    doc: str
    default: Any
    """dataclasses.MISSING when the field is required."""
    derived: bool

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    @property
    def enum(self) -> tuple | None:
        return literal_values(self.type)

    def mark(self, kind: type) -> Any:
        return next((m for m in self.marks if isinstance(m, kind)), None)


def literal_values(tp: Any) -> tuple | None:
    """The values of a Literal, or of a union of Literals; None for other types."""
    if get_origin(tp) is Literal:
        return get_args(tp)
    if get_origin(tp) in (typing.Union, types.UnionType) and all(get_origin(a) is Literal for a in get_args(tp)):
        return tuple(v for a in get_args(tp) for v in get_args(a))
    return None


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (string literals right after an annotation),
    of the class and the classes it inherits from."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                    and isinstance(nxt.value.value, str):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def fields_of(cls: type) -> tuple[FieldInfo, ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp, marks = hints[f.name], ()
        if get_origin(tp) is typing.Annotated:
            tp, *rest = get_args(tp)
            marks = tuple(rest)
        optional = False
        if get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp):
            rest_args = [a for a in get_args(tp) if a is not type(None)]
            optional = True
            tp = rest_args[0] if len(rest_args) == 1 else typing.Union[tuple(rest_args)]
            if get_origin(tp) is typing.Annotated:  # Optional[Annotated[X, ...]]
                tp, *inner = get_args(tp)
                marks += tuple(inner)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        key = next((m.name for m in marks if isinstance(m, Key)), camel(f.name))
        doc = next((m.text for m in marks if isinstance(m, Doc)), docs.get(f.name, ""))
        out.append(FieldInfo(f.name, key, tp, optional, marks, " ".join(doc.split()), default,
                             bool(f.metadata.get("derived"))))
    return tuple(out)


def api_fields(cls: type) -> tuple[FieldInfo, ...]:
    """The fields a user writes (not the derived ones)."""
    return tuple(f for f in fields_of(cls) if not f.derived)


def path_of(cls: type, name: str, group: str = "") -> str:
    """``group.key`` of a field of ``cls``, for an error message that names it."""
    key = next(f.key for f in fields_of(cls) if f.name == name)
    return f"{group}.{key}" if group else key
