"""Kueue's admission of a run: the operator as its Workload's owner. Pure.

A run labelled ``kueue.x-k8s.io/queue-name`` (a LocalQueue in its namespace) runs only while
Kueue admits it:

* every pass of the live run ensures its Workload (workload.build: a pod set for the gang and
  one for the warm spares, owned by the run, so the garbage collector takes it with the run);
* until the Workload is admitted the run is Queued: no pod exists, the time leaves goodput's
  wall time (as a suspension's does), and status.queue gives Kueue's reason and message;
* admitted, the gang starts with the admitted flavors' node labels and tolerations, and the
  admission checks' pod set updates, on its pods (:func:`admitted_spec`); PodsReady follows
  the gang (False through a restart, in place or not: Kueue's recovery timeout applies);
* evicted or preempted, the gang stops as for spec.suspend: a graceful delete, on which the
  trainer saves at its step boundary; no failure is counted. Once no pod is left the owner
  hands the quota back (jobframework's ``UnsetQuotaReservationWithCondition``); admitted again,
  the next attempt resumes from that save;
* Succeeded or Failed: the Workload is marked Finished, and Kueue frees the quota;
* spec.suspend deactivates the Workload (spec.active false: Kueue evicts it and frees the
  quota); clearing it activates the Workload again, and the run queues.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

from trainium_api.spec import TrainingRunSpec
from trainium_api.status import HELD, TERMINAL, QueueStatus, TrainingRunStatus

from . import plan, workload
from .effects import Ensure, PatchWorkload
from .reasons import Reason
from .run_pass import Pass
from .workload import (ADMITTED, EVICTED, FINISHED, GANG, PODS_READY, PREEMPTED, QUOTA_RESERVED, FlavorView,
                       WorkloadView)

READY_PHASES = ("Starting", "Preflight", "Running")
MESSAGE_MAX = 1024  # of Kueue's message in status.queue (Kueue's may be 32 KiB)


def managed(p: Pass) -> bool:
    """Queued with Kueue: labelled so before its first gang (or while held), or once was. The
    label read when the run was first queued stays in force: one removed from a live run does
    not take it out of Kueue's accounting (its Workload keeps the queue it was made with), and
    one added to a run that trains (or present when an operator without Kueue admission was
    upgraded) takes effect at its next suspension, not by stopping its gang."""
    return queued(p.run, p.old)


def queued(run: dict, status: TrainingRunStatus) -> bool:
    """managed(), from the run and its status as read (the watcher asks before a pass)."""
    if status.queue is not None:
        return True
    return bool(workload.queue_name(run)) and (status.attempt == 0 or status.phase in HELD)


def holds(p: Pass) -> bool:
    """Kueue does not let the gang run now: the run's Workload is not made yet, waits for quota
    or admission checks, was evicted, or is admitted to a ResourceFlavor not seen yet (its
    node labels are not known: the pods would land anywhere)."""
    return managed(p) and not (p.workload is not None and p.workload.admitted and not missing_flavors(p))


def missing_flavors(p: Pass) -> list[str]:
    """The admitted flavors the operator has not seen (kopf's index of ResourceFlavors)."""
    w = p.workload
    return [] if w is None else [f for f in w.flavors.get(GANG, ()) if f not in p.flavors]


def admitted_spec(spec: TrainingRunSpec, w: WorkloadView, flavors: dict[str, FlavorView]) -> TrainingRunSpec:
    """``spec`` with what Kueue's admission puts on the gang's pods (podset.FromAssignment and
    the admission checks' PodSetUpdates, as jobframework merges them into a Job's template):
    the admitted flavors' node labels and tolerations, and the updates' labels, annotations,
    node selector and tolerations. The operator's own node selector (the instance type) wins a
    clash; a flavor not seen yet adds nothing."""
    t = spec.pod_template
    labels, annotations = dict(t.metadata.labels), dict(t.metadata.annotations)
    selector, tolerations = dict(t.spec.node_selector), list(t.spec.tolerations)
    for name in w.flavors.get(GANG, ()):
        f = flavors.get(name)
        if f is not None:
            selector.update(f.node_labels)
            tolerations += [dict(x) for x in f.tolerations if x not in tolerations]
    for u in w.updates.get(GANG, ()):
        labels.update(u.get("labels") or {})
        annotations.update(u.get("annotations") or {})
        selector.update(u.get("nodeSelector") or {})
        tolerations += [dict(x) for x in u.get("tolerations") or [] if x not in tolerations]
    labels[workload.PODSET_LABEL] = GANG
    if GANG in w.topology:  # Kueue places each pod in the assigned domains: its gate, its Workload
        annotations[workload.WORKLOAD_ANNOTATION] = w.name
        if not any(k in annotations for k in workload.TOPOLOGY_REQUESTS):
            annotations[workload.UNCONSTRAINED] = "true"  # (a flavor with a topology, no request)
    template = dataclasses.replace(
        t, metadata=dataclasses.replace(t.metadata, labels=labels, annotations=annotations),
        spec=dataclasses.replace(t.spec, node_selector=selector, tolerations=tolerations))
    return dataclasses.replace(spec, pod_template=template)


def own(p: Pass) -> None:
    """Every pass of a queued run, after the phase step: the Workload, status.queue, and the
    owner's writes to the Workload."""
    if not managed(p):
        return
    w = p.workload
    terminal = p.new.phase in TERMINAL
    built = None
    if not terminal:
        template = plan.pod(p.run, p.spec, 0, 0, [], p.host)
        built = workload.build(p.run, p.spec, template)
        p.effects.append(Ensure(built))
    _report(p, w)
    if w is None:
        return
    if built is not None and not w.true(QUOTA_RESERVED) and w.digest != built["metadata"]["annotations"][
            workload.DIGEST_ANNOTATION]:
        # the run changed while it holds no quota (its pod template, edited while suspended):
        # the Workload asks for what the next gang will be
        p.effects.append(PatchWorkload(w.name, workload.pod_sets_patch(built), status=False))
    now = _rfc3339(p.now)
    gen = (w.raw.get("metadata") or {}).get("generation")
    if terminal:
        if not w.true(FINISHED):
            ok = p.new.phase == "Succeeded"
            c = workload.condition(FINISHED, True, workload.SUCCEEDED if ok else workload.FAILED,
                                   p.new.message or p.new.phase, gen, now)
            p.effects.append(PatchWorkload(w.name, workload.status_patch(w, [c])))
        return
    if w.true(EVICTED) and w.has_admission and p.old.phase in HELD and not p.pods and not p.spares:
        # the gang is gone: hand the quota back, as jobframework does for an evicted Workload
        # whose job is no longer active (UnsetQuotaReservationWithCondition, SetRequeuedCondition).
        # Only from a pass that read the run held: pods created by the pass before (not in the
        # pod index yet, maybe) were stopped by the one that read the eviction
        p.effects.append(PatchWorkload(w.name, workload.status_patch(w, _requeue(w, gen, now), clear_admission=True)))
        return
    _active(p, w)
    _pods_ready(p, w, gen, now)


def _requeue(w: WorkloadView, gen: int | None, now: str) -> list[dict]:
    """The conditions of an evicted Workload that hands its quota back: QuotaReserved False
    (Pending), Admitted False, and Requeued (True only after a preemption or a node failure;
    Kueue itself ends the backoff of the other reasons). Evicted and Preempted stay."""
    ev = w.conditions[EVICTED]
    checks_ready = all(c.get("state") == "Ready" for c in (w.raw.get("status") or {}).get("admissionChecks") or [])
    no_reservation = (("NoReservation", "The workload has no reservation") if checks_ready else
                      ("NoReservationUnsatisfiedChecks", "The workload has no reservation and not all checks ready"))
    return [workload.condition(workload.REQUEUED, ev.reason in ("Preempted", "NodeFailures"), ev.reason, ev.message,
                               gen, now, workload.was(w, workload.REQUEUED)),
            workload.condition(QUOTA_RESERVED, False, workload.PENDING, ev.message, gen, now,
                               workload.was(w, QUOTA_RESERVED)),
            workload.condition(ADMITTED, False, *no_reservation, gen, now, workload.was(w, ADMITTED))]


def _active(p: Pass, w: WorkloadView) -> None:
    """spec.suspend deactivates the Workload (its quota is freed); clearing it activates the
    Workload again, when the run deactivated it (Kueue deactivates one itself, e.g. after its
    requeuing limit, and that one stays so)."""
    q = p.new.queue
    if p.spec.suspend:
        if w.active:
            p.effects.append(PatchWorkload(w.name, workload.active_patch(False), status=False))
        q.deactivated = True
    elif not w.active and q.deactivated:
        p.effects.append(PatchWorkload(w.name, workload.active_patch(True), status=False))
    elif w.active and q.deactivated:
        q.deactivated = False


def _pods_ready(p: Pass, w: WorkloadView, gen: int | None, now: str) -> None:
    """jobframework's generatePodsReadyCondition, with the gang for the job: True while every
    pod of the gang runs, from its start (the pre-flight check, the graph's compile and the
    restore take longer than Kueue's default timeout) to its end (Started, or Recovered after a
    restart), else False (WaitForStart before the first time, WaitForRecovery after it, a
    restart in place included); written when it changes."""
    before = workload.was(w, PODS_READY)
    gang = [x for x in p.current if not x.deleting]
    ready = (w.admitted and p.new.phase in READY_PHASES and len(gang) == p.spec.nodes
             and all(x.phase == "Running" for x in gang))
    if ready:
        recovering = before is not None and before.get("reason") in (workload.WAIT_FOR_RECOVERY, workload.RECOVERED)
        reason = workload.RECOVERED if recovering else workload.STARTED
        message = "All pods reached readiness and the workload is running"
    elif w.admitted and before is not None and (before.get("status") == "True"
                                                or before.get("reason") == workload.WAIT_FOR_RECOVERY):
        reason, message = workload.WAIT_FOR_RECOVERY, "At least one pod has failed, waiting for recovery"
    else:
        reason, message = workload.WAIT_FOR_START, "Not all pods are ready or succeeded"
    if before is not None and before.get("status") == ("True" if ready else "False") and before.get("reason") == reason:
        return
    c = workload.condition(PODS_READY, ready, reason, message, gen, now, before)
    p.effects.append(PatchWorkload(w.name, workload.status_patch(w, [c])))


def state_of(w: WorkloadView | None) -> tuple[str, str, str]:
    """(status.queue state, Kueue's reason, Kueue's message) of the Workload as seen."""
    if w is None:
        return "Queued", "Creating", "the Workload is being created"
    if w.true(FINISHED):
        c = w.conditions[FINISHED]
        return "Finished", c.reason, c.message
    if w.true(EVICTED):
        c = w.conditions[EVICTED]
        preempted = w.conditions.get(PREEMPTED)
        if c.reason == "Preempted" or (preempted is not None and preempted.status == "True"):
            return "Preempted", (preempted.reason if preempted and preempted.reason else c.reason), c.message
        return "Evicted", c.reason, c.message
    if w.admitted:
        return "Admitted", "Admitted", f"admitted by ClusterQueue {w.cluster_queue}"
    # (admitted to a flavor not seen yet: Admitted, and holds() keeps the gang back a pass or two)
    if not w.active:
        return "Queued", "Inactive", "the Workload is inactive (spec.active is false)"
    reserved = w.conditions.get(QUOTA_RESERVED)
    if reserved is not None and reserved.status == "True":
        return "Queued", "QuotaReserved", f"quota reserved in ClusterQueue {w.cluster_queue}; waiting for " \
                                          f"admission checks"
    if reserved is not None:
        return "Queued", reserved.reason or "Pending", reserved.message
    return "Queued", "Waiting", "waiting for Kueue to consider the Workload"


def _report(p: Pass, w: WorkloadView | None) -> None:
    state, reason, message = state_of(w)
    refused = next((e for e in p.children_error.split("; ") if e.startswith("cannot create Workload ")), "")
    if w is None and refused:
        reason, message = "WorkloadNotCreated", refused
    if state == "Admitted" and missing_flavors(p):
        state, reason = "Queued", "FlavorNotSeen"
        message = f"admitted to ResourceFlavor {', '.join(missing_flavors(p))}, not seen yet: waiting for it"
    was = p.old.queue
    q = dataclasses.replace(was) if was is not None else QueueStatus()
    q.workload = workload.name(p.name)
    if was is None or was.state != state:
        q.since = p.now
        evicted = ("Evicted", "Preempted")
        if state in evicted and (was is None or was.state not in evicted) and not (p.spec.suspend or q.deactivated):
            q.evictions += 1
        # the run's own deactivation (spec.suspend), not Kueue's: no event
        ours = (p.spec.suspend or q.deactivated) and (reason == "Inactive" or reason.startswith("Deactivated"))
        if state != "Finished" and not ours:
            p.event({"Queued": Reason.QUEUED, "Admitted": Reason.ADMITTED, "Evicted": Reason.EVICTED,
                     "Preempted": Reason.PREEMPTED}[state], f"Kueue: {reason}: {message}" if message else reason)
    q.state, q.reason, q.message = state, reason, message[:MESSAGE_MAX]
    q.cluster_queue = w.cluster_queue if w is not None else ""
    p.new.queue = q


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
