"""One level-based pass over a TrainingRun: observed state in, status patch and effects out. Pure.

The handler calls :func:`reconcile` with the run, its pods and the nodes they use, and executes
the returned effects in order. All memory lives in the run's status (trainium_api.status),
read into typed fields at the start of the pass and written back as the fields that changed,
so an operator that was killed and started again continues where it was:

  (new) -> Starting -> Running -> Succeeded
              ^  \\         |
              |   `---> Restarting (teardown, backoff) --> Failed (fatal / budget / guard)
              `----------------'

This module is the pass's skeleton; each policy lives in a module of its own, with its table of
tests beside it:
  judge, failure_policy  what failed, and the whole verdict: fail, or restart (kind, delay, the
                         node quarantined or avoided, the index replaced)
  restarts               applying the verdict, and seeing a restart through (in place, replace,
                         recreate; the barrier's watchdog)
  quarantine             the nodes a run leaves out, and its memory of machines
  spares                 warm standby pods
  progress_tracking      the gang's reports into the status; goodput
  suspension             spec.suspend
  store                  the checkpoint store as the pods report it
  reasons                every event reason and condition; run_pass: what a pass sees (Pass)

A pass is small steps: every pass records the spec's shape, the newest checkpoint and the
quarantine (:func:`_observe`), ensures the run's children, then exactly one phase step decides
(:func:`_phase_step`), then the spares are kept:
  _finished           Succeeded/Failed: stop what still runs
  suspension.suspend  spec.suspend: stop the gang;  suspension.resume: a new attempt once it is gone
  restarts.create     the first pass: children, then attempt 1
  restarts.teardown   Restarting: see the restart through, then start the next attempt
  _supervise          Starting/Preflight/Running: progress, recreate missing pods, ask the judge, succeed
Invariants: a new attempt's pods are created only after status records the attempt (the
handler writes the status before it runs the effects) and after every pod of other attempts is
gone, so two attempts never run at once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

from trainium_api import keys
from trainium_api.fields import ConfigError
from trainium_api.load import changed_fields, to_dict
from trainium_api.spec import INSTANCE_TYPES, TrainingRunSpec
from trainium_api.status import HELD, MAX_FAILURES_KEPT, TERMINAL, Disruption, TrainingRunStatus

from . import admission, inplace, plan, queueing, store
from .effects import DeletePod, Effect, Ensure, Event, PrunePreflightLists
from .judge import Clocks, Guards, Observed, judge
from .observe import GangState, NodeView, PodView, gang_state
from .observer import Snapshot, read_status, snapshot
from .progress_tracking import (account, gang_running, report_bad_progress, report_startup, track_progress,
                                watch_stragglers)
from .quarantine import kept_off, still_avoided, still_quarantined, under_repair
from .reasons import Cond, CondReason, Reason, report, was
from .restarts import act_on, create, order_start, standing, teardown
from .failure_policy import Budget
from .run_pass import NEWER_ATTEMPT_GRACE_SECONDS, Pass, condition, overdue
from .spares import keep_spares
from .stragglers import flagged
from .suspension import resume, suspend

__all__ = ["MAX_FAILURES_KEPT", "TERMINAL", "Effect", "Result", "reconcile", "reconcile_objects", "read_status"]


@dataclass
class Result:
    status: dict = field(default_factory=dict)
    """Merge patch for .status: the fields this pass changed."""
    effects: list[Effect] = field(default_factory=list)
    spec: TrainingRunSpec | None = None
    """The parsed spec, None while it is invalid."""
    after: TrainingRunStatus = field(default_factory=TrainingRunStatus)
    """The status as it is once the patch is written."""
    wake_at: float | None = None
    """A finished run's next change that time alone brings (an avoided node's window ending, a
    pod's graceful delete running out, a newer attempt's pod turning stale): its settled loop
    passes then, woken or not (None: none)."""

    @property
    def kinds(self) -> list[str]:
        return [e.kind for e in self.effects]

    @property
    def settled(self) -> bool:
        """A finished run's pass that changed nothing and asked for nothing: the run's loop then
        passes again only when something changes (one of its pods, their nodes, its Workload, or
        the run itself), not every second (finished runs cost nothing, however many are kept)."""
        return self.after.phase in TERMINAL and not self.effects and not self.status

    def ensured(self, kind: str = "Pod") -> list[dict]:
        """The objects of ``kind`` this pass makes sure of (children are ensured every pass)."""
        return [e.obj for e in self.effects if isinstance(e, Ensure) and e.obj["kind"] == kind]


def reconcile(snap: Snapshot) -> Result:
    """One pass over ``snap`` (observer.Snapshot): the status to write and the effects.
    Lost nodes and hangs are held while ``snap.disruption`` lasts (at most
    ``guard.max_hold_seconds``) and around an API outage (judge); ``snap.children_error`` is
    shown as the ChildrenCreated condition."""
    if snap.deleting:
        return Result()  # being deleted: the garbage collector removes the children; do not restart
    old, spec = snap.status, snap.spec
    new = working_copy(old)
    if spec is None:
        effects = _invalid_spec(old, new, snap.spec_error, snap.run["metadata"].get("generation"), snap.now)
        return Result(changed_fields(old, new), effects, None, new)
    name, uid = snap.run["metadata"]["name"], snap.run["metadata"].get("uid")
    # a spare is one the operator made for this run: its name, and the run as its controller
    # (a pod someone else labelled one is no spare, and no trainer identity reaches it)
    spares = [x for x in snap.pods if x.spare and plan.is_spare_name(name, x.name) and x.owner == uid]
    p = Pass(snap.run, spec, old, new, [x for x in snap.pods if not x.spare], snap.nodes, snap.now, snap.checkpoint,
             snap.disruption, snap.guard, snap.api_outage, snap.spec_error, snap.children_error, host=snap.host,
             spares=spares, workload=snap.workload, flavors=snap.flavors,
             children_error_since=snap.children_error_since, mass_event=snap.mass_event, gang_order=snap.gang_order,
             departed=snap.departed)
    if p.newer or inplace.ahead(p.gang + p.replacement, old.attempt, snap.gang_order):
        # this pass read a status older than the one that started them (or, in place, that
        # ordered their start): decide nothing
        return Result({}, [], spec, old, _time_brings(p))
    _observe(p)
    if old.phase not in TERMINAL:
        _children(p)
    _phase_step(p)(p)
    queueing.own(p)
    created_spares = keep_spares(p)
    if old.phase not in TERMINAL:  # after the step: the attempt it may have started is the one allowed
        also = ([p.new.current.replacement] if p.new.phase == "Restarting" and p.new.current.replacement else [])
        also += [x.name for x in p.spares if not x.deleting] + created_spares
        p.effects.append(Ensure(plan.trainer_role(p.run, spec, p.new.attempt, p.new.current.gang_attempt,
                                                  p.new.current.pod_names, also)))
    made = {e.obj["metadata"]["name"] for e in p.effects if isinstance(e, Ensure) and e.obj["kind"] == "ConfigMap"
            and keys.PREFLIGHT_LIST in e.obj["metadata"].get("labels", {})}
    if made:  # a new list: the ones no pod of the run mounts go (one object per list, not one per restart)
        p.effects.append(PrunePreflightLists(frozenset(made | {x.preflight_map for x in snap.pods if x.preflight_map})))
    return Result(changed_fields(old, new), p.effects, spec, new, _time_brings(p) if new.phase in TERMINAL else None)


def _time_brings(p: Pass) -> float | None:
    """When time alone next changes what a pass of this run decides (Result.wake_at)."""
    times = [a.time + Budget(p.spec).window_seconds for a in p.new.avoided_nodes]
    times += [x.gone_by for x in p.pods + p.spares if x.deleting and x.gone_by is not None]
    times += [x.created + NEWER_ATTEMPT_GRACE_SECONDS for x in p.pods
              if x.attempt > p.old.attempt and x.created is not None]
    # (one passed already changes nothing more: a pod Terminating past its deadline on a node that
    # does not answer would otherwise pass the run without pause)
    return min((t for t in times if t > p.now), default=None)


def reconcile_objects(run: dict, pods: list[PodView], nodes: dict[str, NodeView], now: float, **signals) -> Result:
    """reconcile(observer.snapshot(...)): one pass from API objects, for tests and benchmarks."""
    return reconcile(snapshot(run, pods, nodes, now, **signals))


def working_copy(old: TrainingRunStatus) -> TrainingRunStatus:
    """The status this pass edits. The steps replace fields and lists, and change only the
    newest failure record in place, so the records are copied and nothing else is (a deep copy
    of a 50-failure status was a third of a pass)."""
    new = copy.copy(old)
    new.current = copy.copy(old.current)
    new.failures = [copy.copy(f) for f in old.failures]
    return new


def _invalid_spec(old: TrainingRunStatus, new: TrainingRunStatus, err: ConfigError, generation: int | None,
                  now: float) -> list[Effect]:
    """Refuse the spec with the field named; a run that already started keeps its phase (its
    pods keep running on the spec they were started with)."""
    new.phase = "Failed" if not old.attempt else old.phase
    new.message, new.observed_generation = str(err), generation
    new.conditions = [condition(Cond.VALID, False, CondReason.INVALID_SPEC, str(err), now, old.conditions)]
    if old.message == str(err):
        return []
    return [Event(Reason.INVALID_SPEC, message=str(err), warning=True)]


def _refused_edit(p: Pass, err: ConfigError) -> None:
    """Valid=False naming the field; the run goes on with the spec in force."""
    message = f"{err}; the run goes on with the last valid spec.faultTolerance"
    report(p, Cond.VALID, False, CondReason.INVALID_EDIT, message, Reason.INVALID_EDIT, when="change")


def _observe(p: Pass) -> None:
    """Every pass: the spec's shape, the newest checkpoint, and which nodes are still quarantined
    (a node stays quarantined while it carries the taint; an admin removing it returns the node)."""
    spec, new = p.spec, p.new
    new.observed_generation = p.run["metadata"].get("generation")
    new.world_size = spec.world_size
    if spec.layout is not None:  # a command trainer's layout is its own
        new.data_parallel = spec.layout.data
    if p.refused is not None:
        _refused_edit(p, p.refused)
    else:
        new.fault_tolerance_in_force = to_dict(spec.fault_tolerance, older_words=True)  # an older operator reads it back
        if not any(c.type == Cond.VALID and c.status == "True" for c in p.old.conditions):
            shape = (f"data parallel {spec.layout.data}" if spec.layout is not None else
                     f"command trainer, progress format {spec.trainer.progress_format}, checkpoint layout "
                     f"{spec.trainer.layout}")
            p.condition(Cond.VALID, True, CondReason.SPEC_VALID, f"world size {spec.world_size}, {shape}")
    completed = store.advances(p.checkpoint, p.old.last_checkpoint, spec, p.pods)
    if completed:
        new.last_checkpoint = p.checkpoint
    store.observe(p, completed)
    still_quarantined(p)
    still_avoided(p)
    under_repair(p)
    # left over from an attempt whose teardown an earlier operator did not finish (forced again
    # once a graceful delete has run out: its node may no longer answer)
    p.effects += [DeletePod(x.name, 0) for x in p.stale if not x.deleting or overdue(p, x)]


def _children(p: Pass) -> None:
    """Every pass of a live run, suspended included: the children its pods need (the headless
    Service, the ConfigMap, the trainer's ServiceAccount and RBAC, the admission policy, the
    PodDisruptionBudget), so a
    create that failed, or a child someone deleted, is made again. The handler's applier
    creates what is missing; the effects come before any pod's. (The trainer's Role is ensured
    after the phase step: it names the pods of the attempt that step may start.)"""
    spec = p.spec
    p.effects += [Ensure(o) for o in plan.trainer_identity_objects(
        p.run, spec, p.host.trainer_account_metadata(p.run["metadata"]["namespace"]))]
    if spec.own_trainer_identity:
        p.effects += [Ensure(o) for o in admission.trainer_policy()]
    p.effects.append(Ensure(plan.service(p.run)))
    if spec.resources == "DRA" and INSTANCE_TYPES[spec.instance_type]["neuron"]:
        p.effects.append(Ensure(plan.claim_template(p.run, spec)))
    if spec.fault_tolerance.do_not_disrupt:
        p.effects.append(Ensure(plan.disruption_budget(p.run, spec)))
    if not spec.trainer.is_command:
        p.effects.append(Ensure(plan.config_map(p.run, spec)))
    before, error = was(p, Cond.CHILDREN_CREATED), p.children_error
    if error:
        report(p, Cond.CHILDREN_CREATED, False, CondReason.CREATE_FAILED, error, Reason.CREATE_FAILED,
               f"{error}; retrying")
    elif before is not None and before.status != "True":
        p.condition(Cond.CHILDREN_CREATED, True, CondReason.CREATED, "")


def _phase_step(p: Pass) -> Callable[[Pass], None]:
    phase = p.old.phase
    if phase in TERMINAL:
        return _finished
    if p.spec.suspend or queueing.holds(p):
        return suspend
    if phase in HELD:
        return resume
    if p.old.attempt == 0:
        return create
    if phase == "Restarting":
        return teardown
    return _supervise


def _finished(p: Pass) -> None:
    p.delete([x for x in p.current if x.phase not in ("Succeeded", "Failed")])


def _supervise(p: Pass) -> None:
    """Starting, Preflight or Running: track progress, recreate pods an earlier operator did not create,
    detect failures, and see the gang through to Running and Succeeded."""
    spec, old, new = p.spec, p.old, p.new
    gang = gang_state(p.current)
    track_progress(p, gang)
    watch_stragglers(p)
    if old.current.gang_attempt and old.phase == "Starting" and not old.current.gang_running_time:
        order_start(p, old.attempt)  # an order that did not land is written again
    elif old.phase == "Starting" and not old.current.gang_running_time and len(p.current) < spec.nodes \
            and not any(x.deleting for x in p.current):
        have = {x.index for x in p.current}  # an earlier operator stopped while creating the gang,
        p.effects += [Ensure(plan.pod(p.run, spec, old.attempt, i, kept_off(new),  # or the API server refused some
                                      p.host, old.current.preflight_trusted))
                      for i in range(spec.nodes) if i not in have]
        p.effects += [Ensure(o) for o in plan.with_list(p.run, spec, old.current.preflight_trusted)]
        _act(p, gang, complete=False)
        return
    report_startup(p)
    report_bad_progress(p)
    if _act(p, gang):
        return
    if gang.succeeded == spec.nodes:
        new.phase = "Succeeded"
        new.message = f"all {spec.nodes} pods finished at step {gang.step}"  # not the last restart's reason
        p.event(Reason.SUCCEEDED, new.message)
        # the run's wall time ends with its last step (the trainer's clock), not with detection
        account(p, min(p.now, gang.last_progress_time or p.now))
        return
    if gang.running == spec.nodes:
        gang_running(p, gang)
    account(p, p.now)


def _act(p: Pass, gang: GangState, complete: bool = True) -> bool:
    """Ask the judge for the whole verdict; record a disruption's start and end; apply the
    failure's action (restarts.act_on). Returns whether the attempt failed."""
    seen = Observed(p.spec, gang, p.nodes, p.now, gang_complete=complete, children_error=p.children_error,
                    children_error_since=p.children_error_since, departed=tuple(p.gone))
    counted = standing(p)
    verdict = judge(seen, Clocks.of(p.old, p.new.current.last_step_time, tuple(flagged(p.new.current.stragglers))),
                    Guards(p.guard, p.disruption, p.api_outage, p.mass_event), counted)
    _record_disruption(p, verdict.disruption)
    if verdict.failure:
        act_on(p, verdict, counted, gang)
        return True
    return False


def _record_disruption(p: Pass, now_in_force: Disruption | None) -> None:
    held = p.old.disruption
    if held and not now_in_force:
        p.new.disruption, p.new.disruption_end_time = None, p.now
        report(p, Cond.DISRUPTED, False, CondReason.NODES_RETURNED, "", Reason.DISRUPTION_ENDED,
               f"nodes are back after {p.now - held.since:.0f}s; normal failure handling again", warning=False,
               when="always")
    elif now_in_force and not held:
        p.new.disruption = now_in_force
        report(p, Cond.DISRUPTED, True, CondReason.MASS_DISRUPTION, now_in_force.message, Reason.DISRUPTION,
               f"{now_in_force.message}: "
               + ("" if now_in_force.mass else "a control-plane or network disruption, not node failures; ") +
               f"no quarantine and no restart for up to {p.guard.max_hold_seconds:.0f}s", warning=True, when="always")
