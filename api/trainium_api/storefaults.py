"""A store that stayed unavailable past a pod's retries, as its termination message says it
(trainer.store.errors writes it when it gives up, exit 75; the operator reads it: judge, cause
``store``). Its own cause, with its own restart budget, and not one of the job's: a store outage
is no sign that the job makes no progress, so it never counts toward the no-progress guard. The
message is written by code in the run's pod: parsed strictly and bounded, like the pre-flight
check's verdict (trainium_api.preflight).
"""

from __future__ import annotations

MESSAGE_PREFIX = "store-unavailable:"
REASON_LIMIT = 300


def format_message(reason: str) -> str:
    return f"{MESSAGE_PREFIX} {_clean(reason)}\n"


def parse_message(text: str | None) -> str | None:
    """What stayed unavailable, or None when the message is not such a word."""
    if not text or not isinstance(text, str) or not text.startswith(MESSAGE_PREFIX):
        return None
    rest = text[len(MESSAGE_PREFIX):]
    return _clean(rest.splitlines()[0] if rest.strip() else "") or "no reason given"


def _clean(text: str) -> str:
    return "".join(c if c.isprintable() else " " for c in text).strip()[:REASON_LIMIT]
