"""A run's timeline -> productive and lost seconds by phase. Pure.

Times are epoch seconds; progress times are the trainer's own step end times (the progress
annotation's ``time``). For each failure (status.failures) the time between the failed
attempt's last step (``lastProgressTime``, kept current while a gracefully stopped gang finishes
its step) and the start of the new attempt's training is lost, split at detection and at the
end of teardown:
  detect     last step of the failed attempt -> detection
  teardown   detection -> every pod of the attempt gone
  schedule   teardown done -> the new attempt trains again (scheduling, process start,
             checkpoint load, compile). The new attempt's first report (``resumedTime``) came
             ``resumedSteps`` steps after it resumed; its training began that many step times
             earlier. A failure that never resumed is closed by the next failure.
  preflight  the attempts' pre-flight checks (status.preflightSeconds: a passing attempt's first
             report says how long; a failed check, its gang running -> detection), taken out of
             schedule
  restore    the attempts' checkpoint restores (status.restoreSeconds: each attempt's first
             report says how long its slowest pod took to read and load its checkpoint), taken
             out of schedule
  recompute  steps trained after the checkpoint the new attempt resumed from (``resumedStep``;
             before it resumed, the newest complete checkpoint), lost and trained again:
             (failed attempt's last step - resumed step) x step time. When that checkpoint is
             past the last reported step (reports are rate-limited), the attempt's last step
             is taken to be at least the checkpoint's, (resumed - reported) step times later.
Each failure's detect, teardown, schedule and recompute seconds are also added up by how it
was restarted (``byRestart``: inPlace, replace, recreate; failures[].restart), so the cost of
each kind of restart shows on its own.
The initial start (creation -> training) counts as schedule time, and so does each restart
after a resume (spec.suspend cleared -> training again), with the steps it trains again
counted as recompute; the time suspended counts as neither
productive nor lost: it leaves the wall time. Productive time is wall time
minus all of it; the effective training ratio is productive / wall. A finished run's wall ends
at its last step, so writing the final checkpoint and exiting is not counted as training.
"""

from __future__ import annotations

import dataclasses

from trainium_api.fields import snake
from trainium_api.status import RESTART_KINDS, FailureRecord, Goodput, GoodputArchive, LostSeconds, RestartLosses, Suspension

PHASES = tuple(f.name for f in dataclasses.fields(LostSeconds))
RESTART_FIELDS = {kind: snake(kind) for kind in RESTART_KINDS}  # failures[].restart -> its RestartLosses field


def _add(total: LostSeconds, part: LostSeconds) -> None:
    for p in PHASES:
        setattr(total, p, getattr(total, p) + getattr(part, p))


def _rounded(lost: LostSeconds) -> LostSeconds:
    return LostSeconds(**{p: round(getattr(lost, p), 1) for p in PHASES})


def _start(created: float, first_progress: float | None, now: float, step_s: float,
           first_progress_steps: int | None) -> tuple[LostSeconds, float]:
    """Lost seconds before the first training step, and where the failures' timeline begins."""
    began = first_progress - (first_progress_steps or 0) * step_s if first_progress else now
    return LostSeconds(schedule=max(0.0, began - created)), began if first_progress else created


def _walk(total: LostSeconds, previous_end: float, failures: list[FailureRecord], after: float | None, now: float,
          step_s: float, by_restart: RestartLosses | None = None) -> float:
    """Add each failure's lost seconds to ``total``, and to its restart kind's in
    ``by_restart``; ``after``: when the failure following the last one was detected (None:
    none yet). Returns where the timeline ends."""
    for i, f in enumerate(failures):
        lost = LostSeconds()
        began = previous_end  # the failed attempt's training start
        detected = f.time
        nxt = failures[i + 1].time if i + 1 < len(failures) else after
        last_step = max(f.last_progress_time or previous_end, previous_end)
        step = f.step
        base = f.resumed_step if f.resumed_step is not None else f.checkpoint_step
        if step is not None and base is not None and base > step and step_s:
            # the attempt wrote a complete checkpoint past its last report, so it trained at
            # least that far: those steps survive and are not lost (progress reports are
            # rate-limited; the newest one can be behind the checkpoint)
            last_step = min(detected, last_step + (base - step) * step_s)
        lost.detect += max(0.0, detected - last_step)
        torn_down = f.teardown_done_time or nxt or now
        lost.teardown += max(0.0, torn_down - max(detected, last_step))
        if f.resumed_time:
            resumed = f.resumed_time - (f.resumed_steps or 0) * step_s
        else:
            resumed = nxt or now
        if f.teardown_done_time:
            lost.schedule += max(0.0, resumed - max(f.teardown_done_time, last_step))
        previous_end = max(resumed, torn_down)
        if f.checkpoint_time and base is not None and base == f.checkpoint_step and f.last_progress_time and \
                began - step_s <= f.checkpoint_time <= f.last_progress_time:
            # the trainer said when the checkpointed step ended: the steps since, by their own
            # time (step times drift; the run's smoothed one is off by seconds on a busy host).
            # A time outside the attempt (a clock far off, user code) is not used.
            lost.recompute += max(0.0, f.last_progress_time - max(f.checkpoint_time, began))
        elif step is not None and step_s:
            lost.recompute += max(0, step - (base or 0)) * step_s
        _add(total, lost)
        if by_restart is not None and f.restart in RESTART_FIELDS:
            _add(getattr(by_restart, RESTART_FIELDS[f.restart]), lost)
    return previous_end


def archive(previous: GoodputArchive | None, created: float, first_progress: float | None,
            dropped: list[FailureRecord], next_detected: float, now: float, step_seconds: float | None = None,
            first_progress_steps: int | None = None) -> GoodputArchive:
    """Fold failures that leave the kept timeline (status keeps the last few) into running
    totals, so the lost time of a dropped failure never turns into productive time. The result
    (status.goodputArchive) is what :func:`account` starts from."""
    step_s = step_seconds or 0.0
    if previous:
        lost, until = dataclasses.replace(previous.lost_seconds), previous.until
    else:
        lost, until = _start(created, first_progress, now, step_s, first_progress_steps)
    by_restart = _copy(previous.by_restart if previous else RestartLosses())
    until = _walk(lost, until, dropped, next_detected, now, step_s, by_restart)
    return GoodputArchive(lost_seconds=lost, until=until, failures=(previous.failures if previous else 0) + len(dropped),
                          by_restart=by_restart)


def _copy(losses: RestartLosses) -> RestartLosses:
    return RestartLosses(**{k: dataclasses.replace(getattr(losses, k)) for k in RESTART_FIELDS.values()})


def account(created: float, first_progress: float | None, failures: list[FailureRecord], now: float,
            step_seconds: float | None = None, first_progress_steps: int | None = None,
            archived: GoodputArchive | None = None, suspension: Suspension | None = None,
            preflight_seconds: float = 0.0, restore_seconds: float = 0.0) -> Goodput:
    """Goodput from the run's start: the archived totals (failures no longer kept) plus the
    kept timeline. Time suspended is left out of the wall time (neither productive nor lost);
    restarting after a resume is lost as schedule time. ``preflight_seconds``: what the
    attempts' pre-flight checks took (status.preflightSeconds), inside their schedule time,
    counted as its own phase; ``restore_seconds`` likewise for their checkpoint restores
    (status.restoreSeconds)."""
    step_s = step_seconds or 0.0
    if archived:
        lost, previous_end = dataclasses.replace(archived.lost_seconds), archived.until
    else:
        lost, previous_end = _start(created, first_progress, now, step_s, first_progress_steps)
    by_restart = _copy(archived.by_restart if archived else RestartLosses())
    _walk(lost, previous_end, failures, None, now, step_s, by_restart)
    paused = 0.0
    if suspension is not None:
        paused = suspension.seconds + (max(0.0, now - suspension.since) if suspension.since is not None else 0.0)
        lost.recompute += suspension.recompute_seconds
        lost.schedule += suspension.restart_seconds + (
            max(0.0, now - suspension.resumed_time) if suspension.resumed_time is not None else 0.0)
    for phase, seconds in (("preflight", preflight_seconds), ("restore", restore_seconds)):
        moved = min(lost.schedule, max(0.0, seconds))
        lost.schedule -= moved
        setattr(lost, phase, getattr(lost, phase) + moved)
    wall = max(0.0, now - created - paused)
    total_lost = min(wall, sum(getattr(lost, p) for p in PHASES))
    productive = wall - total_lost
    return Goodput(wall_seconds=round(wall, 1), productive_seconds=round(productive, 1),
                   lost_seconds=_rounded(lost), effective_ratio=round(productive / wall, 4) if wall > 0 else None,
                   by_restart=RestartLosses(**{k: _rounded(getattr(by_restart, k)) for k in RESTART_FIELDS.values()}))
