"""Restarts: in place, replace, recreate. Pure.

The judge's verdict carries the action (failure_policy): :func:`act_on` records the failure
(once, whole) and starts the restart its kind names (RESTART); every pass while Restarting,
:func:`teardown` sees it through (TEARDOWN):

  inPlace   every agent stops its workers; at the barrier (every agent said ready) and after
            the backoff, the next attempt starts in the same pods
  replace   the failed index's pod is deleted and a spare (spares) or a new pod takes its
            index; the other agents stop their workers; at the barrier, the next attempt
            starts in them all
  recreate  the gang's pods are deleted (forced once a graceful delete has run out:
            run_pass.overdue); the next attempt's are created once every pod is gone

An in-place restart that cannot reach its barrier (_barrier_broken, the one watchdog for both
kinds) is given up: the gang is recreated.
"""

from __future__ import annotations

import copy
from typing import Callable

from trainium_api import runtimefaults
from trainium_api.agent import Order
from trainium_api.status import MAX_FAILURES_KEPT, AttemptStatus, FailureRecord

from . import goodput, inplace, plan
from .effects import DeletePod, Ensure, ObserveFailure
from .failure_policy import Action, Budget, Standing
from .judge import Verdict
from .observe import GangState, PodView, draining, gang_state
from .progress_tracking import account, note_resumed, preflight_trusted
from .quarantine import avoid, excluded, kept_off, late_culprits, quarantine
from .reasons import Cond, CondReason, Reason
from .run_pass import Pass, condition, node_gone, node_lost, stop
from .spares import ready_spare, take_index


def standing(p: Pass) -> Standing:
    """What the judge counts a failure against (failure_policy.Standing): the run's earlier
    failures, the nodes it leaves out, the newest checkpoint, and the gang as it is."""
    ckpt = p.checkpoint or p.new.last_checkpoint
    step = ckpt.step if ckpt else None
    return Standing(counters=Budget(p.spec).counters(p.old.failure_counters, p.new.failures),
                    quarantined=tuple(p.new.quarantined_nodes), avoided=tuple(a.node for a in p.new.avoided_nodes),
                    checkpoint_step=step, in_place_streak=inplace.next_streak(p.old, step), pods=tuple(p.gang),
                    attempt=p.old.attempt, lost_nodes=frozenset(x.node for x in p.gang if x.node and (
                        node_lost(p, x) or (x.node in p.nodes and draining(p.nodes[x.node])))),
                    capacity_waits=capacity_waits(p.new.failures, p.old.attempt),
                    repaired=repaired_nodes(p.new.failures, Budget(p.spec), p.now),
                    run_key=p.run["metadata"].get("uid") or p.name, departed=tuple(p.gone))


def repaired_nodes(history, budget: Budget, now: float) -> frozenset[str]:
    """Nodes kept within the budget window after a fault the runtime called repairable (1205):
    another such fault there leaves the node out (failure_policy.decide)."""
    return frozenset(r.node for r in history if r.node and r.runtime_status in runtimefaults.REPAIRABLE_STATUSES
                     and budget.within(r.time, now))


def capacity_waits(history, attempt: int) -> int:
    """Scheduling restarts of the attempts just before ``attempt``, one after the other (gangs
    not placed whole, released and placed again); a gang that trained, or a resume, in between
    ends the count."""
    waits, expected = 0, attempt - 1
    for record in reversed(history):
        if record.cause != "scheduling" or record.action != "restart" or record.attempt != expected:
            break
        waits, expected = waits + 1, expected - 1
    return waits


def act_on(p: Pass, verdict: Verdict, seen: Standing, gang: GangState) -> None:
    """Record the failure (once, whole), then apply the verdict's action: fail the run, or
    restart it as the action says (RESTART)."""
    failure, action, old, new, now = verdict.failure, verdict.action, p.old, p.new, p.now
    history = list(new.failures)
    if history and history[-1].attempt == old.attempt - 1:
        # an attempt first seen failed (the operator was down while it trained): the restart
        # before it ended where its training began all the same
        note_resumed(p, history[-1], gang)
    record = FailureRecord(
        id=(old.failure_count or len(history)) + 1, time=now, cause=failure.cause, action=action.kind,
        node=failure.node, pod=failure.pod, message=failure.message[:500], attempt=old.attempt,
        detected_after=round(now - failure.since, 3) if failure.since else None,
        # the newest step end this pass saw: status.lastProgressTime is the previous pass's,
        # stale when the failure is found in the pass that first sees the gang's last steps
        last_progress_time=max(old.last_progress_time or 0.0, gang.last_progress_time or 0.0) or None,
        step=gang.step, checkpoint_step=seen.checkpoint_step, step_seconds=old.step_seconds, restart=action.restart,
        # the failed attempt's trainer saved that step itself and says when it ended
        checkpoint_time=gang.last_checkpoint_time if seen.checkpoint_step is not None
        and gang.last_checkpoint_step == seen.checkpoint_step else None,
        exempt="capacity" if failure.capacity else "voluntary" if failure.voluntary else None,
        runtime_status=failure.runtime_status or None)
    timeline = history + [record]
    new.failure_count = record.id
    # a gang not placed whole, or moved by the cluster, spends no budget (failure_policy:
    # capacity, voluntary); the counters are written all the same, so that they are never
    # counted again from the records
    new.failure_counters = seen.counters if failure.capacity or failure.voluntary else \
        Budget(p.spec).count(seen.counters, failure.cause, now, seen.checkpoint_step)
    if len(timeline) > MAX_FAILURES_KEPT:  # older failures leave the status; their lost time does not
        dropped, timeline = timeline[:-MAX_FAILURES_KEPT], timeline[-MAX_FAILURES_KEPT:]
        new.goodput_archive = goodput.archive(
            old.goodput_archive, old.created_time if old.created_time is not None else now, old.first_progress_time,
            dropped, timeline[0].time, now, old.step_seconds, old.first_progress_steps)
    new.failures = timeline
    p.effects.append(ObserveFailure(copy.copy(record)))
    if action.kind == "fail":
        new.phase, new.message = "Failed", action.reason
        new.conditions = [condition(Cond.VALID, True, CondReason.SPEC_VALID, "", now, old.conditions),
                          condition(Cond.FAILED, True, CondReason.FAILURE_POLICY, action.reason, now, old.conditions)]
        p.event(Reason.FAILED, action.reason, warning=True)
        p.delete(p.current)
        account(p, now)
        return
    if failure.cause == "preflight" and old.current.gang_running_time:  # the failed check's seconds
        new.preflight_seconds = round(new.preflight_seconds + max(0.0, now - old.current.gang_running_time), 2)
    # a node blamed, or every node after a hang (a device hang looks like one), is checked again
    new.preflight_passed = [] if failure.cause == "hang" else [pp for pp in new.preflight_passed
                                                               if pp.node != failure.node]
    new.restarts = {**old.restarts, failure.cause: old.restarts.get(failure.cause, 0) + 1}
    new.restart_count = sum(new.restarts.values())
    new.phase, new.message = "Restarting", action.reason
    new.current.teardown_start_time, new.current.restart_not_before = now, now + action.delay_seconds
    if action.quarantine_node:
        quarantine(p, action.quarantine_node, failure.message)
    if action.avoid_node:
        avoid(p, action.avoid_node, failure.message)
    new.current.restart = action.restart
    after = f" in {action.delay_seconds:.0f}s" if action.delay_seconds else ""
    # made for every kind, as the status keeps the grace ordered (current.stopGraceSeconds),
    # a recreate's too; in place and replace send it to the pods that stay
    order = _stop_order(p, old.attempt + 1)
    RESTART[action.restart](p, action, order, f"{failure.cause}: {failure.message}", after)
    account(p, now)


def _in_place(p: Pass, action: Action, order: Order, what: str, after: str) -> None:
    """Every agent of the gang is told to stop its workers; the pods stay."""
    p.new.restarts_in_place = p.old.restarts_in_place + 1
    p.event(Reason.RESTARTING, f"{what}; restarting the gang in place{after}", warning=True)
    _order(p, p.gang, order, inplace.gang_names(p.old, p.name, p.spec.nodes))


def _replace(p: Pass, action: Action, order: Order, what: str, after: str) -> None:
    """The failed index's pod is deleted (at once on a node known dead) and a ready spare takes
    its index at once, else a new pod will; the other agents are told to stop their workers."""
    old, new, target = p.old, p.new, p.old.attempt + 1
    new.restarts_replaced = old.restarts_replaced + 1
    failed = next(x for x in [*p.gang, *p.gone] if x.name == action.replace_pod)  # (gone already: departed)
    spare = ready_spare(p)
    new.current.replacing = action.replace_index
    new.current.replacement = spare.name if spare else plan.pod_name(p.name, target, action.replace_index)
    if spare is not None:
        new.current.replacement_since = p.now  # it takes the index at once: labelled as the gang's, told to stop (it runs nothing)
        p.effects.append(take_index(spare, order, target, action.replace_index))
        new.spares = [s for s in new.spares if s != spare.name]
    p.event(Reason.RESTARTING, f"{what}; replacing pod {failed.name} by "
            + (f"spare {spare.name} on node {spare.node}" if spare else f"a new pod, {new.current.replacement}")
            + f"; the other pods restart in place{after}", warning=True)
    _order(p, [x for x in p.gang if x is not failed], order, inplace.with_replaced(
        old, p.name, p.spec.nodes, action.replace_index, new.current.replacement))
    p.delete([failed], grace=0 if node_gone(p, failed) else None)


def _recreate(p: Pass, action: Action, order: Order, what: str, after: str) -> None:
    """The gang's pods are deleted; the next attempt's are created once they are gone."""
    p.event(Reason.RESTARTING, f"{what}; restarting the gang{after}"
            + (f" (recreated: {action.recreated_because})" if p.spec.in_place_on() else ""), warning=True)
    p.delete(p.current)


RESTART: dict[str, Callable[[Pass, Action, Order, str, str], None]] = {
    "inPlace": _in_place, "replace": _replace, "recreate": _recreate}
"""Each restart kind of the verdict -> what starts it (and TEARDOWN what sees it through)."""


def create(p: Pass) -> None:
    """The first attempt (its children are ensured by every pass, before its pods)."""
    p.new.created_time = p.now
    start_attempt(p, 1, Reason.STARTING, f"starting {p.spec.nodes} pods")


def start_attempt(p: Pass, attempt: int, reason: str, message: str) -> None:
    """Status first, then pods (the handler writes the status before the effects). The new
    gang resumes from the newest complete checkpoint now."""
    new = p.new
    resume = p.checkpoint or p.old.last_checkpoint
    new.phase, new.attempt = "Starting", attempt
    new.current = AttemptStatus(start_time=p.now, resume_checkpoint=resume,  # nothing of the last one carries over
                                preflight_trusted=preflight_trusted(p))
    p.effects += [Ensure(o) for o in plan.pods(p.run, p.spec, attempt, kept_off(new), p.host,
                                               new.current.preflight_trusted)
                  + plan.with_list(p.run, p.spec, new.current.preflight_trusted)]
    p.event(reason, f"attempt {attempt}: {message}")


def teardown(p: Pass) -> None:
    """Restarting: see the restart the status records through (TEARDOWN)."""
    TEARDOWN.get(p.old.current.restart or "recreate", _teardown_recreate)(p)


def _teardown_recreate(p: Pass) -> None:
    """Delete the failed attempt (force after the grace period), then start the next one once
    every pod of every attempt is gone and the backoff has passed."""
    _note_teardown_progress(p)
    late_culprits(p)
    # (a replacement pod left by a restart replace that was given up goes too: the next gang
    # takes its name)
    stop(p, p.current + p.replacement, p.old.current.teardown_start_time or p.now)
    if p.current or p.stale or p.replacement:
        return
    if not _torn_down(p):
        return
    left_out = excluded(p.new)
    start_attempt(p, p.old.attempt + 1, Reason.RESTARTED, "new gang created" + (
        f", avoiding {len(left_out)} quarantined or avoided node(s)" if left_out else ""))


def _barrier_broken(p: Pass, pods: list[PodView], expected: int, ready: bool, since: float,
                    node_lost_too: bool = False) -> str:
    """The barrier's watchdog: why the pods kept for an in-place restart cannot reach the
    barrier ("" while they may): one ends or goes (or, ``node_lost_too``, its node is lost),
    fewer than ``expected`` are left, or not every agent answered within the teardown grace
    (the longest ordered) and ANSWER_SLACK_SECONDS."""
    lost = next((x for x in pods if x.deleting or x.phase != "Running" or (node_lost_too and node_lost(p, x))), None)
    if lost is not None:
        return f"pod {lost.name} is " + ("going" if lost.deleting else "no longer running" if lost.phase != "Running"
                                         else f"on node {lost.node}, which is lost")
    if len(pods) < expected:
        return "a pod of the gang is gone"
    answer_within = inplace.answer_within(p.old.current.stop_grace_seconds, p.grace)
    if not ready and p.now - since > answer_within:
        return f"not every agent said its workers stopped within {answer_within:.0f}s"
    return ""


def _teardown_in_place(p: Pass) -> None:
    """Tell every agent to stop the failed attempt's workers; once every one said they are gone
    (the barrier) and the backoff has passed, start the next attempt in the same pods. A pod
    that ends or goes, or an agent that does not answer in time, and the gang is recreated
    instead (_barrier_broken)."""
    _note_teardown_progress(p)
    target, gang = p.old.attempt + 1, p.gang
    ready = inplace.ready(gang, target)  # then only the backoff is waited for: no answer is due
    why = _barrier_broken(p, gang, p.spec.nodes, ready, p.old.current.teardown_start_time or p.now)
    if why:
        _give_up_in_place(p, why)
        return
    if not ready:
        _order(p, gang, _stop_order(p, target), inplace.gang_names(p.old, p.name, p.spec.nodes),
               since=p.old.current.teardown_start_time)
        return
    if _torn_down(p):
        _start_in_place(p, target)


def _teardown_replace(p: Pass) -> None:
    """Restart replace: the failed index's pod is deleted (gracefully: it saves with the others
    where its node still runs it; forced after the grace); the other pods are told to stop
    their workers, as in place. Once that pod is gone its replacement is created, on a node the
    run may use, under the next attempt's name; its agent starts no workers but says ready.
    Once every agent, the replacement's included, said ready (the barrier) and the backoff has
    passed, the next attempt starts in them all. Another pod that ends or goes, an agent that
    does not answer in time, another pod's node lost, or a replacement that is not created or
    placed within scheduleTimeoutSeconds, not started within startupTimeoutSeconds once placed,
    that ends or whose node is lost, and the gang is recreated instead (_barrier_broken, and below)."""
    _note_teardown_progress(p)
    old, ft = p.old, p.spec.fault_tolerance
    target, index = old.attempt + 1, old.current.replacing
    if index is None or not 0 <= index < p.spec.nodes:  # (a status edited by hand)
        _give_up_in_place(p, f"the status names no index of the gang to replace ({index})")
        return
    since = old.current.teardown_start_time or p.now
    failed = [x for x in p.gang if x.index == index]
    kept = [x for x in p.gang if x.index != index]
    replacement = p.replacement[0] if p.replacement else None
    taken = old.current.replacement
    if plan.is_spare_name(p.name, taken) and (replacement is None or replacement.deleting or replacement.phase in (
            "Succeeded", "Failed") or node_lost(p, replacement)):
        # the spare given the index went (deleted, ended, its node lost) before the start: the
        # next ready spare takes it, else a new pod
        if replacement is not None:
            p.effects.append(DeletePod(replacement.name, 0 if node_lost(p, replacement) else p.grace))
        other = ready_spare(p, but=taken)
        p.new.current.replacement = other.name if other else plan.pod_name(p.name, target, index)
        p.new.current.replacement_since = p.now if other else None
        if other is not None:
            p.effects.append(take_index(other, _stop_order(p, target), target, index))
            p.new.spares = [s for s in p.new.spares if s != other.name]
        p.event(Reason.SPARE_LOST, f"spare {taken} went before attempt {target} started; "
                + (f"spare {other.name} takes index {index}" if other else f"creating pod {p.new.current.replacement}"),
                warning=True)
        replacement = other
    kept_ready = inplace.ready(kept, target)
    why = _barrier_broken(p, kept, p.spec.nodes - 1, kept_ready, since, node_lost_too=True) or \
        _replacement_stuck(p, replacement, target, since)
    if why:
        _give_up_in_place(p, why)
        return
    if replacement is not None and not replacement.node and replacement.unschedulable:
        last = p.last_failure
        p.new.message = (f"{last.message if last else 'restarting'}; the replacement pod {replacement.name} waits to "
                         f"be placed ({replacement.unschedulable[:300]}); the gang is recreated if it is not placed "
                         f"within {ft.schedule_timeout_seconds:.0f}s")
    order = _stop_order(p, target)
    _order(p, kept, order, inplace.with_replaced(old, p.name, p.spec.nodes, index, p.new.current.replacement),
           since=since)
    if replacement is not None and plan.is_spare_name(p.name, replacement.name) and (
            replacement.spare if inplace.reads_gang_order(replacement) else inplace.unordered([replacement], order)):
        p.effects.append(take_index(replacement, order, target, index))  # (until it is labelled, or carries the order)
    # graceful, forced after the grace (a NotReady node may still run it: a partition or a
    # kubelet down, and the replacement takes the same index), at once on a node known dead
    stop(p, failed, since, dead=True)
    if failed:
        return
    # the failed attempt is gone once the failed pod is and the others' workers are: placing
    # and starting the replacement is the restart's schedule phase
    may_start = kept_ready and _torn_down(p)
    if replacement is None:
        # (a status naming anything else, written by hand: the new pod all the same)
        p.new.current.replacement = plan.pod_name(p.name, target, index)
        if p.new.current.replacement_since is None:
            p.new.current.replacement_since = p.now
        trusted = preflight_trusted(p)
        p.effects += [Ensure(o) for o in [plan.pod(p.run, p.spec, target, index, kept_off(p.new), p.host, trusted,
                                                   await_start=True), *plan.with_list(p.run, p.spec, trusted)]]
    elif may_start and inplace.ready([replacement], target):
        _start_in_place(p, target, replaced=replacement)


def _replacement_stuck(p: Pass, replacement: PodView | None, target: int, since: float) -> str:
    """Why the pod taking the replaced index will not reach the barrier ("" while it may): it
    ended, went or lost its node, or was not created or placed within scheduleTimeoutSeconds,
    or not started within startupTimeoutSeconds of being placed."""
    ft = p.spec.fault_tolerance
    asked = p.new.current.replacement_since
    if asked is None:  # (a status from before replacementSince)
        asked = replacement.created if replacement is not None and replacement.created else p.now
    waited = p.now - max(asked, since)
    if replacement is None:
        return (f"the replacement pod {p.new.current.replacement} could not be created within "
                f"{ft.schedule_timeout_seconds:.0f}s ({p.children_error or 'no reason given'})"
                if waited > ft.schedule_timeout_seconds else "")
    placed_at = replacement.scheduled or replacement.created
    if replacement.deleting or replacement.phase in ("Succeeded", "Failed") or node_lost(p, replacement):
        return f"the replacement pod {replacement.name} ended, went or lost its node"
    if not replacement.node and waited > ft.schedule_timeout_seconds:
        return (f"the replacement pod {replacement.name} was not placed within {ft.schedule_timeout_seconds:.0f}s "
                f"({replacement.unschedulable or 'no reason given'})")
    if replacement.node and not inplace.ready([replacement], target) and p.now - max(
            placed_at or p.now, since) > ft.startup_timeout_seconds:
        return (f"the replacement pod {replacement.name} did not start within {ft.startup_timeout_seconds:.0f}s of "
                f"being placed ({replacement.waiting or 'no reason given'})")
    return ""


def _stop_order(p: Pass, target: int) -> Order:
    """The order to stop the workers of the attempts before ``target``: the teardown grace, ended
    early once they are idle after a hang (inplace.stop_idle_seconds). The status keeps the
    longest grace ordered (the answers are due by it)."""
    last = p.last_failure
    p.new.current.stop_grace_seconds = max(p.new.current.stop_grace_seconds or 0.0, float(p.grace))
    return Order(target, start=False, grace_seconds=float(p.grace),
                 idle_seconds=inplace.stop_idle_seconds(last.cause if last else None))


def _torn_down(p: Pass) -> bool:
    """The failed attempt is gone: its teardown ends now (on the failure's record); whether the
    backoff has passed too, so the next attempt may start."""
    last = p.last_failure
    if last and not last.teardown_done_time:
        last.teardown_done_time = p.now
    return p.now >= (p.old.current.restart_not_before or 0)


def _give_up_in_place(p: Pass, why: str) -> None:
    """Recreate the gang after all: delete its pods (the normal teardown from here)."""
    p.new.current.restart, p.new.current.teardown_start_time = "recreate", p.now
    last = p.last_failure
    if last is not None:  # its teardown is the pods' deletion from now on
        last.restart, last.teardown_done_time = "recreate", None
    if p.old.current.restart == "replace":
        p.new.restarts_replaced = max(0, p.old.restarts_replaced - 1)
    else:
        p.new.restarts_in_place = max(0, p.old.restarts_in_place - 1)
    p.event(Reason.IN_PLACE_GIVEN_UP, f"attempt {p.old.attempt + 1}: {why}; recreating the gang", warning=True)
    stop(p, p.gang + p.replacement, p.now)


def _start_in_place(p: Pass, target: int, replaced: PodView | None = None) -> None:
    """The next attempt in the failed attempt's pods (and the pod that ``replaced`` one of
    them): status first, then the orders to start (the applier writes them after the status
    that records the attempt)."""
    old, new = p.old, p.new
    resume = p.checkpoint or old.last_checkpoint
    new.phase, new.attempt = "Starting", target
    last = p.last_failure
    # after a hang the gang is checked again (a device hang looks like one), in place too, and
    # so it is with a replacement on a node that has not passed the check recently
    check = p.spec.preflight_on() and last is not None and (last.cause == "hang" or (
        replaced is not None and replaced.node not in preflight_trusted(p)))
    new.current = AttemptStatus(start_time=p.now, resume_checkpoint=resume, gang_attempt=inplace.gang_attempt(old),
                                pod_names=list(old.current.pod_names) if replaced is None else
                                inplace.with_replaced(old, p.name, p.spec.nodes, old.current.replacing,
                                                      replaced.name),
                                in_place_streak=inplace.next_streak(old, resume.step if resume else None),
                                preflight_trusted=[] if check else list(old.current.preflight_trusted),
                                preflight_check=check)
    order_start(p, target)
    if replaced is None:
        p.event(Reason.RESTARTED, f"attempt {target}: restarted in place in the {len(p.gang)} pods of attempt "
                f"{new.current.gang_attempt} (no pod deleted or created)")
    else:
        p.event(Reason.RESTARTED, f"attempt {target}: pod {replaced.name} on node {replaced.node} replaced the failed "
                f"one; the other {p.spec.nodes - 1} pod(s) restarted in place")


def order_start(p: Pass, attempt: int) -> None:
    """Tell the gang's agents to start ``attempt`` (the pods that do not carry the order yet;
    in the pass that starts it with a replacement, the gang as read still has the failed
    index's place empty: the replacement is ordered too)."""
    names = inplace.gang_names(p.new, p.name, p.spec.nodes)
    # every pod is told its node rank (the gang order gives each its index) and the rendezvous
    # address (the index-0 pod's: a spare's own hostname once it runs index 0), so none relies
    # on what it was started with
    start = Order(attempt, start=True, grace_seconds=float(p.grace), preflight=p.new.current.preflight_check,
                  master=plan.master_address(p.run, names[0]))
    _order(p, p.gang + p.replacement, start, names, inplace.gang_attempt(p.new),
           since=p.old.current.start_time if p.old.attempt == attempt else None)


def _order(p: Pass, pods: list[PodView], order: Order, names: list[str], gang_attempt: int | None = None,
           since: float | None = None) -> None:
    """Give ``order`` to ``pods`` of the gang whose pods are ``names`` by index (inplace.orders):
    one gang order, and orders on the pods of agents that do not read it (of every agent, once
    the order, first given at ``since``, is late to show in the gang order)."""
    late = since is not None and p.now - since >= inplace.GANG_ORDER_GRACE_SECONDS
    p.effects += inplace.orders(p.name, gang_attempt or inplace.gang_attempt(p.old), names, pods, order, p.gang_order,
                                p.run["metadata"].get("uid") or "", late)


def _note_teardown_progress(p: Pass) -> None:
    """A gang stopped by SIGTERM finishes its step and checkpoint first: keep the failed
    attempt's newest step and its time on the failure record, so goodput counts that work."""
    gang = gang_state(p.current)
    last = p.last_failure
    if last is None or last.teardown_done_time or gang.step is None:
        return
    if gang.step > (last.step if last.step is not None else -1) or \
            (gang.last_progress_time or 0) > (last.last_progress_time or 0):
        last.step = max(gang.step, last.step or 0)
        last.last_progress_time = max(gang.last_progress_time or 0, last.last_progress_time or 0)


TEARDOWN: dict[str, Callable[[Pass], None]] = {
    "inPlace": _teardown_in_place, "replace": _teardown_replace, "recreate": _teardown_recreate}
