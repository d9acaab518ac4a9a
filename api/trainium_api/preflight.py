"""The pre-flight check's verdict on a node, as the failing pod's termination message says it
(trainer.pod.preflight writes it, the operator reads it: docs/architecture.md 4). The message is
written by code in the run's pod: parsed strictly, bounded, and only ever about that pod's node.
"""

from __future__ import annotations

from . import keys

MESSAGE_PREFIX = "preflight-failed:"
REASON_LIMIT = 300

# While a pod's launcher runs the check it sets keys.PREFLIGHT on its own pod to RUNNING, and
# to DONE when the check has passed (trainer.pod.launch); the operator shows the run's Preflight
# phase from it. Anything else a pod writes there is ignored.
RUNNING, DONE = "running", "done"


def is_running(annotations: dict | None) -> bool:
    """Whether a pod says its pre-flight check is under way."""
    return isinstance(annotations, dict) and annotations.get(keys.PREFLIGHT) == RUNNING


def format_message(reason: str) -> str:
    return f"{MESSAGE_PREFIX} {_clean(reason)}\n"


def parse_message(text: str | None) -> str | None:
    """Why this pod's node failed the check, or None when the message is not such a verdict."""
    if not text or not isinstance(text, str) or not text.startswith(MESSAGE_PREFIX):
        return None
    reason = _clean(text[len(MESSAGE_PREFIX):].splitlines()[0] if text[len(MESSAGE_PREFIX):].strip() else "")
    return reason or "no reason given"


def _clean(text: str) -> str:
    return "".join(c if c.isprintable() else " " for c in text).strip()[:REASON_LIMIT]
