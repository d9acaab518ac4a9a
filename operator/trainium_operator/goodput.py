"""A run's timeline -> productive and lost seconds by phase. Pure.

Per failure (times in epoch seconds, recorded in status.failures):
  detect     last progress before the failure -> detection
  teardown   detection -> every pod of the attempt gone
  schedule   teardown done -> the new attempt's first progress (``resumedTime``: scheduling,
             process start, checkpoint load, compile); a failure that never resumed is closed by
             the next failure
  recompute  steps trained after the last complete checkpoint, lost and trained again
               (step at failure - checkpoint step) x step time
The initial start (creation -> first progress) counts as schedule time too. Progress times are
the trainer's own step end times (the progress annotation's ``time``); an attempt's first step
is counted as training (its start is estimated as its end minus the observed step time), the
rest of the wait as schedule. Productive time is wall
time minus all of it; the effective training ratio is productive / wall. A finished run's wall
ends at its last step, so writing the final checkpoint and exiting is not counted as training.
"""

from __future__ import annotations

PHASES = ("detect", "teardown", "schedule", "recompute")


def account(created: float, first_progress: float | None, failures: list[dict], now: float,
            step_seconds: float | None = None) -> dict:
    lost = dict.fromkeys(PHASES, 0.0)
    first_step = step_seconds or 0.0  # an attempt's first step is training, not waiting
    lost["schedule"] += max(0.0, (first_progress - first_step if first_progress else now) - created)
    previous_end = first_progress or created  # nothing before this is the next failure's to lose
    for i, f in enumerate(failures):
        detected = f.get("time", now)
        nxt = failures[i + 1]["time"] if i + 1 < len(failures) else None
        last_progress = max(f.get("lastProgressTime") or previous_end, previous_end)
        lost["detect"] += max(0.0, detected - last_progress)
        torn_down = f.get("teardownDoneTime") or nxt or now
        lost["teardown"] += max(0.0, torn_down - detected)
        resumed = f.get("resumedTime") or nxt or now
        if f.get("teardownDoneTime"):
            started = resumed - first_step if f.get("resumedTime") else resumed
            lost["schedule"] += max(0.0, started - f["teardownDoneTime"])
        previous_end = max(resumed, torn_down)
        step, ckpt, step_s = f.get("step"), f.get("checkpointStep"), f.get("stepSeconds")
        if step is not None and step_s:
            lost["recompute"] += max(0, step - (ckpt or 0)) * step_s
    wall = max(0.0, now - created)
    total_lost = min(wall, sum(lost.values()))
    productive = wall - total_lost
    return {"wallSeconds": round(wall, 1), "productiveSeconds": round(productive, 1),
            "lostSeconds": {k: round(v, 1) for k, v in lost.items()},
            "effectiveRatio": round(productive / wall, 4) if wall > 0 else None}
