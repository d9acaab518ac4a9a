"""A run's timeline -> productive and lost seconds by phase. Pure.

Per failure (times in epoch seconds, recorded in status.failures):
  detect     last progress before the failure -> detection
  teardown   detection -> every pod of the attempt gone
  schedule   teardown done -> the new gang reports progress (scheduling, start, load, compile)
  recompute  steps trained after the last complete checkpoint, lost and trained again
               (step at failure - checkpoint step) x step time
The initial start (creation -> first progress) counts as schedule time too. Productive time is
wall time minus all of it; the effective training ratio is productive / wall.
"""

from __future__ import annotations

PHASES = ("detect", "teardown", "schedule", "recompute")


def account(created: float, first_progress: float | None, failures: list[dict], now: float) -> dict:
    lost = dict.fromkeys(PHASES, 0.0)
    lost["schedule"] += max(0.0, (first_progress or now) - created)
    for f in failures:
        detected = f.get("time", now)
        last_progress = f.get("lastProgressTime")
        if last_progress:
            lost["detect"] += max(0.0, detected - last_progress)
        torn_down = f.get("teardownDoneTime") or (now if not f.get("recoveredTime") else detected)
        lost["teardown"] += max(0.0, torn_down - detected)
        if f.get("teardownDoneTime"):
            lost["schedule"] += max(0.0, (f.get("recoveredTime") or now) - f["teardownDoneTime"])
        step, ckpt, step_s = f.get("step"), f.get("checkpointStep"), f.get("stepSeconds")
        if step is not None and step_s:
            lost["recompute"] += max(0, step - (ckpt or 0)) * step_s
    wall = max(0.0, now - created)
    total_lost = min(wall, sum(lost.values()))
    productive = wall - total_lost
    return {"wallSeconds": round(wall, 1), "productiveSeconds": round(productive, 1),
            "lostSeconds": {k: round(v, 1) for k, v in lost.items()},
            "effectiveRatio": round(productive / wall, 4) if wall > 0 else None}
