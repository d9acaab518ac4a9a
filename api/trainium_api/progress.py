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
report by the run's step time). :func:`payload`
encodes it, :func:`parse_report` reads it back with every field checked. The writer (a
background thread that patches the pod) is trainer.progress; the operator and tools need only
this module.
"""

from __future__ import annotations

import json
import math
import time

from .checkpoints import RESTORE_SOURCES

ANNOTATION = "trainium.dev/progress"
FIELDS = ("step", "time", "tokensPerSecond", "loss", "lastCheckpointStep", "startStep", "evalPerplexity",
          "computeSeconds", "preflightSeconds", "restoreSeconds", "restoreSource", "attempt", "firstStepTime")


def _rounded(value: float | None, digits: int) -> float | None:
    """None for unknown or non-finite values (JSON has no NaN)."""
    return None if value is None or not math.isfinite(value) else round(value, digits)


def payload(step: int, tokens_per_second: float | None, loss: float | None, last_checkpoint_step: int | None,
            now: float | None = None, start_step: int = 0, eval_perplexity: float | None = None,
            compute_seconds: float | None = None, preflight_seconds: float | None = None,
            restore_seconds: float | None = None, attempt: int | None = None,
            restore_source: str | None = None, first_step_time: float | None = None) -> str:
    """``tokens_per_second`` and ``loss`` may be None where the writer cannot know them (a
    script whose log has no throughput); the operator then leaves them out of the status."""
    return json.dumps({"step": step, "time": round(now if now is not None else time.time(), 3),
                       "tokensPerSecond": _rounded(tokens_per_second, 2), "loss": _rounded(loss, 5),
                       "lastCheckpointStep": last_checkpoint_step, "startStep": start_step,
                       "evalPerplexity": _rounded(eval_perplexity, 4),
                       "computeSeconds": _rounded(compute_seconds, 4),
                       "preflightSeconds": _rounded(preflight_seconds, 2),
                       "restoreSeconds": _rounded(restore_seconds, 2), "restoreSource": restore_source,
                       "attempt": attempt, "firstStepTime": _rounded(first_step_time, 3)},
                      separators=(",", ":"))


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
MAX_LENGTH = 4096  # a report is about 150 bytes; a larger annotation is not parsed at all


def parse(text: str | None) -> dict | None:
    """The operator's side: a progress dict, or None when absent or malformed."""
    return parse_report(text)[0]


def parse_report(text: str | None) -> tuple[dict | None, list[str]]:
    """The progress dict (every field of FIELDS; one that does not fit its type and range is
    None) and what was wrong, field by field. No report (None) without a valid ``step``. Never
    raises."""
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
    return (out if out["step"] is not None else None), errors


def _checked(key: str, value) -> tuple[int | float | str | None, str]:
    if value is None:
        return None, "missing" if key == "step" else ""
    if key in _CHOICES:
        ok = isinstance(value, str) and value in _CHOICES[key]
        return (value, "") if ok else (None, f"must be one of {', '.join(_CHOICES[key])}, got {str(value)[:40]!r}")
    kind, low, high = _LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        return None, f"must be {'an integer' if kind is int else 'a number'}, got {str(value)[:40]!r}"
    if not (low <= value <= high):  # NaN fails this too
        return None, f"{value!r} is out of range [{low:g}, {high:g}]"
    return kind(value), ""
