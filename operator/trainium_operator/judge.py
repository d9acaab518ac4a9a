"""Is this a failure now? The one place that answers it. Pure.

:func:`judge` takes what a pass observed of the current attempt (its pods summarised, their
nodes, the children the applier could not create), the clocks the status keeps (when the gang
started, when its step last moved, a disruption in progress) and the operator-wide guards (the
mass-disruption finding, the last API outage), and returns a :class:`Verdict`: the failure to
act on, or why a failure signal is held for now, and the disruption in force after this pass;
given the run's standing (failure_policy.Standing), the failure's verdict carries the action
too: fail, or restart with its kind and delay, the node quarantined or avoided, the index
replaced (failure_policy, its rules in order). Every failure rule lives here, in this order:

  unborn      pods that could not be created by scheduleTimeoutSeconds   -> scheduling
  fatal       a pod exited with a fatal code (no retry)                  -> application, fatal
  node        a pod's node deleted, NotReady or Unknown; or the EKS node
              monitoring agent's KernelReady, ContainerRuntimeReady,
              NetworkingReady or StorageReady False                      -> node
  device      a Neuron hardware condition (NeuronHealth True from the Neuron
              node problem detector, AcceleratedHardwareReady False from the
              EKS node monitoring agent: nodesignals); allocatable below capacity for longer
              than guard.device_settle_seconds (a device-plugin restart
              re-registers its devices within seconds)                   -> neuron-device
  runtime     a failed pod's termination message says the Neuron runtime
              reported a hardware fault (trainer.pod.launch wrote it)   -> neuron-device
  preflight   a pod exited PREFLIGHT: the pre-flight check named its node   -> preflight
  exit        a pod failed (evicted: its own reason wins); a pod that
              only lost a peer is blamed last                           -> application | eviction
  vanished    a pod deleted or missing                                    -> eviction
  drain       a pod's node about to be terminated (a termination notice taint:
              Karpenter's, a Spot interruption's); or cordoned, with the
              run's PodDisruptionBudget holding the drain's eviction     -> eviction, voluntary
              (an eviction through the API, or the scheduler's preemption,
              found by the exit rule, is voluntary too: no budget is spent)
  hang        no first step startupTimeoutSeconds after the gang ran, or
              no step change for the hang timeout                        -> hang
  startup     a pod placed on a node that has not started its container
              startupTimeoutSeconds after it was placed                  -> startup
  scheduling  pods unscheduled for scheduleTimeoutSeconds                -> scheduling
              (the scheduler found no room: capacity, released and tried again, no budget)
  straggler   with faultTolerance.stragglers Replace, and nothing above: a pod
              flagged by stragglers.update                               -> straggler
Holds (a signal that is not acted on yet, with why and until when):
  settle      a node Unknown for less than guard.settle_seconds (it may be the first of a
              disruption); a node NotReady as long, while the gang shows no loss (it may be the
              first of a mass event: a container runtime restart); a Neuron device shortfall for
              less than guard.device_settle_seconds
  outage      a node that went Unknown around an API outage (its lease could not be renewed)
  culprit     every failed pod only lost a peer while others still run: wait
              guard.culprit_wait_seconds for the one that names the fault
  disruption  lost nodes and hangs while a mass disruption lasts (guard.max_hold_seconds);
              NotReady nodes and missing Neuron devices too while a mass event lasts (many
              nodes turned so within guard.mass_window_seconds: mass_events)
The hang clock restarts at the end of a disruption and of an API outage (progress could not
reach us meanwhile).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainium_api import exitcodes, runtimefaults
from trainium_api.exitcodes import PREFLIGHT as PREFLIGHT_EXIT
from trainium_api.exitcodes import is_fatal as is_fatal_exit
from trainium_api.spec import TrainingRunSpec
from trainium_api.status import Disruption, StragglerStreak, TrainingRunStatus

from .disruption_guard import DISRUPTION_CAUSES, DisruptionGuard
from .failure_policy import Action, Standing, act, replaceable_stragglers
from .observe import (EVICTION_REASONS, VOLUNTARY_REASONS, Failure, GangState, NodeView, PodView, draining,
                      not_started, succeeded, terminating)


STARTING = ("ContainerCreating", "PodInitializing")
"""A placed pod's waiting reasons on its way to start (an image pulled, init containers running),
as opposed to one stuck (ErrImagePull, CreateContainerConfigError, ...: the startup rule's)."""
CONTENTION = ("Insufficient ", "Too many pods")
"""The scheduler's words for nodes that would fit the pod but are taken (kube-scheduler's
NodeResourcesFit and pod-count reasons): a wait for capacity, not a spec no node matches."""


@dataclass(frozen=True)
class Hold:
    """A failure signal not acted on yet."""
    reason: str
    until: float | None = None
    """When it stops holding at the latest (None: when the signal or the disruption ends)."""


@dataclass(frozen=True)
class Clocks:
    """The status's clocks the rules read."""
    attempt_start_time: float | None = None
    gang_running_time: float | None = None
    step_seconds: float | None = None
    last_step_time: float | None = None
    """When the operator saw the step move (this pass's, when it moved now)."""
    disruption: Disruption | None = None
    """A disruption in force when the pass began."""
    disruption_end_time: float | None = None
    quarantined: tuple[str, ...] = ()
    stragglers: tuple[StragglerStreak, ...] = ()
    """Pods flagged as stragglers now (stragglers.update, this pass); with the run's standing,
    judge acts only on those the gang may be restarted for (failure_policy.replaceable_stragglers)."""

    @classmethod
    def of(cls, status: TrainingRunStatus, last_step_time: float | None,
           stragglers: tuple[StragglerStreak, ...] = ()) -> "Clocks":
        # (the nodes the run left out, avoided ones too: none of them is coming back to it)
        return cls(status.current.start_time, status.current.gang_running_time, status.step_seconds, last_step_time,
                   status.disruption, status.disruption_end_time, tuple(status.kept_off_names), stragglers)


@dataclass(frozen=True)
class Guards:
    """Operator-wide signals: ``disruption`` is disruption_guard.disruption's finding now ("" for none);
    ``api_outage`` is (lost, back) of the last API outage (back = now while it lasts)."""
    guard: DisruptionGuard = field(default_factory=DisruptionGuard)
    disruption: str = ""
    api_outage: tuple[float, float] | None = None
    mass: bool = False
    """``disruption`` is a mass event's (mass_events): it holds NotReady nodes, missing devices
    and hangs only, never a node deleted or named faulty."""


@dataclass(frozen=True)
class Observed:
    spec: TrainingRunSpec
    gang: GangState
    nodes: dict[str, NodeView]
    now: float
    gang_complete: bool = True
    """False while the attempt's pods are still being created (some never were yet)."""
    children_error: str = ""
    children_error_since: float | None = None
    """Since when the API server has refused the same way (the applier's ChildCache)."""
    departed: tuple[PodView, ...] = ()
    """The last view of the gang's pods gone before this pass saw them deleting (departures.py):
    none of them among ``gang.pods``."""


@dataclass(frozen=True)
class Verdict:
    """The whole verdict: the failure to act on and what to do about it, or why a signal is held."""
    failure: Failure | None = None
    hold: Hold | None = None
    disruption: Disruption | None = None
    """The disruption in force after this pass (None: none)."""
    action: Action | None = None
    """With a failure, and the run's standing given: fail, or restart with its kind, delay, the
    node quarantined or avoided and the index replaced (failure_policy)."""



def judge(seen: Observed, clocks: Clocks, guards: Guards, standing: Standing | None = None) -> Verdict:
    """The verdict on the attempt ``seen``; with ``standing`` (the run's failures so far, the
    nodes it leaves out, the gang as it is), a failure's verdict carries its action, and only the
    stragglers the straggler budget and the node limit allow are acted on."""
    if standing is not None:
        clocks = replace(clocks, stragglers=replaceable_stragglers(seen.spec, standing, clocks.stragglers, seen.now))
    verdict = _judge(seen, clocks, guards)
    if verdict.failure is None or standing is None:
        return verdict
    return replace(verdict, action=act(verdict.failure, seen.spec, standing, seen.now,
                                       guards.guard.trust_pod_reports))


def _judge(seen: Observed, clocks: Clocks, guards: Guards) -> Verdict:
    if not seen.gang_complete:
        return Verdict(_unborn(seen, clocks), disruption=clocks.disruption)
    last_change = max(clocks.last_step_time or 0.0, clocks.disruption_end_time or 0.0,
                      outage_end(guards, seen.now)) or None
    failure, hold = find_failure(seen.spec, seen.gang, seen.nodes, now=seen.now, expected_pods=seen.spec.nodes,
                                 gang_running_since=clocks.gang_running_time, step_seconds=clocks.step_seconds,
                                 last_step_change=last_change, device_settle=guards.guard.device_settle_seconds,
                                 culprit_wait=guards.guard.culprit_wait_seconds, departed=seen.departed)
    if failure is None and hold is None and clocks.stragglers and seen.spec.fault_tolerance.stragglers == "Replace":
        s = max(clocks.stragglers, key=lambda x: x.ratio or 0.0)  # the slowest: a TP partner waits on it
        failure = Failure("straggler", f"pod {s.pod} on node {s.node} is a straggler: its compute time per step was "
                          f"{s.ratio:g}x the other pods' median in {s.reports} reports in a row", node=s.node,
                          pod=s.pod, since=s.flagged_time, pod_reported=True)
    return _hold(seen, clocks, guards, failure, hold)


ADMISSION_DENIALS = ("denied request", "denied the request", "violates PodSecurity")
"""The API server's words when an admission policy refuses an object (a ValidatingAdmissionPolicy,
an admission webhook, Pod Security admission): the same pod is refused every time. Not a
ResourceQuota's "exceeded quota", which frees up, nor a webhook that could not be called."""
ADMISSION_DENIAL_SECONDS = 20.0
"""How long the gang's pods must have been refused so, from the first refusal in a row, before the run
fails (the pass re-creates them every second or so): a webhook that denies once for a passing
reason (a registry's 429 in an image check, a cache that has not seen the trainer's new
ServiceAccount) lets them through within it."""


def _unborn(seen: Observed, clocks: Clocks) -> Failure | None:
    """Pods the API server would not create: refused by an admission policy still after
    ADMISSION_DENIAL_SECONDS, a fatal failure, with the policy's words (a namespace that
    requires Kueue's queue label, PodSecurity);
    otherwise (a quota, a webhook that is down) a scheduling failure once the attempt has waited
    scheduleTimeoutSeconds for them."""
    waited = seen.now - (clocks.attempt_start_time if clocks.attempt_start_time is not None else seen.now)
    refused_for = seen.now - (seen.children_error_since if seen.children_error_since is not None else seen.now)
    refusal = next((part.strip() for part in seen.children_error.split("; ")
                    if part.startswith("cannot create Pod ") and "-spare-" not in part.split(":", 1)[0]
                    and any(w in part for w in ADMISSION_DENIALS)), "")
    if refusal and refused_for >= ADMISSION_DENIAL_SECONDS:
        return Failure("scheduling", f"an admission policy refuses the run's pods: {refusal}", fatal=True)
    if waited <= seen.spec.fault_tolerance.schedule_timeout_seconds:
        return None
    return Failure("scheduling", f"{seen.spec.nodes - seen.gang.size} pod(s) not created {waited:.0f}s after the "
                   f"attempt started: {seen.children_error or 'no reason given'}")


def outage_end(guards: Guards, now: float) -> float:
    """When the API outage that holds the hang clock ended (now while it lasts); 0 when there
    was none, or when it was a blip shorter than guard.outage_min_seconds (progress reports that
    failed in it are sent again within a second or two)."""
    if guards.api_outage is None:
        return 0.0
    began, ended = guards.api_outage
    return ended if ended >= now or ended - began >= guards.guard.outage_min_seconds else 0.0


def hang_timeout(spec: TrainingRunSpec, step_seconds: float | None) -> float:
    ft = spec.fault_tolerance
    if ft.hang_timeout_seconds != "auto":
        return float(ft.hang_timeout_seconds)
    if not step_seconds:
        return ft.hang_timeout_floor_seconds
    return max(ft.hang_timeout_floor_seconds, ft.hang_timeout_factor * step_seconds)


def find_failure(spec: TrainingRunSpec, gang: GangState, nodes: dict[str, NodeView], *, now: float,
                 expected_pods: int, gang_running_since: float | None, step_seconds: float | None,
                 last_step_change: float | None, device_settle: float = 0.0,
                 culprit_wait: float = 0.0,
                 departed: tuple[PodView, ...] = ()) -> tuple[Failure | None, Hold | None]:
    """The most specific failure in the current attempt, or None, and a signal held back from
    being one. Order: a fatal exit first (no retry), then hardware and node signals (so the bad
    node is quarantined rather than blaming the rank that died with it), then crashed ranks,
    vanished pods, hangs, pods that never start and scheduling."""
    ft, hold = spec.fault_tolerance, None
    for p in gang.pods:
        if p.phase == "Failed" and is_fatal_exit(p.exit_code):
            return Failure("application", f"pod {p.name} exited {p.exit_code} (fatal: {p.message or p.reason})",
                           node=p.node or "", pod=p.name, fatal=True, exit_code=p.exit_code, since=p.finished), None
    soft: Failure | None = None  # a fleet symptom: another node's hard fault is named before it
    for p in gang.pods:
        if not p.node:
            continue
        n = nodes.get(p.node)
        if n is None:
            return Failure("node", f"node {p.node} of pod {p.name} was deleted", node=p.node, pod=p.name), None
        if n.neuron_error:
            return Failure("neuron-device", f"node {p.node}: {n.neuron_error}", node=p.node, pod=p.name,
                           since=n.changed), None
        if n.neuron_short:
            since = n.neuron_short_since if n.neuron_short_since is not None else now
            if now - since >= device_settle:
                soft = soft or Failure("neuron-device", f"node {p.node}: {n.neuron_allocatable}/{n.neuron_capacity} "
                                       "Neuron devices allocatable", node=p.node, pod=p.name, since=since,
                                       fleet_symptom=True)
            else:
                hold = hold or Hold(f"node {p.node}: {n.neuron_allocatable}/{n.neuron_capacity} Neuron devices "
                                    "allocatable, settling (a device-plugin restart)", since + device_settle)
        if n.node_error:  # the EKS node monitoring agent: a kernel, runtime or network fault
            return Failure("node", f"node {p.node}: {n.node_error}", node=p.node, pod=p.name, since=n.changed), hold
        lost_since = n.ready_changed if n.ready_changed is not None else n.changed
        if n.ready == "False":
            soft = soft or Failure("node", f"node {p.node} is NotReady", node=p.node, pod=p.name, since=lost_since,
                                   fleet_symptom=True)
        elif n.ready != "True":
            return Failure("node", f"node {p.node} is unreachable", node=p.node, pod=p.name, since=lost_since), hold
    failed = [p for p in gang.pods if p.phase == "Failed" and not succeeded(p)]
    culprit = next(iter(device_culprits(failed)), None)
    if soft is not None and culprit is None:
        # a fleet symptom (held in a mass event) names no fault of its own: a node about to be
        # terminated, or one the runtime named, goes first
        noticed = next((p for p in gang.pods if p.node in nodes and p.phase != "Succeeded"
                        and terminating(nodes[p.node])), None)
        return (_notice(noticed, nodes) if noticed else soft), hold
    if culprit:  # the node whose rank the runtime named, not the first pod that noticed
        kind = culprit.runtime_fault.kind
        return Failure("node" if kind == "network" else "neuron-device",
                       f"pod {culprit.name} on node {culprit.node} failed: exit {culprit.exit_code}; {culprit.message}",
                       node=culprit.node or "", pod=culprit.name, exit_code=culprit.exit_code, since=culprit.finished,
                       pod_reported=True, runtime_status=culprit.runtime_fault.status,
                       repairable=kind == "repairable"), hold
    # 76 counts as the check's verdict only while the check can run: preflight in force, the
    # attempt not training yet, the reason in the message (a training worker's 76 is a crash)
    checked = next((p for p in failed if p.exit_code == PREFLIGHT_EXIT and p.preflight_failure
                    and spec.preflight_on() and gang.step is None), None)
    if checked:  # the pre-flight check named this pod's node (the others wait to be stopped)
        return Failure("preflight", f"pod {checked.name} on node {checked.node} failed the pre-flight check: "
                       f"{checked.preflight_failure or checked.message or 'no reason given'}", node=checked.node or "",
                       pod=checked.name, exit_code=checked.exit_code, since=checked.finished, pod_reported=True), hold
    if failed:
        blamed = [p for p in failed if not (p.runtime_fault and p.runtime_fault.kind == "peer")]
        if not blamed:
            # since the first of them finished (a pod with no finish time holds nothing: the
            # wait must end even when the kubelet did not say when)
            first = min((p.finished for p in failed if p.finished is not None), default=None)
            running = [p for p in gang.pods if p.phase == "Running" and not p.deleting]
            if running and first is not None and 0 <= now - first < culprit_wait:  # (a node clock ahead holds nothing)
                return None, hold or Hold(f"pod {failed[0].name} lost a peer ({failed[0].message}): waiting for the "
                                          "pod that caused it", first + culprit_wait)
            blamed = failed
        p = blamed[0]
        # a store that stayed down past the pod's retries: its own cause, not the job's
        store = p.exit_code == exitcodes.RETRYABLE and p.store_unavailable
        cause = "eviction" if p.reason in EVICTION_REASONS else "store" if store else "application"
        note = ("; the runtime asks only for a new process: the node is kept"
                if p.runtime_fault and p.runtime_fault.kind == "restart" else "")
        voluntary = p.reason in VOLUNTARY_REASONS
        note += "; a voluntary disruption: the gang moves, no budget is spent" if voluntary else ""
        return Failure(cause, f"pod {p.name} failed: exit {p.exit_code} {p.reason} {p.message}".strip() + note,
                       node=p.node or "", pod=p.name, exit_code=p.exit_code, since=p.finished,
                       voluntary=voluntary), hold
    deleting = [p for p in gang.pods if p.deleting]
    if deleting or len(gang.pods) < expected_pods:
        # a pod already gone: its last view, when the watcher saw it on its way out (departed)
        missing = expected_pods - len(gang.pods)
        deleting += departed
        who = ", ".join(p.name for p in deleting) if deleting else f"{missing} pod(s)"
        node = deleting[0].node or "" if deleting else ""
        # an eviction through the API or the scheduler's preemption marks the pod (DisruptionTarget)
        # before its graceful delete: voluntary, as when it is seen Failed
        # (so is one deleted on a node with a termination notice: a NoExecute notice taint's
        # eviction by the taint manager); every pod deleting or missing must have been moved so
        voluntary = bool(deleting) and len(departed) >= missing and all(
            p.reason in VOLUNTARY_REASONS or bool(p.node and p.node in nodes and terminating(nodes[p.node]))
            for p in deleting)
        return Failure("eviction", f"{who} deleted or evicted from outside the operator"
                       + (f" ({deleting[0].reason or 'its node is to be terminated'}: a voluntary disruption, no "
                          "budget is spent)" if voluntary else ""),
                       node=node, pod=deleting[0].name if deleting else "", voluntary=voluntary), hold
    # a node about to be terminated (a Spot interruption's notice, Karpenter's disruption): the
    # gang moves off it now, at a save, before the node goes. A node only cordoned, with the
    # run's disruption budget (doNotDisrupt): without it a drain evicts the pod itself
    # (voluntary, above), and a node merely cordoned leaves the gang where it is
    moving = next((p for p in gang.pods if p.node and p.node in nodes and p.phase != "Succeeded"  # (a rank done holds nothing)
                   and (terminating(nodes[p.node]) or (ft.do_not_disrupt and draining(nodes[p.node])))), None)
    if moving is not None:  # before the drain can evict it, or the node goes: the gang moves once, at a save
        return _notice(moving, nodes), hold
    # ranks that finished (exit 0) while others still run count with the running: a rank hung
    # in its last save or barrier must not hold the run forever
    if gang_running_since is not None and gang.running and gang.running + gang.succeeded == expected_pods:
        if gang.step is None:
            # the clock restarts after an API outage or a disruption, before the first step too
            since = max(gang_running_since, last_step_change or 0.0)
            if now - since > ft.startup_timeout_seconds:
                return Failure("hang", f"no progress {now - gang_running_since:.0f}s after the gang started"), hold
        else:
            since = last_step_change or gang_running_since
            limit = hang_timeout(spec, step_seconds)
            if now - since > limit:
                return Failure("hang", f"no step progress for {now - since:.0f}s (timeout {limit:.0f}s) at step "
                               f"{gang.step}"), hold
    waiting_to_start = not_started(gang.pods)
    stuck = next((p for p in waiting_to_start if now - p.scheduled > ft.startup_timeout_seconds), None)
    if stuck:  # one pod that never starts holds every other node of the gang: act on it
        return Failure("startup", f"pod {stuck.name} on node {stuck.node} has not started "
                       f"{now - stuck.scheduled:.0f}s after it was placed: {stuck.waiting or 'no reason given'}",
                       node=stuck.node or "", pod=stuck.name,
                       since=stuck.scheduled + ft.startup_timeout_seconds), hold
    pending = [p for p in gang.pods if not p.node and p.created]
    if pending and now - min(p.created for p in pending) > ft.schedule_timeout_seconds:
        why = next((p.unschedulable for p in pending if p.unschedulable), "")
        # the scheduler found no room (others hold it): a gang is placed whole or not at all,
        # released and tried again. Not when nothing would ever place it (a selector or a taint
        # no node matches, a claim that never binds: those spend the budget), nor while a placed
        # pod is stuck before its start (the startup rule names that)
        capacity = any(word in why for word in CONTENTION) and not any(
            p.waiting and not p.waiting.startswith(STARTING) for p in waiting_to_start)
        return Failure("scheduling", f"{len(pending)} of {spec.nodes} pod(s) unscheduled for "
                       f"{ft.schedule_timeout_seconds:.0f}s: {why or 'not scheduled'}", capacity=capacity), hold
    return None, hold


def _notice(moving: PodView, nodes: dict[str, NodeView]) -> Failure:
    """The voluntary move off ``moving``'s node: about to be terminated, or drained."""
    notice = terminating(nodes[moving.node])
    why = f"is to be terminated ({notice} taint)" if notice else "is being drained (cordoned)"
    return Failure("eviction", f"node {moving.node} of pod {moving.name} {why}: the gang moves off it, "
                   "stopping at a save (a voluntary disruption: no budget is spent)",
                   node=moving.node, pod=moving.name, voluntary=True)


def gang_hurt(gang: GangState, expected_pods: int) -> bool:
    """The gang shows a loss: a pod failed (its workers exited), is being deleted, or is missing."""
    return len(gang.pods) < expected_pods or any(
        p.deleting or (p.phase == "Failed" and not succeeded(p)) for p in gang.pods)


def device_culprits(pods: list[PodView]) -> list[PodView]:
    """Failed pods whose termination message carries the Neuron runtime's report of a fault of
    their node (trainium_api.runtimefaults.NODE_KINDS: its hardware, its network path, a
    repairable memory error). Also read in teardown, for a culprit whose runtime timed out after
    its peers' failure was acted on."""
    found = [p for p in pods if p.phase == "Failed" and p.node and p.runtime_fault is not None
             and p.runtime_fault.kind in runtimefaults.NODE_KINDS]
    # the most serious first (runtimefaults.KINDS): a rank with an HBM error over one whose
    # network proxy failed when that rank died
    return sorted(found, key=lambda p: runtimefaults.KINDS.index(p.runtime_fault.kind))


def _hold(seen: Observed, clocks: Clocks, guards: Guards, failure: Failure | None,
          hold: Hold | None) -> Verdict:
    """The failure to act on: none while a disruption holds it (a lost node or a hang, for at
    most guard.max_hold_seconds), while a node that went Unknown may still turn out to be the
    first of a disruption (guard.settle_seconds), or while a node is Unknown because its lease
    lapsed during an API server outage (one of at least guard.outage_min_seconds, and it went
    Unknown from the outage's start to guard.outage_grace_seconds after its end)."""
    guard, now, api_outage, disruption = guards.guard, seen.now, guards.api_outage, guards.disruption
    lost = seen.nodes.get(failure.node) if failure and failure.cause == "node" else None
    if lost is not None and failure.fleet_symptom and failure.since and now - failure.since < guard.settle_seconds \
            and not gang_hurt(seen.gang, seen.spec.nodes):
        # a kubelet that says NotReady is alive: its containers may well run on (a container
        # runtime restart, which a fleet-wide push does to many nodes within seconds). While the
        # gang shows no loss, wait for the mass event to show; a node whose ranks died is acted on
        failure, hold = None, Hold(f"node {lost.name} NotReady for {now - failure.since:.0f}s while the gang's pods "
                                   "run on: it may be the first of a mass event", failure.since + guard.settle_seconds)
    elif lost is not None and lost.ready == "Unknown" and not lost.node_error and failure.since:
        if now - failure.since < guard.settle_seconds:
            failure, hold = None, Hold(f"node {lost.name} Unknown for {now - failure.since:.0f}s: it may be the "
                                       "first of a disruption", failure.since + guard.settle_seconds)
        elif (api_outage is not None and api_outage[1] - api_outage[0] >= guard.outage_min_seconds
              and api_outage[0] <= failure.since <= api_outage[1] + guard.outage_grace_seconds
              and now - failure.since < guard.max_hold_seconds):
            failure, hold = None, Hold(f"node {lost.name} went Unknown around an API server outage: its lease "
                                       "could not be renewed", failure.since + guard.max_hold_seconds)
    held = clocks.disruption
    if held and not disruption:
        # nodes come back one by one: the disruption lasts until every node it took is back
        # (a node lost after its wave is a failure of its own)
        wave_end = held.since + guard.settle_seconds
        behind = [n for n in seen.nodes.values() if n.name not in clocks.quarantined  # (not coming back)
                  and ((n.ready != "True" and (n.changed or 0.0) <= wave_end)
                       or (n.neuron_short and (n.neuron_short_since or 0.0) <= wave_end))]
        if behind:
            disruption = f"{held.message}; {len(behind)} of the run's nodes not back yet"
    if not disruption:
        if held and failure and failure.cause == "hang":
            # progress could not reach us during the disruption: the hang clock restarts now,
            # not at the last step seen before it (found by the control-plane e2e test: the
            # operator's watches resumed 11 s after the API, and the gang was restarted in the
            # very pass that saw the nodes return)
            return Verdict(None, Hold("the disruption just ended: the hang clock restarts"), None)
        return Verdict(failure, hold, None)
    in_force = held or Disruption(since=now, message=disruption, mass=guards.mass or None)
    if failure is None:
        return Verdict(None, hold, in_force)
    # a mass event holds its own symptoms and hangs; nodes lost together hold every lost node
    holds = (failure.fleet_symptom or failure.cause == "hang") if in_force.mass else \
        (failure.cause in DISRUPTION_CAUSES or failure.fleet_symptom)
    if holds and now - in_force.since < guard.max_hold_seconds:
        return Verdict(None, Hold(f"{failure.message}: held during a disruption ({disruption})",
                                    in_force.since + guard.max_hold_seconds), in_force)
    return Verdict(failure, hold, in_force)
