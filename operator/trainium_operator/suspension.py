"""Suspension: spec.suspend, or Kueue's queue, stops the gang; the end of it starts a new attempt. Pure.

The gang is stopped gracefully (the trainer saves on SIGTERM) and the time suspended leaves
goodput's wall time (status.suspension); a failure whose restart the suspension interrupts ends
there. Resumed, the run starts a new attempt (not a failure) once the suspended gang is gone,
from the newest checkpoint; the restart after a resume is counted as schedule time, and the
steps it trains again as recompute (progress_tracking.gang_running).
"""

from __future__ import annotations

from dataclasses import replace

from trainium_api.status import HELD, Suspension

from . import queueing
from .observe import gang_state
from .progress_tracking import account, track_progress
from .reasons import Reason
from .restarts import create, start_attempt
from .run_pass import Pass, stop


def suspend(p: Pass) -> None:
    """Stop the gang gracefully (the trainer saves on SIGTERM); the time suspended leaves
    goodput's wall time. A failure whose restart the suspension interrupts ends here. Held by
    the user (spec.suspend) the run is Suspended; by Kueue (queueing.holds) it is Queued."""
    stop(p, p.current + p.replacement, suspended_since(p))
    if p.current:  # the stopping gang finishes its step (and a checkpoint) before it exits
        track_progress(p, gang_state(p.current))
    phase = "Queued" if not p.spec.suspend and queueing.holds(p) else "Suspended"
    if p.old.phase != phase:
        p.new.phase = phase
        if phase == "Suspended":
            p.event(Reason.SUSPENDED, "spec.suspend is true: the gang was stopped; it resumes from the newest checkpoint")
    if p.old.phase not in HELD:
        if p.old.attempt:  # a run created suspended has no clock running yet
            was = p.old.suspension or Suspension()
            p.new.suspension = replace(was, since=p.now, resumed_time=None, restart_seconds=was.restart_seconds + (
                p.now - was.resumed_time if was.resumed_time is not None else 0.0))
            last = p.last_failure
            if last is not None and not last.resumed_time:
                last.teardown_done_time = last.teardown_done_time or p.now
                last.resumed_time, last.resumed_steps = p.now, 0
    account(p, p.now)


def resume(p: Pass) -> None:
    """Resumed by the user: a new attempt (not a failure) once the suspended gang is gone; a
    run created suspended starts its first attempt."""
    if p.old.attempt == 0:
        create(p)
    elif p.current or p.replacement:
        # the suspended gang is still there (an operator stopped before its deletes landed, or
        # a pod on a lost node; a replacement a suspended replace left): finish stopping it first
        stop(p, p.current + p.replacement, suspended_since(p))
    elif not p.pods:
        was = p.old.suspension or Suspension()
        paused = p.now - was.since if was.since is not None else 0.0
        if p.new.first_progress_time is None and p.new.created_time is not None:
            # suspended before it ever trained: its clock starts later, and the start after the
            # resume is its first start (schedule time from the shifted creation)
            p.new.created_time += paused
            p.new.suspension = replace(was, since=None)
        else:
            p.new.suspension = replace(was, since=None, resumed_time=p.now, seconds=round(was.seconds + paused, 3),
                                       step=p.old.step)
        start_attempt(p, p.old.attempt + 1, Reason.RESUMED,
                      "admitted by Kueue" if p.old.phase == "Queued" else "spec.suspend cleared")


def suspended_since(p: Pass) -> float:
    """When the run's suspension began (now, in the pass that suspends it)."""
    was = p.old.suspension
    return was.since if p.old.phase in HELD and was and was.since is not None else p.now
