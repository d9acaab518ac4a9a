"""Failure + history -> action. Pure.

Actions: restart the gang (after a backoff), optionally quarantining the node that failed;
or fail the run with a reason. Never a loop: every restart spends a per-cause budget within a
time window, a bounded number of nodes can be quarantined, and K restarts in a row for causes
the job may be behind (application, hang) without the checkpoint step advancing end the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from .observe import Failure
from .spec import JOB_CAUSES, TrainingRunSpec


@dataclass
class Action:
    kind: str  # "restart" or "fail"
    reason: str
    quarantine_node: str = ""
    delay_seconds: float = 0.0


def decide(failure: Failure, spec: TrainingRunSpec, history: list[dict], quarantined: list[str],
           checkpoint_step: int | None, now: float) -> Action:
    """``history``: earlier failures of this run as recorded in status.failures (time, cause,
    checkpointStep); ``quarantined``: nodes already quarantined for this run."""
    ft = spec.fault_tolerance
    if failure.fatal:
        return Action("fail", f"fatal error, not retried: {failure.message}")
    window = ft.budget_window_minutes * 60
    recent = [h for h in history if now - h.get("time", 0) <= window]
    same_cause = [h for h in recent if h.get("cause") == failure.cause]
    budget = ft.restart_budget.for_cause(failure.cause)
    if len(same_cause) >= budget:
        return Action("fail", f"restart budget for {failure.cause} exhausted ({len(same_cause)} restarts in "
                      f"{ft.budget_window_minutes:g} min): {failure.message}")
    streak = 0
    for h in reversed(history):  # consecutive job-caused restarts without checkpoint progress
        if h.get("cause") not in JOB_CAUSES:
            continue  # an infrastructure failure says nothing about the job making progress
        if h.get("checkpointStep") == checkpoint_step:
            streak += 1
        else:
            break
    if failure.cause in JOB_CAUSES and streak >= ft.no_progress_restarts:
        return Action("fail", f"no progress: {streak} restarts without the checkpoint step advancing "
                      f"(last checkpoint {checkpoint_step}): {failure.message}")
    node = ""
    if ft.quarantine and failure.node and failure.cause in ("node", "neuron-device") and failure.node not in quarantined:
        if len(quarantined) + 1 > spec.quarantine_limit():
            return Action("fail", f"cluster unhealthy: quarantining {failure.node} would exceed "
                          f"{spec.quarantine_limit()} quarantined nodes ({', '.join(quarantined)})")
        node = failure.node
    delay = min(ft.max_backoff_seconds, ft.backoff_seconds * (2 ** len(recent))) if ft.backoff_seconds else 0.0
    return Action("restart", failure.message, quarantine_node=node, delay_seconds=delay)
