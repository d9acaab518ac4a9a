"""The progress annotation's schema (docs/architecture.md 3.2): how the operator learns step, speed and hangs.

Local rank 0 of every pod (or trainer.watch for a command trainer) writes its own pod's annotation
``trainium.dev/progress``: one JSON object with the fields of :data:`FIELDS` (``time``: when that
step ended; ``startStep``: the step this process resumed at, 0 on a fresh start;
``evalPerplexity``: the newest held-out perplexity, null without data.heldOut;
``computeSeconds``: this pod's smoothed time per step before the step's first collective, what
straggler detection compares across pods, null where unmeasured; ``preflightSeconds``: what
this attempt's pre-flight check took, null without one; ``restoreSeconds``: what reading and
loading the checkpoint it resumed from took, null on a fresh start; ``restoreSource``: where
that restore read the model and optimizer state from, the gang's slowest rank's (one of
checkpoints.RESTORE_SOURCES: memory, peer, store), null on a fresh start; ``attempt``: the attempt
whose workers wrote it (their ATTEMPT), null from writers that do not know it: after an
in-place restart the pod still carries the last attempt's report until the new workers write
theirs, and the operator must not read it as the new attempt's progress; ``firstStepTime``: when
this process's first step ended, null from writers that do not know it: the operator dates the
attempt's training start from it, exactly, where otherwise it has to reckon back from a later
report by the run's step time). The pod's view of its checkpoint store, which the operator
cannot read itself (it runs in its own pod, without the trainer pods' volumes or credentials):
``checkpoint``: the newest complete tag ``{tag, step, time}`` (``time``: when its ``done`` was
written), ``storeError``: why the pod could not list its store (null when it could),
``saveFailure``: the newest failed save ``{tag, error, count}`` (count: failed saves since the
last one that completed; null once one completes), ``skippedCheckpoint``: a complete tag this
attempt did not resume from because it was damaged ``{tag, error}`` (it took the previous one).
:func:`payload`
encodes it, :func:`parse_report` reads it back with every field checked. The writer (a
background thread that patches the pod) is trainer.progress; the operator and tools need only
this module.
"""

from __future__ import annotations

import json
import math
import re
import time

from dataclasses import asdict, dataclass

from .checkpoints import RESTORE_SOURCES

FIELDS = ("step", "time", "tokensPerSecond", "loss", "lastCheckpointStep", "startStep", "evalPerplexity",
          "computeSeconds", "preflightSeconds", "restoreSeconds", "restoreSource", "attempt", "firstStepTime",
          "checkpoint", "storeError", "saveFailure", "skippedCheckpoint")
STORE_FIELDS = ("checkpoint", "storeError", "saveFailure", "skippedCheckpoint")  # read by store_report
ERROR_CHARS = 300  # an error carried in a report is cut to this many characters by the writer


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


@dataclass(frozen=True)
class StoreReport:
    """What a pod says of its checkpoint store in its progress report."""
    checkpoint: CheckpointSeen | None = None
    error: str | None = None
    save_failure: SaveFailure | None = None
    skipped: SkippedCheckpoint | None = None

    def fields(self) -> dict:
        def obj(value) -> dict | None:
            if value is None:
                return None
            out = asdict(value)
            if "error" in out:
                out["error"] = _cut(out["error"])
            return out
        return {"checkpoint": obj(self.checkpoint), "storeError": _cut(self.error),
                "saveFailure": obj(self.save_failure), "skippedCheckpoint": obj(self.skipped)}


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


def _rounded(value: float | None, digits: int) -> float | None:
    """None for unknown or non-finite values (JSON has no NaN)."""
    return None if value is None or not math.isfinite(value) else round(value, digits)


def payload(step: int | None, tokens_per_second: float | None, loss: float | None, last_checkpoint_step: int | None,
            now: float | None = None, start_step: int = 0, eval_perplexity: float | None = None,
            compute_seconds: float | None = None, preflight_seconds: float | None = None,
            restore_seconds: float | None = None, attempt: int | None = None,
            restore_source: str | None = None, first_step_time: float | None = None,
            store: StoreReport | None = None) -> str:
    """``tokens_per_second`` and ``loss`` may be None where the writer cannot know them (a
    script whose log has no throughput); the operator then leaves them out of the status.
    ``step`` None: no step trained yet, a report of the store alone (``store``)."""
    return json.dumps({"step": step, "time": round(now if now is not None else time.time(), 3),
                       "tokensPerSecond": _rounded(tokens_per_second, 2), "loss": _rounded(loss, 5),
                       "lastCheckpointStep": last_checkpoint_step, "startStep": start_step,
                       "evalPerplexity": _rounded(eval_perplexity, 4),
                       "computeSeconds": _rounded(compute_seconds, 4),
                       "preflightSeconds": _rounded(preflight_seconds, 2),
                       "restoreSeconds": _rounded(restore_seconds, 2), "restoreSource": restore_source,
                       "attempt": attempt, "firstStepTime": _rounded(first_step_time, 3),
                       **(store or StoreReport()).fields()},
                      separators=(",", ":"), ensure_ascii=False)  # a tag's letters stay one character


# What each field may hold. The annotation is written by user code (a command trainer's log
# is parsed by trainer.watch, and anything in the pod can patch it), so the operator checks every
# field for type and range and drops one that does not fit rather than compute with it.
_STEP = (int, 0, 2 ** 53)
_LIMITS: dict[str, tuple[type, float, float]] = {
    "step": _STEP, "time": (float, 0.0, 1e11), "firstStepTime": (float, 0.0, 1e11), "tokensPerSecond": (float, 0.0, 1e15),
    "loss": (float, -1e9, 1e9), "lastCheckpointStep": _STEP, "startStep": _STEP, "evalPerplexity": (float, 0.0, 1e30),
    "computeSeconds": (float, 0.0, 1e6), "preflightSeconds": (float, 0.0, 1e6), "restoreSeconds": (float, 0.0, 1e6),
    "attempt": (int, 1, 2 ** 31)}
_CHOICES: dict[str, tuple[str, ...]] = {"restoreSource": RESTORE_SOURCES}
MAX_LENGTH = 4096  # a report is about 150-1,000 bytes; a larger annotation is not parsed at all
# A tag is one name in the store: no separator, no control character, so the operator can show it
# and join it to spec.checkpoint.uri without a pod pointing it anywhere else.
_TAG = re.compile(r"[^/\\\x00-\x1f\x7f]{1,200}")
_OBJECTS: dict[str, type] = {"checkpoint": CheckpointSeen, "saveFailure": SaveFailure,
                             "skippedCheckpoint": SkippedCheckpoint}
_SUBFIELDS: dict[str, tuple] = {  # field -> (type, low, high, required)
    "tag": (str, 1, 200, True), "step": (int, 0, 2 ** 53, False), "time": (float, 0.0, 1e11, False),
    "error": (str, 0, 2 * ERROR_CHARS, True), "count": (int, 1, 2 ** 31, True)}


def parse(text: str | None) -> dict | None:
    """The operator's side: a progress dict, or None when absent or malformed."""
    return parse_report(text)[0]


def parse_report(text: str | None) -> tuple[dict | None, list[str]]:
    """The progress dict (every field of FIELDS; one that does not fit its type and range is
    None) and what was wrong, field by field. No report (None) without a valid ``step``. Never
    raises."""
    fields, errors = parse_fields(text)
    return (fields if fields is not None and fields["step"] is not None else None), errors


def parse_fields(text: str | None) -> tuple[dict | None, list[str]]:
    """Every field of FIELDS, checked (a bad one is None and named in the errors), whether or not
    the report has a step: a pod that cannot list its store says so before its first step. None
    when absent or not a JSON object. Never raises."""
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
    out, errors = {}, []
    for key in FIELDS:
        value, why = _checked(key, data.get(key))
        out[key] = value
        if why:
            errors.append(f"{key}: {why}")
    if data.get("step") is None and store_report(out) is None:
        errors.insert(0, "step: missing")  # neither progress nor a word on the store
    return out, errors


def store_report(fields: dict | None) -> StoreReport | None:
    """What a report (parse_fields) says of the pod's checkpoint store, None when nothing."""
    if not fields:
        return None
    report = StoreReport(fields.get("checkpoint"), fields.get("storeError"), fields.get("saveFailure"),
                         fields.get("skippedCheckpoint"))
    return None if report == StoreReport() else report


def _checked(key: str, value) -> tuple[object, str]:
    if value is None:
        return None, ""
    if key in _OBJECTS:
        return _checked_object(_OBJECTS[key], value)
    if key == "storeError":
        ok = isinstance(value, str) and len(value) <= 2 * ERROR_CHARS
        return (value, "") if ok else (None, f"must be a string of at most {2 * ERROR_CHARS} characters")
    if key in _CHOICES:
        ok = isinstance(value, str) and value in _CHOICES[key]
        return (value, "") if ok else (None, f"must be one of {', '.join(_CHOICES[key])}, got {str(value)[:40]!r}")
    return _checked_number(value, *_LIMITS[key])


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
