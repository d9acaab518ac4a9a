"""The progress annotation's schema (docs/architecture.md 3.2): how the operator learns step, speed and hangs.

Local rank 0 of every pod (or trainer.pod.watch for a command trainer) writes its own pod's annotation
``trainium.dev/progress``: one JSON object, a :class:`ProgressReport` (its fields, documented one
by one, are the wire fields of :data:`FIELDS` in camelCase), whose last four fields are the
pod's view of its checkpoint store, which the operator cannot read itself (it runs in its own
pod, without the trainer pods' volumes or credentials): a :class:`StoreReport`.
:meth:`ProgressReport.to_annotation` encodes it, :meth:`ProgressReport.parse` reads it back with
every field checked. The writer (a background thread that patches the pod) is trainer.contract.progress;
the operator and tools need only this module.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from dataclasses import asdict, dataclass

from .checkpoints import RESTORE_SOURCES

ERROR_CHARS = 300  # an error carried in a report is cut to this many characters by the writer
MAX_LENGTH = 4096  # a report is about 150-1,000 bytes; a larger annotation is not parsed at all


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


# What each field may hold. The annotation is written by user code (a command trainer's log
# is parsed by trainer.pod.watch, and anything in the pod can patch it), so the operator checks every
# field for type and range and drops one that does not fit rather than compute with it. Each
# field of the report carries its check (and its wire name where that is not the camelCase of
# its own, and the digits it is rounded to on the wire) in its metadata: the one source of the
# schema.
def _wire(default=None, *, check, digits: int | None = None, name: str | None = None):
    return dataclasses.field(default=default, metadata={"check": check, "digits": digits, "wire": name})


def _number(kind: type, low: float, high: float, digits: int | None = None, default=None):
    return _wire(default, check=lambda value: _checked_number(value, kind, low, high), digits=digits)


_STEP = (int, 0, 2 ** 53)
# A tag is one name in the store: no separator, no control character, so the operator can show it
# and join it to spec.checkpoint.uri without a pod pointing it anywhere else.
_TAG = re.compile(r"[^/\\\x00-\x1f\x7f]{1,200}")
_SUBFIELDS: dict[str, tuple] = {  # field -> (type, low, high, required)
    "tag": (str, 1, 200, True), "step": (int, 0, 2 ** 53, False), "time": (float, 0.0, 1e11, False),
    "error": (str, 0, 2 * ERROR_CHARS, True), "count": (int, 1, 2 ** 31, True)}


@dataclass(frozen=True)
class CheckpointSeen:
    """The newest complete checkpoint a pod sees in its store."""
    tag: str
    step: int | None = None
    time: float | None = None  # when its ``done`` was written (epoch seconds), where known


@dataclass(frozen=True)
class SaveFailure:
    """The newest save that failed, and how many failed since the last one that completed."""
    tag: str
    error: str
    count: int = 1


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A complete tag a restore did not take because it was damaged (it took an older one)."""
    tag: str
    error: str


def _object(cls: type, name: str | None = None):
    return _wire(check=lambda value: _checked_object(cls, value), name=name)


def _store_error(value) -> tuple[object, str]:
    ok = isinstance(value, str) and len(value) <= 2 * ERROR_CHARS
    return (value, "") if ok else (None, f"must be a string of at most {2 * ERROR_CHARS} characters")


def _choice(options: tuple[str, ...]):
    def check(value) -> tuple[object, str]:
        ok = isinstance(value, str) and value in options
        return (value, "") if ok else (None, f"must be one of {', '.join(options)}, got {str(value)[:40]!r}")
    return _wire(check=check)


@dataclass(frozen=True)
class StoreReport:
    """What a pod says of its checkpoint store in its progress report."""
    checkpoint: CheckpointSeen | None = _object(CheckpointSeen)
    """The newest complete tag ``{tag, step, time}`` (``time``: when its ``done`` was written)."""
    error: str | None = _wire(check=_store_error, name="storeError")
    """Why the pod could not list its store (None when it could)."""
    save_failure: SaveFailure | None = _object(SaveFailure)
    """The newest failed save ``{tag, error, count}`` (count: failed saves since the last one
    that completed; None once one completes)."""
    skipped: SkippedCheckpoint | None = _object(SkippedCheckpoint, name="skippedCheckpoint")
    """A complete tag this attempt did not resume from because it was damaged ``{tag, error}``
    (it took the previous one)."""

    def fields(self) -> dict:
        """The wire fields (:data:`STORE_FIELDS`), errors cut to ERROR_CHARS."""
        def obj(value):
            if not dataclasses.is_dataclass(value):
                return _cut(value)  # storeError
            out = asdict(value)
            if "error" in out:
                out["error"] = _cut(out["error"])
            return out
        return {wire: obj(getattr(self, name)) for name, wire, _ in _STORE_SCHEMA}


@dataclass(frozen=True, kw_only=True)
class ProgressReport:
    """One progress report of a pod (the annotation ``trainium.dev/progress``). Built by the
    writer with keywords; read back by :meth:`parse`, where a field that did not fit its type
    and range is None."""
    step: int | None = _number(*_STEP)
    """The newest step trained; None: no step yet, a report of the store alone."""
    time: float | None = _number(float, 0.0, 1e11, digits=3)
    """When that step ended (epoch seconds)."""
    tokens_per_second: float | None = _number(float, 0.0, 1e15, digits=2)
    """None where the writer cannot know it (a script whose log has no throughput): the operator
    then leaves it out of the status."""
    loss: float | None = _number(float, -1e9, 1e9, digits=5)
    """Likewise."""
    last_checkpoint_step: int | None = _number(*_STEP)
    last_checkpoint_time: float | None = _number(float, 0.0, 1e11, digits=3)
    """When the step of ``last_checkpoint_step`` ended (epoch seconds), None where the writer does
    not know (a checkpoint an earlier process wrote): the operator counts the steps trained
    after it, lost to a failure, by their own time rather than by the run's step time."""
    start_step: int | None = _number(*_STEP, default=0)
    """The step this process resumed at, 0 on a fresh start."""
    eval_perplexity: float | None = _number(float, 0.0, 1e30, digits=4)
    """The newest held-out perplexity, None without data.heldOut."""
    compute_seconds: float | None = _number(float, 0.0, 1e6, digits=4)
    """This pod's smoothed time per step before the step's first collective, what straggler
    detection compares across pods, None where unmeasured."""
    preflight_seconds: float | None = _number(float, 0.0, 1e6, digits=2)
    """What this attempt's pre-flight check took, None without one."""
    restore_seconds: float | None = _number(float, 0.0, 1e6, digits=2)
    """What reading and loading the checkpoint it resumed from took, None on a fresh start."""
    restore_source: str | None = _choice(RESTORE_SOURCES)
    """Where that restore read the model and optimizer state from, the gang's slowest rank's
    (one of checkpoints.RESTORE_SOURCES: memory, peer, store), None on a fresh start."""
    attempt: int | None = _number(int, 1, 2 ** 31)
    """The attempt whose workers wrote it (their ATTEMPT), None from writers that do not know
    it: after an in-place restart the pod still carries the last attempt's report until the new
    workers write theirs, and the operator must not read it as the new attempt's progress."""
    first_step_time: float | None = _number(float, 0.0, 1e11, digits=3)
    """When this process's first step ended, None from writers that do not know it: the operator
    dates the attempt's training start from it, exactly, where otherwise it has to reckon back
    from a later report by the run's step time."""
    store: StoreReport = StoreReport()
    """The pod's view of its checkpoint store (wire fields :data:`STORE_FIELDS`)."""

    def to_annotation(self) -> str:
        """The annotation's JSON: every field of :data:`FIELDS`, numbers rounded (None for
        unknown or non-finite ones: JSON has no NaN), errors cut to ERROR_CHARS."""
        body = {wire: _rounded(getattr(self, name), spec.get("digits")) for name, wire, spec in _SCHEMA}
        return json.dumps({**body, **self.store.fields()},
                          separators=(",", ":"), ensure_ascii=False)  # a tag's letters stay one character

    @classmethod
    def parse(cls, text: str | None) -> tuple[ProgressReport | None, list[str]]:
        """Every field checked (a bad one is None and named in the errors, ``"<wireName>:
        why"``), whether or not the report has a step: a pod that cannot list its store says
        so before its first step. None when absent or not a JSON object. Never raises."""
        if not text:
            return None, []
        if len(text) > MAX_LENGTH:
            return None, [f"longer than {MAX_LENGTH} characters"]
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            return None, ["not JSON"]
        if not isinstance(data, dict):
            return None, ["not a JSON object"]
        errors: list[str] = []

        def checked(schema) -> dict:
            out = {}
            for name, wire, spec in schema:
                value = data.get(wire)
                if value is None:
                    out[name] = None
                    continue
                out[name], why = spec["check"](value)
                if why:
                    errors.append(f"{wire}: {why}")
            return out
        fields = checked(_SCHEMA)
        report = cls(**fields, store=StoreReport(**checked(_STORE_SCHEMA)))
        if data.get("step") is None and report.store == StoreReport():
            errors.insert(0, "step: missing")  # neither progress nor a word on the store
        return report, errors

    def store_said(self) -> StoreReport | None:
        """What it says of the pod's checkpoint store, None when nothing."""
        return None if self.store == StoreReport() else self.store


def _schema(cls: type) -> tuple[tuple[str, str, dict], ...]:
    """(attribute, wire name, metadata) of each wire field of ``cls``."""
    return tuple((f.name, f.metadata.get("wire") or _camel(f.name), f.metadata)
                 for f in dataclasses.fields(cls) if "check" in f.metadata)


_SCHEMA = _schema(ProgressReport)
_STORE_SCHEMA = _schema(StoreReport)
STORE_FIELDS = tuple(wire for _, wire, _ in _STORE_SCHEMA)  # the store's part of a report
FIELDS = tuple(wire for _, wire, _ in _SCHEMA) + STORE_FIELDS  # every wire field, in the order written


def parse(text: str | None) -> ProgressReport | None:
    """The operator's side: the report, or None when absent, malformed or without a step."""
    report, _ = ProgressReport.parse(text)
    return report if report is not None and report.step is not None else None


def _cut(text: str | None) -> str | None:
    """One line of at most ERROR_CHARS characters as JSON writes it (an escaped character takes
    up to 6: the report must stay under MAX_LENGTH whatever the error holds)."""
    if text is None:
        return None
    text = " ".join(str(text).split())  # one line
    if len(json.dumps(text, ensure_ascii=False)) - 2 <= ERROR_CHARS:
        return text
    kept, room = [], ERROR_CHARS - 3
    for char in text:
        room -= len(json.dumps(char, ensure_ascii=False)) - 2
        if room < 0:
            break
        kept.append(char)
    return "".join(kept) + "..."


def _rounded(value, digits: int | None):
    """``value`` as written: a number rounded to ``digits`` (None for unknown or non-finite
    ones: JSON has no NaN); without ``digits``, as it is."""
    if digits is None:
        return value
    return None if value is None or not math.isfinite(value) else round(value, digits)


def _checked_object(cls: type, value) -> tuple[object, str]:
    """One of the store's objects, every subfield checked; a bad one drops the whole object."""
    if not isinstance(value, dict):
        return None, f"must be an object, got {str(value)[:40]!r}"
    out = {}
    for name in cls.__dataclass_fields__:
        kind, low, high, required = _SUBFIELDS[name]
        item = value.get(name)
        if item is None:
            if required:
                return None, f"{name}: missing"
            out[name] = None
            continue
        if kind is str:
            if not isinstance(item, str) or not (low <= len(item) <= high):
                return None, f"{name}: must be a string of {low} to {high} characters"
            if name == "tag" and (not _TAG.fullmatch(item) or item in (".", "..")):
                return None, f"{name}: {item[:40]!r} is not one name (no '/', '\\' or control characters)"
            out[name] = item
            continue
        checked, why = _checked_number(item, kind, low, high)
        if why:
            return None, f"{name}: {why}"
        out[name] = checked
    return cls(**out), ""


def _checked_number(value, kind: type, low: float, high: float) -> tuple[int | float | None, str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        return None, f"must be {'an integer' if kind is int else 'a number'}, got {str(value)[:40]!r}"
    if not (low <= value <= high):  # NaN fails this too
        return None, f"{value!r} is out of range [{low:g}, {high:g}]"
    return kind(value), ""
