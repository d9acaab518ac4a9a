"""One level-based pass over a TrainingRun: observed state in, status patch and effects out. Pure.

The handler calls :func:`reconcile` with the run, its pods and the nodes they use, and executes
the returned effects in order. All memory lives in the run's status (trainium_api.status),
read into typed fields at the start of the pass and written back as the fields that changed,
so an operator that was killed and started again continues where it was:

  (new) -> Starting -> Running -> Succeeded
              ^  \\         |
              |   `---> Restarting (teardown, backoff) --> Failed (fatal / budget / guard)
              `----------------'

A pass is small steps: every pass records the spec's shape, the newest checkpoint and the
quarantine (:func:`_observe`), then exactly one phase step decides (:func:`_phase_step`):
  _finished    Succeeded/Failed: stop what still runs
  _suspend     spec.suspend: stop the gang;  _resume: start a new attempt once it is gone
  _create      the first pass: children, then attempt 1
  _teardown    Restarting: delete the failed attempt, wait for it to be gone and the backoff
               to pass, then start the next attempt
  _supervise   Starting/Preflight/Running: progress, recreate missing pods, detect failures, succeed
Invariants: a new attempt's pods are created only after status records the attempt (the
handler writes the status before it runs the effects) and after every pod of other attempts is
gone, so two attempts never run at once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from functools import cached_property
from datetime import datetime, timezone
from typing import Callable

from trainium_api import keys
from trainium_api.fields import ConfigError
from trainium_api.load import changed_fields, to_dict
from trainium_api.spec import TrainingRunSpec
from trainium_api.status import (MAX_FAILURES_KEPT, TERMINAL, AttemptStatus, AvoidedNode, CheckpointRef, Condition,
                                 QuarantinedMachine,
                                 Disruption, PreflightPass,
                                 FailureRecord, StragglerStreak, Suspension, TrainingRunStatus)

from trainium_api.agent import Order

from . import admission, goodput, inplace, plan, store, stragglers
from .effects import DeletePod, Effect, Ensure, Event, ObserveFailure, ObserveRecovery, OrderPod, Quarantine
from .hostaccess import HostAccess
from .judge import Clocks, Guards, Observed, device_culprits, judge
from .observe import (STARTING_REASONS, Failure, GangState, NodeView, PodView, gang_state, not_started, slowest_source,
                      waiting_reason)
from .observer import Snapshot, read_status, snapshot
from .policy import DisruptionGuard, count, counters_from, decide, straggler_replace_allowed
from .stragglers import flagged

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

    @property
    def kinds(self) -> list[str]:
        return [e.kind for e in self.effects]

    def ensured(self, kind: str = "Pod") -> list[dict]:
        """The objects of ``kind`` this pass makes sure of (children are ensured every pass)."""
        return [e.obj for e in self.effects if isinstance(e, Ensure) and e.obj["kind"] == kind]


NEWER_ATTEMPT_GRACE_SECONDS = 60.0
QUARANTINE_SETTLE_SECONDS = 60.0
"""How long a quarantined node not yet seen tainted may be missing from the node cache."""
QUARANTINE_RETRY_SECONDS = 300.0
"""How long a taint that cannot be written (a policy engine refusing it) is ordered again; the
run's own pods stay off the node by their affinity either way."""
QUARANTINE_REMEMBER_SECONDS = 86400.0
"""How long the machine behind a quarantined node whose Node object went is remembered: the
same machine registering again under the name within that time is quarantined again."""


@dataclass
class Pass:
    """What one pass sees (the run, its pods and nodes, the status as read: ``old``) and what it
    decides (``new``: the status to write, and the effects)."""
    run: dict
    spec: TrainingRunSpec
    old: TrainingRunStatus
    new: TrainingRunStatus
    pods: list[PodView]
    nodes: dict[str, NodeView]
    now: float
    checkpoint: CheckpointRef | None
    disruption: str
    guard: DisruptionGuard
    api_outage: tuple[float, float] | None
    refused: ConfigError | None = None
    """An edit of the live run the operator's rules refuse: it goes on with the spec in force."""
    children_error: str = ""
    """Why the applier could not create a child or a pod in the last pass ("" when it could)."""
    effects: list[Effect] = field(default_factory=list)
    host: HostAccess = HostAccess()
    spares: list[PodView] = field(default_factory=list)
    """Standby pods (faultTolerance.spares) that have not taken an index: not the gang's."""

    @property
    def name(self) -> str:
        return self.run["metadata"]["name"]

    @cached_property
    def gang_names(self) -> list[str]:
        return inplace.gang_names(self.old, self.name, self.spec.nodes)

    @property
    def gang(self) -> list[PodView]:
        """The pods the attempt in force runs in, as they are (an in-place restart keeps the
        pods of an earlier attempt, a replaced index runs in its replacement: inplace.gang_names)."""
        names = set(self.gang_names)
        return [p for p in self.pods if p.name in names]

    @property
    def replacement(self) -> list[PodView]:
        """The pod taking the index being replaced (restart replace), while Restarting: a
        spare, or a new pod under the next attempt's name; it waits at the barrier."""
        name, index = self.old.current.replacement, self.old.current.replacing
        # a spare by name, or the index's pod of the next attempt: never another pod of the gang
        # (a status edited to name one)
        return [p for p in self.pods + self.spares if name and index is not None and p.name == name and (
            plan.is_spare_name(self.name, p.name) or (p.index == index and p.attempt == self.old.attempt + 1))]

    @cached_property
    def current(self) -> list[PodView]:
        """The gang as the attempt in force sees it: its agents' reports on this attempt's
        workers (inplace.as_of)."""
        return inplace.as_of(self.gang, self.old.attempt, self.old.current.start_time, self.now)

    @property
    def stale(self) -> list[PodView]:
        """Pods of other attempts. One of a newer attempt than the status read means this pass
        read the status before the write that started that attempt reached the watch: it is
        not stale unless it has lived for NEWER_ATTEMPT_GRACE_SECONDS (a status reset by hand)."""
        kept = self.gang + self.replacement
        return [p for p in self.pods if p not in kept and (p.attempt <= self.old.attempt or (
            self.now - (p.created or self.now) > NEWER_ATTEMPT_GRACE_SECONDS))]

    @property
    def newer(self) -> list[PodView]:
        return [p for p in self.pods if p.attempt > self.old.attempt and p not in self.stale
                and p not in self.replacement]

    @property
    def grace(self) -> int:
        return int(self.spec.fault_tolerance.teardown_grace_seconds)

    @property
    def last_failure(self) -> FailureRecord | None:
        """The newest failure on the status this pass writes (the one being restarted from)."""
        return self.new.failures[-1] if self.new.failures else None

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.effects.append(Event(reason, message, warning))

    def delete(self, pods: list[PodView], grace: int | None = None) -> None:
        self.effects += [DeletePod(p.name, self.grace if grace is None else grace)
                         for p in pods if not p.deleting]

    def condition(self, ctype: str, ok: bool, reason: str, message: str) -> None:
        """Set one condition, keeping the others."""
        new = condition(ctype, ok, reason, message, self.now, self.new.conditions)
        self.new.conditions = [c for c in self.new.conditions if c.type != ctype] + [new]


def condition(ctype: str, ok: bool, reason: str, message: str, now: float,
              previous: list[Condition] | None = None) -> Condition:
    """A status condition. ``lastTransitionTime`` moves only when the status flips: an earlier
    condition of the same type and status (from ``previous``) keeps its time."""
    state = "True" if ok else "False"
    kept = next((c.last_transition_time for c in previous or []
                 if c.type == ctype and c.status == state and c.last_transition_time), None)
    return Condition(type=ctype, status=state, reason=reason, message=message[:1000],
                     last_transition_time=kept or datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))


def reconcile(snap: Snapshot) -> Result:
    """One pass over ``snap`` (observer.Snapshot): the status to write and the effects.
    Lost nodes and hangs are held while ``snap.disruption`` lasts (at most
    ``guard.max_hold_seconds``) and around an API outage (judge); ``snap.children_error`` is
    shown as the ChildrenCreated condition."""
    if snap.deleting:
        return Result()  # being deleted: the garbage collector removes the children; do not restart
    old, spec = snap.status, snap.spec
    new = _working_copy(old)
    if spec is None:
        effects = _invalid_spec(old, new, snap.spec_error, snap.run["metadata"].get("generation"), snap.now)
        return Result(changed_fields(old, new), effects, None, new)
    name, uid = snap.run["metadata"]["name"], snap.run["metadata"].get("uid")
    # a spare is one the operator made for this run: its name, and the run as its controller
    # (a pod someone else labelled one is no spare, and no trainer identity reaches it)
    spares = [x for x in snap.pods if x.spare and plan.is_spare_name(name, x.name) and x.owner == uid]
    p = Pass(snap.run, spec, old, new, [x for x in snap.pods if not x.spare], snap.nodes, snap.now, snap.checkpoint,
             snap.disruption, snap.guard, snap.api_outage, snap.spec_error, snap.children_error, host=snap.host,
             spares=spares)
    if p.newer or inplace.ahead(p.gang + p.replacement, old.attempt):
        # this pass read a status older than the one that started them (or, in place, that
        # ordered their start): decide nothing
        return Result({}, [], spec, old)
    _observe(p)
    if old.phase not in TERMINAL:
        _children(p)
    _phase_step(p)(p)
    created_spares = _spares(p)
    if old.phase not in TERMINAL:  # after the step: the attempt it may have started is the one allowed
        also = ([p.new.current.replacement] if p.new.phase == "Restarting" and p.new.current.replacement else [])
        also += [x.name for x in p.spares if not x.deleting] + created_spares
        p.effects.append(Ensure(plan.trainer_role(p.run, spec, p.new.attempt, p.new.current.gang_attempt,
                                                  p.new.current.pod_names, also)))
    return Result(changed_fields(old, new), p.effects, spec, new)


def reconcile_objects(run: dict, pods: list[PodView], nodes: dict[str, NodeView], now: float, **signals) -> Result:
    """reconcile(observer.snapshot(...)): one pass from API objects, for tests and benchmarks."""
    return reconcile(snapshot(run, pods, nodes, now, **signals))


def _working_copy(old: TrainingRunStatus) -> TrainingRunStatus:
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
    new.conditions = [condition("Valid", False, "InvalidSpec", str(err), now, old.conditions)]
    if old.message == str(err):
        return []
    return [Event("InvalidSpec", message=str(err), warning=True)]


def _refused_edit(p: Pass, err: ConfigError) -> None:
    """Valid=False naming the field; the run goes on with the spec in force."""
    message = f"{err}; the run goes on with the last valid spec.faultTolerance"
    was = next((c for c in p.old.conditions if c.type == "Valid"), None)
    p.condition("Valid", False, "InvalidEdit", message)
    if was is None or was.message != message:
        p.event("InvalidEdit", message, warning=True)


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
        new.fault_tolerance_in_force = to_dict(spec.fault_tolerance)
        if not any(c.type == "Valid" and c.status == "True" for c in p.old.conditions):
            shape = (f"data parallel {spec.layout.data}" if spec.layout is not None else
                     f"command trainer, progress format {spec.trainer.progress_format}, checkpoint layout "
                     f"{spec.trainer.layout}")
            p.condition("Valid", True, "SpecValid", f"world size {spec.world_size}, {shape}")
    completed = store.advances(p.checkpoint, p.old.last_checkpoint, spec, p.pods)
    if completed:
        new.last_checkpoint = p.checkpoint
    store.observe(p, completed)
    _still_quarantined(p)
    _still_avoided(p)
    # left over from an attempt whose teardown an earlier operator did not finish (forced again
    # once a graceful delete has run out: its node may no longer answer)
    p.effects += [DeletePod(x.name, 0) for x in p.stale
                  if not x.deleting or (x.gone_by is not None and p.now >= x.gone_by)]


def _still_quarantined(p: Pass) -> None:
    """The run's quarantined nodes that stay so. The status says quarantined before the taint is
    written, the write can fail, and the node cache this pass reads may not show it yet: until
    a node is seen with the taint it stays pending and the taint is ordered again (the write is
    idempotent), for QUARANTINE_RETRY_SECONDS. A node seen tainted and now without the taint was
    returned by an admin; a pending node absent from the cache for QUARANTINE_SETTLE_SECONDS is
    gone. A Node object deleted and registered again comes back without the taint: the same
    machine (status.quarantinedMachines: its providerID) is quarantined again, another machine
    under the name (EKS names nodes by private IP) is not, and a taint is only ever written on
    the Node object it was decided for (its uid); a deleted node's machine is remembered for
    QUARANTINE_REMEMBER_SECONDS."""
    kept, pending, machines = [], [], []
    known = {m.node: m for m in p.old.quarantined_machines if m.node}
    for name in p.old.quarantined_nodes:
        if name in kept:  # (a status edited by hand)
            continue
        node, machine = p.nodes.get(name), known.pop(name, None)
        cause = max((f for f in p.old.failures if f.node == name), key=lambda f: f.time, default=None)
        since = machine.since if machine is not None and machine.since is not None else cause.time if cause else None
        if node is not None and machine is not None and machine.uid and node.uid and node.uid != machine.uid:
            # its Node object was deleted and registered again, without the taint
            verdict, machine = _registered_again(p, node, machine)
            if verdict == "undecided":
                kept.append(name)
                machines.append(machine)
            if verdict != "same":
                continue
            since = machine.since
            _quarantined_again(p, node)
        elif node is not None and keys.QUARANTINE_TAINT in node.taints:
            kept.append(name)
            machines.append(replace(machine, uid=machine.uid or node.uid, provider_id=machine.provider_id or node.provider_id)
                            if machine is not None else QuarantinedMachine(name, node.uid, node.provider_id, since))
            continue
        elif name not in p.old.quarantine_pending or (
                node is None and (since is None or p.now - since >= QUARANTINE_SETTLE_SECONDS)):
            # returned by an admin, or its Node object went (a pending one: unseen that long)
            if node is None and machine is not None and machine.provider_id:
                machines.append(replace(machine, gone_time=p.now, undecided_since=None))
            continue
        kept.append(name)
        pending.append(name)
        if machine is not None:
            machines.append(machine)
        if since is not None and p.now - since < QUARANTINE_RETRY_SECONDS:  # then the affinity alone keeps it out
            p.effects.append(Quarantine(name, cause.message if cause else "quarantined", machine.uid if machine else ""))
    p.new.quarantined_nodes, p.new.quarantine_pending = kept, pending
    p.new.quarantined_machines = machines + _remembered(p, known.values())


def _registered_again(p: Pass, node: NodeView, machine: QuarantinedMachine) -> tuple[str, QuarantinedMachine]:
    """What a Node object registered again under a quarantined machine's name is, by its
    providerID: "same" (quarantined again: the machine returned, with the new uid), "undecided"
    (no providerID yet: a cloud controller sets it after registration; for
    QUARANTINE_RETRY_SECONDS at most), or "ended" (another machine, nothing to tell, or the run
    ended: the quarantine ends, with an event when the run lives)."""
    if p.old.phase in TERMINAL:
        return "ended", machine
    if not machine.provider_id:
        p.event("QuarantineEnded", f"{node.name} registered again; no providerID was known for the machine "
                                   "quarantined: nothing says it is the same")
        return "ended", machine
    if not node.provider_id:
        first = min(machine.undecided_since or p.now, p.now)  # (a time edited by hand)
        if p.now - first > QUARANTINE_RETRY_SECONDS:
            p.event("QuarantineEnded", f"{node.name} registered again and has had no providerID for "
                                       f"{p.now - first:.0f}s: nothing says it is the machine quarantined")
            return "ended", machine
        return "undecided", replace(machine, undecided_since=first)
    if node.provider_id != machine.provider_id:
        _another_machine(p, node, machine)
        return "ended", machine
    return "same", replace(machine, uid=node.uid, since=p.now, gone_time=None, undecided_since=None)


def _another_machine(p: Pass, node: NodeView, machine: QuarantinedMachine) -> None:
    """The name the run quarantined is another machine's now: the quarantine stays with the old
    one. A quarantine taint on it (another run's, or this run's written before the uid was
    known) is named for an admin."""
    tainted = (f" It carries a {keys.QUARANTINE_TAINT} taint: its value names the run that wrote it; "
               "remove it only if that is this run.") if keys.QUARANTINE_TAINT in node.taints else ""
    p.event("QuarantineEnded", f"{node.name} is another machine now ({node.provider_id}, was "
                               f"{machine.provider_id}): the quarantine stays with the old one.{tainted}",
            warning=bool(tainted))


def _remembered(p: Pass, gone: list[QuarantinedMachine]) -> list[QuarantinedMachine]:
    """The quarantined machines whose Node objects went, still remembered; one registered again
    under its name is quarantined again (into the new status's quarantined and pending nodes)
    while the run lives and its quarantined or avoided nodes stay within maxQuarantinedNodes."""
    out = []
    for machine in gone:
        node = p.nodes.get(machine.node)
        went = min(machine.gone_time, p.now) if machine.gone_time is not None else None  # (a time edited by hand)
        if went is None or p.now - went > QUARANTINE_REMEMBER_SECONDS or p.old.phase in TERMINAL:
            continue
        if node is None:
            out.append(replace(machine, gone_time=went))
            continue
        verdict, machine = _registered_again(p, node, replace(machine, gone_time=went))
        if verdict == "undecided":
            out.append(machine)
        if verdict != "same":
            continue
        if len([n for n in _excluded(p.new) if n != machine.node]) + 1 > p.spec.quarantine_limit():
            p.event("NodeQuarantineSkipped", f"{machine.node}: registered again, the same machine "
                    f"({node.provider_id}) this run quarantined; not quarantined again: that would exceed "
                    f"{p.spec.quarantine_limit()} quarantined or avoided nodes", warning=True)
            continue
        p.new.quarantined_nodes.append(machine.node)
        p.new.quarantine_pending.append(machine.node)
        out.append(machine)
        p.effects.append(Quarantine(machine.node, f"registered again ({node.provider_id}) after it was quarantined",
                                    node.uid))
        _quarantined_again(p, node)
    return out


def _quarantined_again(p: Pass, node: NodeView) -> None:
    p.event("NodeQuarantined", f"{node.name}: registered again, the same machine ({node.provider_id}); "
                               "quarantined again (remove the taint to return it)", warning=True)


def _children(p: Pass) -> None:
    """Every pass of a live run, suspended included: the children its pods need (the headless
    Service, the ConfigMap, the trainer's ServiceAccount and RBAC, the admission policy), so a
    create that failed, or a child someone deleted, is made again. The handler's applier
    creates what is missing; the effects come before any pod's. (The trainer's Role is ensured
    after the phase step: it names the pods of the attempt that step may start.)"""
    spec = p.spec
    p.effects += [Ensure(o) for o in plan.trainer_identity_objects(
        p.run, spec, p.host.trainer_account_metadata(p.run["metadata"]["namespace"]))]
    if spec.own_trainer_identity:
        p.effects += [Ensure(o) for o in admission.trainer_policy()]
    p.effects.append(Ensure(plan.service(p.run)))
    if not spec.trainer.is_command:
        p.effects.append(Ensure(plan.config_map(p.run, spec)))
    was, error = next((c for c in p.old.conditions if c.type == "ChildrenCreated"), None), p.children_error
    if error:
        p.condition("ChildrenCreated", False, "CreateFailed", error)
        if was is None or was.status != "False":
            p.event("CreateFailed", f"{error}; retrying", warning=True)
    elif was is not None and was.status != "True":
        p.condition("ChildrenCreated", True, "Created", "")


def _phase_step(p: Pass) -> Callable[[Pass], None]:
    phase = p.old.phase
    if phase in TERMINAL:
        return _finished
    if p.spec.suspend:
        return _suspend
    if phase == "Suspended":
        return _resume
    if p.old.attempt == 0:
        return _create
    if phase == "Restarting":
        return _teardown
    return _supervise


def _finished(p: Pass) -> None:
    p.delete([x for x in p.current if x.phase not in ("Succeeded", "Failed")])


def _suspend(p: Pass) -> None:
    """Stop the gang gracefully (the trainer saves on SIGTERM); the time suspended leaves
    goodput's wall time. A failure whose restart the suspension interrupts ends here."""
    _stop(p, p.current + p.replacement, _suspended_since(p))
    if p.current:  # the stopping gang finishes its step (and a checkpoint) before it exits
        _track_progress(p, gang_state(p.current))
    if p.old.phase != "Suspended":
        p.new.phase = "Suspended"
        p.event("Suspended", "spec.suspend is true: the gang was stopped; it resumes from the newest checkpoint")
        if p.old.attempt:  # a run created suspended has no clock running yet
            was = p.old.suspension or Suspension()
            p.new.suspension = replace(was, since=p.now, resumed_time=None, restart_seconds=was.restart_seconds + (
                p.now - was.resumed_time if was.resumed_time is not None else 0.0))
            last = p.last_failure
            if last is not None and not last.resumed_time:
                last.teardown_done_time = last.teardown_done_time or p.now
                last.resumed_time, last.resumed_steps = p.now, 0
    _account(p, p.now)


def _resume(p: Pass) -> None:
    """Resumed by the user: a new attempt (not a failure) once the suspended gang is gone; a
    run created suspended starts its first attempt."""
    if p.old.attempt == 0:
        _create(p)
    elif p.current or p.replacement:
        # the suspended gang is still there (an operator stopped before its deletes landed, or
        # a pod on a lost node; a replacement a suspended replace left): finish stopping it first
        _stop(p, p.current + p.replacement, _suspended_since(p))
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
        _start_attempt(p, p.old.attempt + 1, "Resumed", "spec.suspend cleared")


def _create(p: Pass) -> None:
    """The first attempt (its children are ensured by every pass, before its pods)."""
    p.new.created_time = p.now
    _start_attempt(p, 1, "Starting", f"starting {p.spec.nodes} pods")


def _start_attempt(p: Pass, attempt: int, reason: str, message: str) -> None:
    """Status first, then pods (the handler writes the status before the effects). The new
    gang resumes from the newest complete checkpoint now."""
    new = p.new
    resume = p.checkpoint or p.old.last_checkpoint
    new.phase, new.attempt = "Starting", attempt
    new.current = AttemptStatus(start_time=p.now, resume_checkpoint=resume,  # nothing of the last one carries over
                                preflight_trusted=_preflight_trusted(p))
    p.effects += [Ensure(pod) for pod in plan.pods(p.run, p.spec, attempt, _kept_off(new), p.host,
                                                   new.current.preflight_trusted)]
    p.event(reason, f"attempt {attempt}: {message}")


def _teardown(p: Pass) -> None:
    """Delete the failed attempt (force after the grace period), then start the next one once
    every pod of every attempt is gone and the backoff has passed."""
    if p.old.current.restart == "inPlace":
        _teardown_in_place(p)
        return
    if p.old.current.restart == "replace":
        _teardown_replace(p)
        return
    _note_teardown_progress(p)
    _late_culprits(p)
    # (a replacement pod left by a restart replace that was given up goes too: the next gang
    # takes its name)
    _stop(p, p.current + p.replacement, p.old.current.teardown_start_time or p.now)
    if p.current or p.stale or p.replacement:
        return
    if not _torn_down(p):
        return
    excluded = _excluded(p.new)
    _start_attempt(p, p.old.attempt + 1, "Restarted", "new gang created" + (
        f", avoiding {len(excluded)} quarantined or avoided node(s)" if excluded else ""))


def _teardown_in_place(p: Pass) -> None:
    """Tell every agent to stop the failed attempt's workers; once every one said they are gone
    (the barrier) and the backoff has passed, start the next attempt in the same pods. A pod
    that ends or goes, or an agent that does not answer within the teardown grace and
    ANSWER_SLACK_SECONDS, and the gang is recreated instead."""
    _note_teardown_progress(p)
    target, gang = p.old.attempt + 1, p.gang
    since = p.old.current.teardown_start_time or p.now
    lost = next((x for x in gang if x.deleting or x.phase != "Running"), None)
    ready = inplace.ready(gang, target)  # then only the backoff is waited for: no answer is due
    answer_within = inplace.answer_within(p.old.current.stop_grace_seconds, p.grace)
    if lost is not None:
        _give_up_in_place(p, f"pod {lost.name} is {'going' if lost.deleting else 'no longer running'}")
        return
    if len(gang) < p.spec.nodes:
        _give_up_in_place(p, "a pod of the gang is gone")
        return
    if not ready and p.now - since > answer_within:
        _give_up_in_place(p, f"not every agent said its workers stopped within {answer_within:.0f}s")
        return
    if not ready:
        stop = _stop_order(p, target)
        p.effects += [OrderPod(x.name, stop) for x in inplace.unordered(gang, stop)]
        return
    if _torn_down(p):
        _start_in_place(p, target)


def _stop_order(p: Pass, target: int) -> Order:
    """The order to stop the workers of the attempts before ``target``: the teardown grace, ended
    early once they are idle after a hang (inplace.stop_idle_seconds). The status keeps the
    longest grace ordered (the answers are due by it)."""
    last = p.last_failure
    p.new.current.stop_grace_seconds = max(p.new.current.stop_grace_seconds or 0.0, float(p.grace))
    return Order(target, start=False, grace_seconds=float(p.grace),
                 idle_seconds=inplace.stop_idle_seconds(last.cause if last else None))


def _teardown_replace(p: Pass) -> None:
    """Restart replace: the failed index's pod is deleted (gracefully: it saves with the others
    where its node still runs it; forced after the grace); the other pods are told to stop
    their workers, as in place. Once that pod is gone its replacement is created, on a node the
    run may use, under the next attempt's name; its agent starts no workers but says ready.
    Once every agent, the replacement's included, said ready (the barrier) and the backoff has
    passed, the next attempt starts in them all. Another pod that ends or goes, an agent that
    does not answer in time, another pod's node lost, or a replacement that is not created or
    placed within scheduleTimeoutSeconds, not started within startupTimeoutSeconds once placed,
    that ends or whose node is lost, and the gang is recreated instead."""
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
            "Succeeded", "Failed") or _node_lost(p, replacement)):
        # the spare given the index went (deleted, ended, its node lost) before the start: the
        # next ready spare takes it, else a new pod
        if replacement is not None:
            p.effects.append(DeletePod(replacement.name, 0 if _node_lost(p, replacement) else p.grace))
        other = _ready_spare(p, but=taken)
        p.new.current.replacement = other.name if other else plan.pod_name(p.name, target, index)
        p.new.current.replacement_since = p.now if other else None
        if other is not None:
            p.effects.append(_take_index(other, _stop_order(p, target), target,
                                         index))
            p.new.spares = [s for s in p.new.spares if s != other.name]
        p.event("SpareLost", f"spare {taken} went before attempt {target} started; "
                + (f"spare {other.name} takes index {index}" if other else f"creating pod {p.new.current.replacement}"),
                warning=True)
        replacement = other
    lost = next((x for x in kept if x.deleting or x.phase != "Running" or _node_lost(p, x)), None)
    answer_within = inplace.answer_within(p.old.current.stop_grace_seconds, p.grace)
    kept_ready = inplace.ready(kept, target)
    asked = p.new.current.replacement_since
    if asked is None:  # (a status from before replacementSince)
        asked = replacement.created if replacement is not None and replacement.created else p.now
    waited = p.now - max(asked, since)
    placed_at = (replacement.scheduled or replacement.created) if replacement is not None else None
    why = ""
    if lost is not None:
        why = f"pod {lost.name} is " + ("going" if lost.deleting else "no longer running" if lost.phase != "Running"
                                         else f"on node {lost.node}, which is lost")
    elif len(kept) < p.spec.nodes - 1:
        why = "a pod of the gang is gone"
    elif not kept_ready and p.now - since > answer_within:
        why = f"not every agent said its workers stopped within {answer_within:.0f}s"
    elif replacement is not None and (replacement.deleting or replacement.phase in ("Succeeded", "Failed")
                                      or _node_lost(p, replacement)):
        why = f"the replacement pod {replacement.name} ended, went or lost its node"
    elif replacement is None and waited > ft.schedule_timeout_seconds:
        why = (f"the replacement pod {p.new.current.replacement} could not be created within "
               f"{ft.schedule_timeout_seconds:.0f}s ({p.children_error or 'no reason given'})")
    elif replacement is not None and not replacement.node and waited > ft.schedule_timeout_seconds:
        why = (f"the replacement pod {replacement.name} was not placed within {ft.schedule_timeout_seconds:.0f}s "
               f"({replacement.unschedulable or 'no reason given'})")
    elif replacement is not None and replacement.node and not inplace.ready([replacement], target) and p.now - max(
            placed_at or p.now, since) > ft.startup_timeout_seconds:
        why = (f"the replacement pod {replacement.name} did not start within {ft.startup_timeout_seconds:.0f}s of "
               f"being placed ({replacement.waiting or 'no reason given'})")
    if why:
        _give_up_in_place(p, why)
        return
    if replacement is not None and not replacement.node and replacement.unschedulable:
        last = p.last_failure
        p.new.message = (f"{last.message if last else 'restarting'}; the replacement pod {replacement.name} waits to "
                         f"be placed ({replacement.unschedulable[:300]}); the gang is recreated if it is not placed "
                         f"within {ft.schedule_timeout_seconds:.0f}s")
    stop = _stop_order(p, target)
    p.effects += [OrderPod(x.name, stop) for x in inplace.unordered(kept, stop)]
    if replacement is not None and plan.is_spare_name(p.name, replacement.name):  # (until it carries the order)
        p.effects += [_take_index(x, stop, target, index) for x in inplace.unordered([replacement], stop)]
    # graceful, forced after the grace (a NotReady node may still run it: a partition or a
    # kubelet down, and the replacement takes the same index), at once on a node known dead
    p.effects += [DeletePod(x.name, 0) for x in failed if x.deleting and _node_gone(p, x)]
    _stop(p, [x for x in failed if not (x.deleting and _node_gone(p, x))], since)
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
        p.effects.append(Ensure(plan.pod(p.run, p.spec, target, index, _kept_off(p.new), p.host,
                                         _preflight_trusted(p), await_start=True)))
    elif may_start and inplace.ready([replacement], target):
        _start_in_place(p, target, replaced=replacement)


def _take_index(spare: PodView, stop: Order, attempt: int, index: int) -> OrderPod:
    """A spare takes ``index``: labelled as the gang's pod of ``attempt`` (no longer a spare),
    and told to stop (it runs no workers: it says ready at once) in the same patch."""
    return OrderPod(spare.name, stop, ((keys.ATTEMPT, str(attempt)), (keys.INDEX, str(index)),
                                       (keys.SPARE, None)))


def _usable_spare(p: Pass, spare: PodView) -> bool:
    """Placed on a node that answers and that the run may use, its container running."""
    return (not spare.deleting and spare.phase == "Running" and bool(spare.node) and not _node_lost(p, spare)
            and spare.node not in _excluded(p.new))


def _ready_spare(p: Pass, but: str = "") -> PodView | None:
    """A spare whose agent waits (said ready), on a usable node: the oldest (not ``but``)."""
    ready = [s for s in p.spares if _usable_spare(p, s) and s.agent is not None and s.agent.state == "ready"
             and s.name in p.old.spares and s.name != but]
    return min(ready, key=lambda s: (s.created or 0.0, s.name), default=None)


SPARE_PHASES = ("Starting", "Preflight", "Running", "Restarting")
SPARES_MAX_SERIAL = 99_999  # a spare's hostname <run>-s<n> stays a DNS label (plan.spare_hostname)
SPARE_SETTLE_SECONDS = 10.0
"""How long a created spare may be missing from the pod cache before another is created."""


def _spares(p: Pass) -> list[str]:
    """Every pass: keep faultTolerance.spares standby pods (none once the run is suspended or
    finished, or with in-place restarts off), each on a node of its own (the run's
    anti-affinity), and status.spares the ones ready. Spares yield to the gang: while any pod the
    gang needs is not placed (a recreated gang, a new replacement pod) every spare is deleted,
    unplaced ones too, and none is created, so a spare never holds a node the gang waits for. A
    spare that ended, went to a node that no longer answers or that the run leaves out, did not
    start within startupTimeoutSeconds of being placed, or is one too many (a ready one is kept
    first), is deleted; one at a time is created, once the previous one is seen. Returns the
    names of the spares created."""
    ft = p.spec.fault_tolerance
    placed = _gang_placed(p)
    want = ft.spares if p.spec.in_place_on() and p.new.phase in SPARE_PHASES and placed else 0
    live = [s for s in p.spares if not s.deleting and s.name != p.new.current.replacement]  # (one taken this pass)

    def ready(s: PodView) -> bool:
        return s.phase == "Running" and s.agent is not None and s.agent.state == "ready"
    ended = [s for s in live if s.phase in ("Succeeded", "Failed")]
    bad = [s for s in live if s not in ended and s.node and (_node_lost(p, s) or s.node in _excluded(p.new) or (
        not ready(s) and p.now - (s.scheduled or s.created or p.now) > ft.startup_timeout_seconds))]
    keep = sorted((s for s in live if s not in ended + bad), key=lambda s: (not ready(s), s.created or 0.0, s.name))
    for s in ended + bad:
        p.event("SpareReplaced", f"spare {s.name}" + (f" on node {s.node}" if s.node else "") + ": " + (
            f"ended ({s.reason or s.phase} {s.message})".strip() if s in ended else
            "its node is lost or left out" if _node_lost(p, s) or s.node in _excluded(p.new) else
            f"not started {ft.startup_timeout_seconds:.0f}s after it was placed ({s.waiting or 'no reason given'})")
            + "; deleted", warning=True)
    p.delete([s for s in ended + bad + keep[want:] if not _node_lost(p, s)])
    # a spare on a node that no longer answers never finishes a graceful delete
    p.effects += [DeletePod(s.name, 0) for s in p.spares
                  if s.name != p.new.current.replacement and (_node_lost(p, s) and (s in bad or s.deleting) or (
                      s.deleting and s.gone_by is not None and p.now >= s.gone_by))]
    keep = keep[:want]
    ready_names = sorted(s.name for s in keep if ready(s))
    if ready_names != p.old.spares:
        p.new.spares = ready_names
    newest = plan.spare_name(p.name, p.old.spares_created)
    unseen = p.old.spares_created and newest not in {x.name for x in p.pods + p.spares} and \
        p.now - (p.old.spares_requested_time or 0.0) < SPARE_SETTLE_SECONDS
    if len(keep) >= want or unseen or p.old.spares_created >= SPARES_MAX_SERIAL:
        return []
    p.new.spares_created += 1
    p.new.spares_requested_time = p.now
    obj = plan.spare_pod(p.run, p.spec, max(1, p.new.attempt), p.new.spares_created, _kept_off(p.new), p.host)
    p.effects.append(Ensure(obj))
    return [obj["metadata"]["name"]]


def _gang_placed(p: Pass) -> bool:
    """Every pod the gang needs is on a node (new spares must not take one it waits for): the
    attempt's pods while it runs, and while a pod is replaced, the pod that takes its place."""
    kept = len(p.gang) == p.spec.nodes and all(x.node for x in p.gang)
    if p.new.phase != "Restarting" or p.new.current.restart == "inPlace":  # (in place: the gang keeps its pods)
        return kept
    taking = next((x for x in p.pods + p.spares if x.name == p.new.current.replacement), None)
    return p.new.current.restart == "replace" and taking is not None and bool(taking.node)


OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"
"""Kubernetes' word that a node is shut down (non-graceful node shutdown): its pods may go at once."""


def _node_gone(p: Pass, pod: PodView) -> bool:
    """Whether ``pod``'s node is known dead: its Node object deleted (the instance terminated),
    or tainted out-of-service. Only then is a failed pod forced at once: on a node that is only
    NotReady its processes may live on, and its replacement takes the same index."""
    node = p.nodes.get(pod.node) if pod.node else None
    return bool(pod.node) and (node is None or OUT_OF_SERVICE_TAINT in node.taints)


def _node_lost(p: Pass, pod: PodView) -> bool:
    """Whether ``pod``'s node is gone, NotReady or unreachable."""
    node = p.nodes.get(pod.node) if pod.node else None
    return bool(pod.node) and (node is None or node.ready != "True")


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
    p.event("InPlaceRestartGivenUp", f"attempt {p.old.attempt + 1}: {why}; recreating the gang", warning=True)
    _stop(p, p.gang + p.replacement, p.now)


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
        replaced is not None and replaced.node not in _preflight_trusted(p)))
    new.current = AttemptStatus(start_time=p.now, resume_checkpoint=resume, gang_attempt=inplace.gang_attempt(old),
                                pod_names=list(old.current.pod_names) if replaced is None else
                                inplace.with_replaced(old, p.name, p.spec.nodes, old.current.replacing,
                                                      replaced.name),
                                in_place_streak=inplace.next_streak(old, resume.step if resume else None),
                                preflight_trusted=[] if check else list(old.current.preflight_trusted),
                                preflight_check=check)
    _order_start(p, target)
    if replaced is None:
        p.event("Restarted", f"attempt {target}: restarted in place in the {len(p.gang)} pods of attempt "
                f"{new.current.gang_attempt} (no pod deleted or created)")
    else:
        p.event("Restarted", f"attempt {target}: pod {replaced.name} on node {replaced.node} replaced the failed "
                f"one; the other {p.spec.nodes - 1} pod(s) restarted in place")


def _order_start(p: Pass, attempt: int) -> None:
    """Tell the gang's agents to start ``attempt`` (the pods that do not carry the order yet;
    in the pass that starts it with a replacement, the gang as read still has the failed
    index's place empty: the replacement is ordered too)."""
    names = inplace.gang_names(p.new, p.name, p.spec.nodes)
    # every pod is told its node rank and the rendezvous address (the index-0 pod's: a spare's
    # own hostname once it runs index 0), so none relies on what it was started with
    master = plan.master_address(p.run, names[0])
    for x in p.gang + p.replacement:
        index = names.index(x.name) if x.name in names else x.index
        start = Order(attempt, start=True, grace_seconds=float(p.grace), preflight=p.new.current.preflight_check,
                      index=index, master=master)
        p.effects += [OrderPod(y.name, start) for y in inplace.unordered([x], start)]


def _recent_passes(p: Pass) -> list[PreflightPass]:
    window = p.spec.fault_tolerance.preflight_skip_minutes * 60
    return [pp for pp in p.new.preflight_passed if p.now - pp.time < window]


def _preflight_trusted(p: Pass) -> list[str]:
    """Nodes the next attempt may skip the pre-flight check on (they passed it recently)."""
    return sorted({pp.node for pp in _recent_passes(p)}) if p.spec.preflight_on() else []


def _excluded(status: TrainingRunStatus) -> list[str]:
    """Nodes the run's pods stay off: quarantined (tainted) and avoided (this run's own word)."""
    return [*status.quarantined_nodes, *(a.node for a in status.avoided_nodes if a.node not in status.quarantined_nodes)]


def _kept_off(status: TrainingRunStatus) -> list[str]:
    """Nodes a new pod of the run is placed off: those it leaves out, and the names of the
    quarantined machines it remembers (a Node object registered again under one may be that
    machine, untainted until a pass sees it). Only those left out count toward
    maxQuarantinedNodes."""
    left_out = _excluded(status)
    return [*left_out, *sorted(status.quarantine_names - set(left_out))]


def _avoid(p: Pass, node: str, why: str) -> None:
    p.new.avoided_nodes = p.new.avoided_nodes + [AvoidedNode(node=node, time=p.now, reason=why[:300])]
    p.event("NodeAvoided", f"{node}: {why}; this run's pods stay off it for "
            f"{p.spec.fault_tolerance.budget_window_minutes:g} min (no taint: the evidence is the run's own pods' "
            "words; an operator run with --trust-pod-fault-reports quarantines instead)", warning=True)


def _still_avoided(p: Pass) -> None:
    """A pod's word keeps the run off a node for the budget window, then the node may be tried
    again (a repaired node keeps its name; a replaced one never comes back)."""
    window = p.spec.fault_tolerance.budget_window_minutes * 60
    kept = [a for a in p.old.avoided_nodes if p.now - a.time < window]
    if len(kept) != len(p.old.avoided_nodes):
        p.new.avoided_nodes = kept


def _late_culprits(p: Pass) -> None:
    """A pod of the failed attempt that ends in teardown with the Neuron runtime's report of a
    hardware fault (its runtime timed out after the pod that lost a peer was acted on): its node
    is left out of the next attempt all the same, within the quarantine limit."""
    if not p.spec.fault_tolerance.quarantine or p.old.current.late_culprit:
        return  # one per teardown: the first to end with the report
    last = p.last_failure
    culprit = next((x for x in device_culprits(p.current) if not last or x.node != last.node), None)
    if culprit is None or culprit.node in _excluded(p.new):
        return
    why = f"pod {culprit.name} reported in teardown: {culprit.message}"
    if len(_excluded(p.new)) + 1 > p.spec.quarantine_limit():
        p.event("LateCulpritKept", f"{culprit.node}: {why}; not avoided: the run already leaves out "
                f"{p.spec.quarantine_limit()} node(s) (maxQuarantinedNodes)", warning=True)
    else:
        # only avoided, trusted or not: a late report is tied to no failure record, and a taint is
        # retried from one (_still_quarantined)
        _avoid(p, culprit.node, why)
    p.new.current.late_culprit = culprit.node


def _suspended_since(p: Pass) -> float:
    """When the run's suspension began (now, in the pass that suspends it)."""
    was = p.old.suspension
    return was.since if p.old.phase == "Suspended" and was and was.since is not None else p.now


def _stop(p: Pass, pods: list[PodView], since: float) -> None:
    """Delete ``pods`` gracefully, and force (grace 0) a pod whose graceful delete has run out
    (its deletionTimestamp passed; without one, the teardown grace since ``since``): a pod on a
    node that no longer answers never finishes a graceful delete. A pod never sent a graceful
    delete (an operator away after the status write) gets one first: the trainer saves on it."""
    waited = p.now - since >= p.spec.fault_tolerance.teardown_grace_seconds
    for pod in pods:
        if not pod.deleting:
            p.effects.append(DeletePod(pod.name, p.grace))
        elif (p.now >= pod.gone_by) if pod.gone_by is not None else waited:
            p.effects.append(DeletePod(pod.name, 0))


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


def _supervise(p: Pass) -> None:
    """Starting, Preflight or Running: track progress, recreate pods an earlier operator did not create,
    detect failures, and see the gang through to Running and Succeeded."""
    spec, old, new = p.spec, p.old, p.new
    gang = gang_state(p.current)
    _track_progress(p, gang)
    _watch_stragglers(p)
    if old.current.gang_attempt and old.phase == "Starting" and not old.current.gang_running_time:
        _order_start(p, old.attempt)  # an order that did not land is written again
    elif old.phase == "Starting" and not old.current.gang_running_time and len(p.current) < spec.nodes \
            and not any(x.deleting for x in p.current):
        have = {x.index for x in p.current}  # an earlier operator stopped while creating the gang,
        p.effects += [Ensure(plan.pod(p.run, spec, old.attempt, i, _kept_off(new),  # or the API server refused some
                                      p.host, old.current.preflight_trusted))
                      for i in range(spec.nodes) if i not in have]
        _act(p, gang, complete=False)
        return
    _report_startup(p)
    _report_bad_progress(p)
    if _act(p, gang):
        return
    if gang.succeeded == spec.nodes:
        new.phase = "Succeeded"
        new.message = f"all {spec.nodes} pods finished at step {gang.step}"  # not the last restart's reason
        p.event("Succeeded", new.message)
        # the run's wall time ends with its last step (the trainer's clock), not with detection
        _account(p, min(p.now, gang.last_progress_time or p.now))
        return
    if gang.running == spec.nodes:
        _gang_running(p, gang)
    _account(p, p.now)


def _watch_stragglers(p: Pass) -> None:
    """status.current.stragglers from this pass's progress reports; an event for each pod that
    became a straggler (with stragglers replace, the judge then acts on it)."""
    streaks, new_ones = stragglers.update(p.old.current.stragglers, p.current, p.spec, p.now)
    p.new.current.stragglers = streaks
    for s in new_ones:
        p.event("Straggler", f"pod {s.pod} on node {s.node}: compute time per step {s.ratio:g}x the other pods' "
                f"median in {s.reports} reports in a row (stragglers: {p.spec.fault_tolerance.stragglers})",
                warning=True)


def _replaceable_stragglers(p: Pass) -> tuple[StragglerStreak, ...]:
    """The flagged stragglers the judge may restart the gang for: with stragglers replace, and
    only while the node can be left out and the budget has room (else they are reported only)."""
    found = flagged(p.new.current.stragglers)
    if not found or p.spec.fault_tolerance.stragglers != "replace":
        return ()
    counters = p.old.failure_counters or counters_from(p.new.failures, p.spec.fault_tolerance.budget_window_minutes * 60)
    if not straggler_replace_allowed(p.spec, counters, _excluded(p.new), p.now):
        return ()
    return tuple(s for s in found if s.node not in _excluded(p.new))


def _report_startup(p: Pass) -> None:
    """PodsStarted: False, naming the pod and the kubelet's reason, as soon as a placed pod
    waits for anything but its container's creation (a pull error, a missing Secret); the
    failure itself comes after startupTimeoutSeconds (judge, cause startup)."""
    waiting = [x for x in not_started(p.current) if x.waiting and waiting_reason(x) not in STARTING_REASONS]
    was = next((c for c in p.old.conditions if c.type == "PodsStarted"), None)
    if waiting:
        first = waiting[0]
        reason = waiting_reason(first)
        message = (f"pod {first.name} on node {first.node}: {first.waiting}"
                   + (f" (and {len(waiting) - 1} more)" if len(waiting) > 1 else ""))
        p.condition("PodsStarted", False, reason, message)
        p.new.message = f"waiting for pods to start: {message}"
        if was is None or was.status != "False":  # not on each ErrImagePull <-> ImagePullBackOff flip
            p.event("PodNotStarting", f"{message}; the run acts after "
                    f"{p.spec.fault_tolerance.startup_timeout_seconds:.0f}s", warning=True)
    elif was is not None and was.status == "False" and not not_started(p.current):
        p.condition("PodsStarted", True, "Started", "")
        if p.old.message.startswith("waiting for pods to start"):
            p.new.message = ""


def _report_bad_progress(p: Pass) -> None:
    """ProgressValid: False, naming the pod and the fields its annotation got wrong (they were
    dropped, observe.pod_view); an event when that first shows or changes."""
    bad = [x for x in p.current if x.progress_errors]
    was = next((c for c in p.old.conditions if c.type == "ProgressValid"), None)
    if bad:
        # the condition names the fields only: their values change with every report
        fields = sorted({e.split(":")[0] for e in bad[0].progress_errors})
        message = f"pod {bad[0].name}: malformed {', '.join(fields)} in trainium.dev/progress; ignored"
        p.condition("ProgressValid", False, "MalformedProgress", message)
        if was is None or was.status != "False" or was.message != message:
            p.event("MalformedProgress", f"pod {bad[0].name}: {'; '.join(bad[0].progress_errors)}"[:500]
                    + "; the field is ignored", warning=True)
    elif was is not None and was.status == "False":
        p.condition("ProgressValid", True, "Parsed", "")


def _act(p: Pass, gang: GangState, complete: bool = True) -> bool:
    """Ask the judge; record a disruption's start and end; act on a failure. Returns whether
    the attempt failed."""
    seen = Observed(p.spec, gang, p.nodes, p.now, gang_complete=complete, children_error=p.children_error)
    verdict = judge(seen, Clocks.of(p.old, p.new.current.last_step_time, _replaceable_stragglers(p)),
                    Guards(p.guard, p.disruption, p.api_outage))
    _record_disruption(p, verdict.disruption)
    if verdict.failure:
        _on_failure(p, verdict.failure, gang)
        return True
    return False


def _record_disruption(p: Pass, now_in_force: Disruption | None) -> None:
    held = p.old.disruption
    if held and not now_in_force:
        p.new.disruption, p.new.disruption_end_time = None, p.now
        p.condition("Disrupted", False, "NodesReturned", "")
        p.event("DisruptionEnded", f"nodes are back after {p.now - held.since:.0f}s; normal failure handling again")
    elif now_in_force and not held:
        p.new.disruption = now_in_force
        p.condition("Disrupted", True, "MassNodeDisruption", now_in_force.message)
        p.event("Disruption", f"{now_in_force.message}: a control-plane or network disruption, not node failures; "
                f"no quarantine and no restart for up to {p.guard.max_hold_seconds:.0f}s", warning=True)


PREFLIGHT_MESSAGE = "attempt {attempt}: the pre-flight check of the gang's {nodes} nodes is under way"


def _gang_running(p: Pass, gang: GangState) -> None:
    """Every pod Running: the restart's recovery ends here, and its resume at the first report."""
    old, new, last = p.old, p.new, p.last_failure
    if not old.current.gang_running_time:
        new.current.gang_running_time = p.now
        if last and not last.recovered_time:
            last.recovered_time, last.recovered_after = p.now, round(p.now - last.time, 3)
            p.effects.append(ObserveRecovery(copy.copy(last)))
            p.event("Recovered", f"attempt {old.attempt}: all {p.spec.nodes} pods running "
                    f"{last.recovered_after:.1f}s after the failure was detected")
    trusted = set(old.current.preflight_trusted or ())
    skipped = all(x.node in trusted for x in gang.pods if not x.deleting)  # the check passes at once
    if gang.step is None and gang.preflight_running and not skipped and old.phase == "Starting":
        new.phase, new.message = "Preflight", PREFLIGHT_MESSAGE.format(attempt=old.attempt, nodes=p.spec.nodes)
        p.event("Preflight", new.message)
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
            seen, steps = _first_seen(p, gang)
            began = seen - steps * (old.step_seconds or 0.0)
            redone = max(0, (new.suspension.step or 0) - (gang.start_step or 0)) * (old.step_seconds or 0.0)
            new.suspension = replace(new.suspension, resumed_time=None, restart_seconds=round(
                new.suspension.restart_seconds + max(0.0, began - new.suspension.resumed_time), 3),
                recompute_seconds=round(new.suspension.recompute_seconds + redone, 3))
        p.event("Running", f"attempt {old.attempt} reports progress at step {gang.step}")
        _resumed_from(p, gang)
        if last and last.recovered_time:
            _note_resumed(p, last, gang)


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


def _note_resumed(p: Pass, last: FailureRecord, gang: GangState) -> None:
    """The attempt after ``last`` trains: the restart's schedule phase ends where its training
    began; it resumed at startStep (its checkpoint). Once."""
    if not last.resumed_time and gang.step is not None:
        last.resumed_time, last.resumed_steps = _first_seen(p, gang)
        last.resumed_step = gang.start_step


def _first_seen(p: Pass, gang: GangState) -> tuple[float, int]:
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


def _track_progress(p: Pass, gang: GangState) -> None:
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
        new.preflight_passed = [pp for pp in _recent_passes(p) if pp.node not in fresh] + \
            [PreflightPass(node=n, time=now) for n in sorted(fresh)]
    if not old.first_progress_time:
        new.first_progress_time, new.first_progress_steps = _first_seen(p, gang)
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


def _on_failure(p: Pass, failure: Failure, gang: GangState) -> None:
    """Record the failure (by identity), then fail the run or tear the gang down for a restart."""
    spec, old, new, now = p.spec, p.old, p.new, p.now
    history = list(new.failures)
    if history and history[-1].attempt == old.attempt - 1:
        # an attempt first seen failed (the operator was down while it trained): the restart
        # before it ended where its training began all the same
        _note_resumed(p, history[-1], gang)
    ckpt = p.checkpoint or new.last_checkpoint
    ckpt_step = ckpt.step if ckpt else None
    window = spec.fault_tolerance.budget_window_minutes * 60
    counters = old.failure_counters or counters_from(history, window)
    action = decide(failure, spec, counters, new.quarantined_nodes, ckpt_step, now,
                    [a.node for a in new.avoided_nodes],  # decide counts a node in both once
                    p.guard.trust_pod_reports)
    record = FailureRecord(
        id=(old.failure_count or len(history)) + 1, time=now, cause=failure.cause, action=action.kind,
        node=failure.node, pod=failure.pod, message=failure.message[:500], attempt=old.attempt,
        detected_after=round(now - failure.since, 3) if failure.since else None,
        # the newest step end this pass saw: status.lastProgressTime is the previous pass's,
        # stale when the failure is found in the pass that first sees the gang's last steps
        last_progress_time=max(old.last_progress_time or 0.0, gang.last_progress_time or 0.0) or None,
        step=gang.step, checkpoint_step=ckpt_step, step_seconds=old.step_seconds)
    in_place = replace_not = ""
    if action.kind == "restart":
        streak = inplace.next_streak(old, ckpt_step)
        in_place = inplace.why_not(spec, failure, bool(action.quarantine_node or action.avoid_node), streak,
                                   p.gang, old.attempt)
        lost = {x.node for x in p.gang if x.node and _node_lost(p, x)} - {failure.node}
        replace_not = inplace.why_not_replace(spec, failure, streak, p.gang, old.attempt, lost) if in_place else ""
        record.restart = "inPlace" if not in_place else "replace" if not replace_not else "recreate"
    timeline = history + [record]
    new.failure_count = record.id
    new.failure_counters = count(counters, failure.cause, now, ckpt_step, window)
    if len(timeline) > MAX_FAILURES_KEPT:  # older failures leave the status; their lost time does not
        dropped, timeline = timeline[:-MAX_FAILURES_KEPT], timeline[-MAX_FAILURES_KEPT:]
        new.goodput_archive = goodput.archive(
            old.goodput_archive, old.created_time if old.created_time is not None else now, old.first_progress_time,
            dropped, timeline[0].time, now, old.step_seconds, old.first_progress_steps)
    new.failures = timeline
    p.effects.append(ObserveFailure(copy.copy(record)))
    if action.kind == "fail":
        new.phase, new.message = "Failed", action.reason
        new.conditions = [condition("Valid", True, "SpecValid", "", now, old.conditions),
                          condition("Failed", True, "FailurePolicy", action.reason, now, old.conditions)]
        p.event("Failed", action.reason, warning=True)
        p.delete(p.current)
        _account(p, now)
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
    if action.quarantine_node and action.quarantine_node not in p.nodes:
        # its Node object is gone (the instance terminated): there is nothing to taint, and a
        # node that registers later under the same name is another machine (EKS names nodes by
        # private IP, which a new instance may get): a quarantine still pending would land on it
        p.event("NodeGone", f"{action.quarantine_node}: {failure.message}; not quarantined: its Node object is gone")
    elif action.quarantine_node:
        node = p.nodes[action.quarantine_node]
        p.effects.append(Quarantine(action.quarantine_node, failure.message, node.uid))
        new.quarantined_nodes = new.quarantined_nodes + [action.quarantine_node]
        new.quarantine_pending = new.quarantine_pending + [action.quarantine_node]
        new.quarantined_machines = [*(m for m in new.quarantined_machines if m.node != action.quarantine_node),
                                    QuarantinedMachine(action.quarantine_node, node.uid, node.provider_id, now)]
        p.event("NodeQuarantined", f"{action.quarantine_node}: {failure.message}", warning=True)
    if action.avoid_node:
        _avoid(p, action.avoid_node, failure.message)
    new.current.restart = record.restart
    after = f" in {action.delay_seconds:.0f}s" if action.delay_seconds else ""
    stop = _stop_order(p, old.attempt + 1)
    if record.restart == "inPlace":
        new.restarts_in_place = old.restarts_in_place + 1
        p.event("Restarting", f"{failure.cause}: {failure.message}; restarting the gang in place{after}", warning=True)
        p.effects += [OrderPod(x.name, stop) for x in p.gang]
    elif record.restart == "replace":
        new.restarts_replaced = old.restarts_replaced + 1
        failed = next(x for x in p.gang if x.name == failure.pod)
        spare = _ready_spare(p)
        new.current.replacing = failed.index
        new.current.replacement = spare.name if spare else plan.pod_name(p.name, old.attempt + 1, failed.index)
        if spare is not None:
            new.current.replacement_since = now  # it takes the index at once: labelled as the gang's, told to stop (it runs nothing)
            p.effects.append(_take_index(spare, stop, old.attempt + 1, failed.index))
            new.spares = [s for s in new.spares if s != spare.name]
        p.event("Restarting", f"{failure.cause}: {failure.message}; replacing pod {failed.name} by "
                + (f"spare {spare.name} on node {spare.node}" if spare else f"a new pod, {new.current.replacement}")
                + f"; the other pods restart in place{after}", warning=True)
        p.effects += [OrderPod(x.name, stop) for x in p.gang if x is not failed]
        p.delete([failed], grace=0 if _node_gone(p, failed) else None)
    else:
        p.event("Restarting", f"{failure.cause}: {failure.message}; restarting the gang{after}"
                + (f" (recreated: {replace_not if failure.cause in inplace.REPLACE_CAUSES else in_place})"
                   if spec.in_place_on() else ""), warning=True)
        p.delete(p.current)
    _account(p, now)


def _account(p: Pass, until: float) -> None:
    new = p.new
    if new.created_time is not None:
        new.goodput = goodput.account(new.created_time, new.first_progress_time, new.failures, until,
                                      new.step_seconds, new.first_progress_steps, new.goodput_archive,
                                      new.suspension, new.preflight_seconds, new.restore_seconds)
