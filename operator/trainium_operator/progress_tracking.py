"""Progress tracking: what the gang's reports say, into the status. Pure.

Every pass of a training attempt: the step, tokens, loss and throughput; each attempt's restore
and pre-flight seconds (rising to the slowest pod's as reports arrive, the run's totals by the
difference); the step time (smoothed) and the hang clock (status.current.lastStep); when the
attempt trained first (goodput's anchors, first_seen); the nodes that passed the pre-flight
check; the straggler streaks; the conditions PodsStarted and ProgressValid; the gang's way
through Preflight to Running (and a restart's recovery and resume on its failure record); and
goodput (account).
"""

from __future__ import annotations

import copy
from dataclasses import replace

from trainium_api.status import CheckpointRef, FailureRecord, PreflightPass

from . import goodput, store, stragglers
from .effects import ObserveRecovery
from .observe import STARTING_REASONS, GangState, not_started, slowest_source, waiting_reason
from .reasons import Cond, CondReason, Reason, report, was
from .run_pass import Pass


def track_progress(p: Pass, gang: GangState) -> None:
    old, new, now = p.old, p.new, p.now
    if gang.step is None:
        return
    new.step = gang.step
    if p.spec.tokens_per_step:
        new.tokens = gang.step * p.spec.tokens_per_step
    if gang.loss is not None:
        new.loss = gang.loss
    if gang.tokens_per_second is not None:
        new.tokens_per_second = gang.tokens_per_second
    if gang.eval_perplexity is not None:
        new.eval_perplexity = gang.eval_perplexity
    # each pod reports its own restore and check times; a pass may see only some of them, so
    # the attempt's figure rises to the slowest pod's as reports arrive, and the run's total by
    # the difference (never counted twice)
    if gang.restore_seconds is not None and (old.current.restore_seconds is None
                                             or gang.restore_seconds > old.current.restore_seconds):
        new.current.restore_seconds = gang.restore_seconds
        new.restore_seconds = round(old.restore_seconds + gang.restore_seconds - (old.current.restore_seconds or 0.0), 2)
    if gang.restore_source is not None:
        new.current.restore_source = slowest_source([old.current.restore_source, gang.restore_source])
    if gang.preflight_seconds is not None and old.current.preflight_seconds is not None \
            and gang.preflight_seconds > old.current.preflight_seconds:
        new.current.preflight_seconds = gang.preflight_seconds
        new.preflight_seconds = round(old.preflight_seconds + gang.preflight_seconds - old.current.preflight_seconds, 2)
    if gang.preflight_seconds is not None and old.current.preflight_seconds is None:  # the attempt's first report
        new.current.preflight_seconds = gang.preflight_seconds
        new.preflight_seconds = round(old.preflight_seconds + gang.preflight_seconds, 2)
        # the attempt's nodes passed now; a node it trusted keeps the time it passed at (a
        # skipped check verified nothing), so it is checked again once that time runs out
        trusted = set(old.current.preflight_trusted)
        fresh = {x.node for x in p.current if x.node and x.node not in trusted}
        new.preflight_passed = [pp for pp in recent_passes(p) if pp.node not in fresh] + \
            [PreflightPass(node=n, time=now) for n in sorted(fresh)]
    if not old.first_progress_time:
        new.first_progress_time, new.first_progress_steps = first_seen(p, gang)
    last = old.current.last_step
    if last is None or gang.step != last:  # a step back (a trainer that rolled back in place) is progress too
        if last is not None and old.current.last_step_time and gang.step > last:
            # the trainer's step end times when both reports carry one; else when we saw them
            prev_t, new_t = old.last_progress_time, gang.last_progress_time
            exact = prev_t and new_t and new_t > prev_t
            observed = ((new_t - prev_t) if exact else (now - old.current.last_step_time)) / (gang.step - last)
            prev = old.step_seconds
            new.step_seconds = round(observed if prev is None else 0.7 * prev + 0.3 * observed, 3)
        new.current.last_step, new.current.last_step_time = gang.step, now
    if gang.last_progress_time:
        new.last_progress_time = gang.last_progress_time


def first_seen(p: Pass, gang: GangState) -> tuple[float, int]:
    """A step end of the attempt's first report and how many steps it had trained by then: its
    first step's own end where the trainer says, else the newest report's (the operator may see
    it late, after a restart of its own: goodput then reckons back by the run's step time, which
    the new attempt's own warm-up can make inaccurate). A first step time outside the attempt
    (before its start, after its newest step: written by user code, or a clock far off the
    operator's) is not used."""
    newest = gang.last_progress_time or p.now
    began = p.old.current.start_time
    if gang.first_step_time is not None and (began is None or began <= gang.first_step_time) \
            and gang.first_step_time <= newest:
        return gang.first_step_time, 1
    return newest, gang.step - (gang.start_step or 0)


def note_resumed(p: Pass, last: FailureRecord, gang: GangState) -> None:
    """The attempt after ``last`` trains: the restart's schedule phase ends where its training
    began; it resumed at startStep (its checkpoint). Once."""
    if not last.resumed_time and gang.step is not None:
        last.resumed_time, last.resumed_steps = first_seen(p, gang)
        last.resumed_step = gang.start_step


PREFLIGHT_MESSAGE = "attempt {attempt}: the pre-flight check of the gang's {nodes} nodes is under way"


def gang_running(p: Pass, gang: GangState) -> None:
    """Every pod Running: the restart's recovery ends here, and its resume at the first report."""
    old, new, last = p.old, p.new, p.last_failure
    if not old.current.gang_running_time:
        new.current.gang_running_time = p.now
        if last and not last.recovered_time:
            last.recovered_time, last.recovered_after = p.now, round(p.now - last.time, 3)
            p.effects.append(ObserveRecovery(copy.copy(last)))
            p.event(Reason.RECOVERED, f"attempt {old.attempt}: all {p.spec.nodes} pods running "
                    f"{last.recovered_after:.1f}s after the failure was detected")
    trusted = set(old.current.preflight_trusted or ())
    skipped = all(x.node in trusted for x in gang.pods if not x.deleting)  # the check passes at once
    if gang.step is None and gang.preflight_running and not skipped and old.phase == "Starting":
        new.phase, new.message = "Preflight", PREFLIGHT_MESSAGE.format(attempt=old.attempt, nodes=p.spec.nodes)
        p.event(Reason.PREFLIGHT, new.message)
    elif gang.step is None and not gang.preflight_running and old.phase == "Preflight":
        # the check passed; pre-compiling and the first step's graphs may take minutes more
        new.phase, new.message = "Starting", f"attempt {old.attempt}: the pre-flight check passed; waiting for the " \
            f"first step"
    if gang.step is not None and old.phase != "Running":
        new.phase = "Running"
        if old.phase == "Preflight":
            new.message = ""
        if new.suspension is not None and new.suspension.resumed_time is not None:
            # training again after a resume: from the resume to the attempt's first step is lost
            seen, steps = first_seen(p, gang)
            began = seen - steps * (old.step_seconds or 0.0)
            redone = max(0, (new.suspension.step or 0) - (gang.start_step or 0)) * (old.step_seconds or 0.0)
            new.suspension = replace(new.suspension, resumed_time=None, restart_seconds=round(
                new.suspension.restart_seconds + max(0.0, began - new.suspension.resumed_time), 3),
                recompute_seconds=round(new.suspension.recompute_seconds + redone, 3))
        p.event(Reason.RUNNING, f"attempt {old.attempt} reports progress at step {gang.step}")
        _resumed_from(p, gang)
        if last and last.recovered_time:
            note_resumed(p, last, gang)


def _resumed_from(p: Pass, gang: GangState) -> None:
    """The checkpoint the attempt's pods say they resumed from (their startStep), where the status
    recorded another at the attempt's start: the pods list the store themselves, and a save
    may have completed after their last report and before the restart (or the newest one was
    damaged and they took the one before it)."""
    recorded, start = p.old.current.resume_checkpoint, gang.start_step
    if start is None or (recorded is None and start == 0) or (recorded is not None and recorded.step == start):
        return
    said = next((x.store.checkpoint for x in gang.pods if x.store is not None and x.store.checkpoint is not None
                 and x.store.checkpoint.step == start), None)
    p.new.current.resume_checkpoint = None if start == 0 else \
        store.ref(said, p.spec.run.checkpoint.uri) if said is not None else CheckpointRef(step=start)


def recent_passes(p: Pass) -> list[PreflightPass]:
    window = p.spec.fault_tolerance.preflight_skip_minutes * 60
    return [pp for pp in p.new.preflight_passed if p.now - pp.time < window]


def preflight_trusted(p: Pass) -> list[str]:
    """Nodes the next attempt may skip the pre-flight check on (they passed it recently)."""
    return sorted({pp.node for pp in recent_passes(p)}) if p.spec.preflight_on() else []


def watch_stragglers(p: Pass) -> None:
    """status.current.stragglers from this pass's progress reports; an event for each pod that
    became a straggler (with stragglers replace, the judge then acts on it)."""
    streaks, new_ones = stragglers.update(p.old.current.stragglers, p.current, p.spec, p.now)
    p.new.current.stragglers = streaks
    for s in new_ones:
        p.event(Reason.STRAGGLER, f"pod {s.pod} on node {s.node}: compute time per step {s.ratio:g}x the other pods' "
                f"median in {s.reports} reports in a row (stragglers: {p.spec.fault_tolerance.stragglers})",
                warning=True)


def report_startup(p: Pass) -> None:
    """PodsStarted: False, naming the pod and the kubelet's reason, as soon as a placed pod
    waits for anything but its container's creation (a pull error, a missing Secret); the
    failure itself comes after startupTimeoutSeconds (judge, cause startup)."""
    waiting = [x for x in not_started(p.current) if x.waiting and waiting_reason(x) not in STARTING_REASONS]
    before = was(p, Cond.PODS_STARTED)
    if waiting:
        first = waiting[0]
        message = (f"pod {first.name} on node {first.node}: {first.waiting}"
                   + (f" (and {len(waiting) - 1} more)" if len(waiting) > 1 else ""))
        # (an event when it flips: not on each ErrImagePull <-> ImagePullBackOff)
        report(p, Cond.PODS_STARTED, False, waiting_reason(first), message, Reason.POD_NOT_STARTING,
               f"{message}; the run acts after {p.spec.fault_tolerance.startup_timeout_seconds:.0f}s")
        p.new.message = f"waiting for pods to start: {message}"
    elif before is not None and before.status == "False" and not not_started(p.current):
        p.condition(Cond.PODS_STARTED, True, CondReason.STARTED, "")
        if p.old.message.startswith("waiting for pods to start"):
            p.new.message = ""


def report_bad_progress(p: Pass) -> None:
    """ProgressValid: False, naming the pod and the fields its annotation got wrong (they were
    dropped, observe.pod_view); an event when that first shows or changes."""
    bad = [x for x in p.current if x.progress_errors]
    before = was(p, Cond.PROGRESS_VALID)
    if bad:
        # the condition names the fields only: their values change with every report
        fields = sorted({e.split(":")[0] for e in bad[0].progress_errors})
        message = f"pod {bad[0].name}: malformed {', '.join(fields)} in trainium.dev/progress; ignored"
        report(p, Cond.PROGRESS_VALID, False, CondReason.MALFORMED_PROGRESS, message, Reason.MALFORMED_PROGRESS,
               f"pod {bad[0].name}: {'; '.join(bad[0].progress_errors)}"[:500] + "; the field is ignored",
               when="change")
    elif before is not None and before.status == "False":
        p.condition(Cond.PROGRESS_VALID, True, CondReason.PARSED, "")


def account(p: Pass, until: float) -> None:
    """status.goodput up to ``until`` (goodput.account)."""
    new = p.new
    if new.created_time is not None:
        new.goodput = goodput.account(new.created_time, new.first_progress_time, new.failures, until,
                                      new.step_seconds, new.first_progress_steps, new.goodput_archive,
                                      new.suspension, new.preflight_seconds, new.restore_seconds)
