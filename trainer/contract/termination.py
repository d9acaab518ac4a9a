"""The container's termination message (its terminationMessagePath, which the operator names in
TRAINER_TERMINATION_LOG): the pod's last word to the operator, read with its exit code. Written
by whoever ends the pod for a reason the operator acts on: the launcher (a runtime fault, a hung
pre-flight rank), the pre-flight check, the agent (its workers' message), a store read that gave
up (trainium_api.runtimefaults, preflight, storefaults format the texts)."""

from __future__ import annotations

from typing import Callable


def write(path: str | None, text: str, warn: Callable[[str], None]) -> None:
    """Write ``text`` at ``path`` (no path: not in a pod, nothing to do). A failed write is said
    through ``warn``, never raised: the exit code still tells the operator what ended the pod."""
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        warn(f"could not write the termination message to {path}: {exc}")
