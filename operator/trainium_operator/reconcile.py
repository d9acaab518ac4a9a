"""One level-based pass over a TrainingRun: observed state in, status patch and effects out. Pure.

The handler calls :func:`reconcile` every tick with the run, its pods and the nodes they use,
and executes the returned effects in order. All memory lives in the run's status, so an
operator that was killed and started again continues where it was:

  (new) -> Starting -> Running -> Succeeded
              ^  \\         |
              |   `---> Restarting (teardown, backoff) --> Failed (fatal / budget / guard)
              `----------------'
Invariants: a new attempt's pods are created only after status records the attempt and after
every pod of other attempts is gone, so two attempts never run at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config import ConfigError

from . import admission, goodput, plan
from .observe import Failure, NodeView, PodView, find_failure, gang_state
from .policy import DISRUPTION_CAUSES, DisruptionGuard, decide
from .spec import TrainingRunSpec, parse

MAX_FAILURES_KEPT = 50
TERMINAL = ("Succeeded", "Failed")


@dataclass
class Effect:
    kind: str  # ensure | delete_pod | quarantine | event
    obj: dict | None = None
    name: str = ""
    grace: int | None = None
    reason: str = ""
    message: str = ""
    warning: bool = False


@dataclass
class Result:
    status: dict = field(default_factory=dict)  # merge patch for .status
    effects: list[Effect] = field(default_factory=list)
    spec: TrainingRunSpec | None = None  # the parsed spec, None while it is invalid

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.effects.append(Effect("event", reason=reason, message=message, warning=warning))


def _condition(ctype: str, ok: bool, reason: str, message: str, now: float, previous: list | None = None) -> dict:
    """A status condition. ``lastTransitionTime`` moves only when the status flips: an earlier
    condition of the same type and status (from ``previous``) keeps its time."""
    from datetime import datetime, timezone
    state = "True" if ok else "False"
    kept = next((c.get("lastTransitionTime") for c in previous or []
                 if c.get("type") == ctype and c.get("status") == state and c.get("lastTransitionTime")), None)
    return {"type": ctype, "status": state, "reason": reason, "message": message[:1000],
            "lastTransitionTime": kept or datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def reconcile(run: dict, pods: list[PodView], nodes: dict[str, NodeView], now: float,
              checkpoint: dict | None = None, disruption: str = "",
              guard: DisruptionGuard = DisruptionGuard(),
              api_outage: tuple[float, float] | None = None) -> Result:
    """``checkpoint``: the newest complete checkpoint ({tag, step, time, uri}) or None.
    ``disruption``: why the run's nodes look lost through no fault of their own (policy.disruption),
    "" when they do not; while it lasts (at most ``guard.max_hold_seconds``) lost nodes and
    hangs are held: no quarantine, no restart. ``api_outage``: (lost, back) of the operator's last
    loss of the API server (back = now while it lasts): progress could not be written before
    it came back, and leases could not be renewed, so nodes that went Unknown around it are held."""
    res = Result()
    if run["metadata"].get("deletionTimestamp"):
        return res  # being deleted: the garbage collector removes the children; do not restart
    status = dict(run.get("status") or {})
    generation = run["metadata"].get("generation")
    try:
        spec = res.spec = parse(run.get("spec"))
    except ConfigError as err:
        if status.get("message") != str(err):
            res.event("InvalidSpec", str(err), warning=True)
        res.status = {"phase": "Failed" if status.get("attempt") in (None, 0) else status.get("phase"),
                      "message": str(err), "observedGeneration": generation,
                      "conditions": [_condition("Valid", False, "InvalidSpec", str(err), now,
                                                status.get("conditions"))]}
        return res
    upd: dict = {"observedGeneration": generation, "worldSize": spec.world_size}
    if spec.layout is not None:  # a command trainer's layout is its own
        upd["dataParallel"] = spec.layout.data
    if not any(c.get("type") == "Valid" and c.get("status") == "True" for c in status.get("conditions") or []):
        shape = (f"data parallel {spec.layout.data}" if spec.layout is not None else
                 f"command trainer, progress format {spec.trainer.progress_format}, checkpoint layout "
                 f"{spec.trainer.layout}")
        upd["conditions"] = [_condition("Valid", True, "SpecValid", f"world size {spec.world_size}, {shape}", now)]
    if checkpoint and checkpoint.get("step") != (status.get("lastCheckpoint") or {}).get("step"):
        upd["lastCheckpoint"] = checkpoint
    # A node stays quarantined while it carries the taint; an admin removing it returns the node.
    recorded = list(status.get("quarantinedNodes") or [])
    active = [n for n in recorded if n in nodes and plan.QUARANTINE_TAINT in nodes[n].taints]
    if active != recorded:
        upd["quarantinedNodes"] = active
    status["quarantinedNodes"] = active
    res.status = upd
    phase = status.get("phase")
    attempt = int(status.get("attempt") or 0)
    current = [p for p in pods if p.attempt == attempt]
    stale = [p for p in pods if p.attempt != attempt]
    for p in stale:  # left over from an attempt whose teardown an earlier operator did not finish
        if not p.deleting:
            res.effects.append(Effect("delete_pod", name=p.name, grace=0))

    if phase in TERMINAL:
        for p in current:
            if not p.deleting and p.phase not in ("Succeeded", "Failed"):
                res.effects.append(Effect("delete_pod", name=p.name, grace=int(spec.fault_tolerance.teardown_grace_seconds)))
        return res
    if spec.suspend:
        for p in current:
            if not p.deleting:
                res.effects.append(Effect("delete_pod", name=p.name, grace=int(spec.fault_tolerance.teardown_grace_seconds)))
        if phase != "Suspended":
            upd["phase"] = "Suspended"
            res.event("Suspended", "spec.suspend is true: the gang was stopped; it resumes from the newest checkpoint")
        return res
    if phase == "Suspended":  # resumed by the user: a new attempt, not a failure
        if pods:
            return res
        return _start_attempt(res, run, spec, status, attempt + 1, now, "Resumed", "spec.suspend cleared", checkpoint)
    if attempt == 0:
        if spec.service_account == plan.DEFAULT_TRAINER_SA:
            res.effects += [Effect("ensure", o) for o in plan.trainer_rbac(run["metadata"]["namespace"])]
            res.effects += [Effect("ensure", o) for o in admission.trainer_policy()]
        res.effects.append(Effect("ensure", plan.service(run)))
        if not spec.trainer.is_command:
            res.effects.append(Effect("ensure", plan.config_map(run, spec)))
        upd["createdTime"] = now
        return _start_attempt(res, run, spec, status, 1, now, "Starting", f"starting {spec.nodes} pods", checkpoint)

    if phase == "Restarting":
        return _teardown(res, run, spec, status, current, stale, attempt, now, checkpoint)

    gang = gang_state(current)
    _track_progress(upd, status, gang, spec, now)
    first_run = status.get("gangRunningTime")
    if phase == "Starting" and not first_run and len(current) < spec.nodes and not any(p.deleting for p in current):
        have = {p.index for p in current}  # an earlier operator stopped while creating the gang
        excluded = list(status.get("quarantinedNodes") or [])
        res.effects += [Effect("ensure", plan.pod(run, spec, attempt, i, excluded, _resume_point(status)))
                        for i in range(spec.nodes) if i not in have]
        return res
    # progress could not reach us while the cluster was disrupted or the API away: the hang clock
    # restarts when that ends
    last_change = max(upd.get("lastStepTime", status.get("lastStepTime")) or 0.0,
                      status.get("disruptionEndTime") or 0.0, api_outage[1] if api_outage else 0.0) or None
    failure = find_failure(spec, gang, nodes, now=now, expected_pods=spec.nodes,
                           gang_running_since=first_run, step_seconds=status.get("stepSeconds"),
                           last_step_change=last_change)
    failure = _hold_during_disruption(res, status, failure, disruption, guard, nodes, now, api_outage)
    if failure:
        return _on_failure(res, run, spec, status, failure, current, gang, now, checkpoint)
    if gang.succeeded == spec.nodes:
        upd["phase"] = "Succeeded"
        upd["message"] = f"all {spec.nodes} pods finished at step {gang.step}"  # not the last restart's reason
        res.event("Succeeded", upd["message"])
        # the run's wall time ends with its last step (the trainer's clock), not with detection
        _account(upd, status, min(now, gang.last_progress_time or now))
        return res
    elif gang.running == spec.nodes:
        if not first_run:
            upd["gangRunningTime"] = now
            failures = list(status.get("failures") or [])
            if failures and not failures[-1].get("recoveredTime"):
                failures[-1] = dict(failures[-1], recoveredTime=now,
                                    recoveredAfter=round(now - failures[-1]["time"], 3))
                upd["failures"] = failures
                res.event("Recovered", f"attempt {attempt}: all {spec.nodes} pods running "
                          f"{failures[-1]['recoveredAfter']:.1f}s after the failure was detected")
        if gang.step is not None and phase != "Running":
            upd["phase"] = "Running"
            res.event("Running", f"attempt {attempt} reports progress at step {gang.step}")
            failures = list(upd.get("failures", status.get("failures") or []))
            if failures and failures[-1].get("recoveredTime") and not failures[-1].get("resumedTime"):
                # training again: the restart's schedule phase ends where the new attempt's
                # training began; it resumed at startStep (its checkpoint)
                failures[-1] = dict(failures[-1], resumedTime=gang.last_progress_time or now,
                                    resumedStep=gang.start_step,
                                    resumedSteps=gang.step - (gang.start_step or 0))
                upd["failures"] = failures
    _account(upd, status, now)
    return res


def _set_condition(res: Result, status: dict, ctype: str, ok: bool, reason: str, message: str, now: float) -> None:
    """Set one condition, keeping the others (a status patch replaces the whole list)."""
    current = list(res.status.get("conditions", status.get("conditions") or []))
    new = _condition(ctype, ok, reason, message, now, current)
    res.status["conditions"] = [c for c in current if c.get("type") != ctype] + [new]


def _hold_during_disruption(res: Result, status: dict, failure: Failure | None, disruption: str,
                            guard: DisruptionGuard, nodes: dict[str, NodeView], now: float,
                            api_outage: tuple[float, float] | None) -> Failure | None:
    """The failure to act on: None while a disruption holds it (a lost node or a hang, for at
    most guard.max_hold_seconds), while a node that went Unknown may still turn out to be the
    first of a disruption (guard.settle_seconds), or while a node is Unknown because its lease
    lapsed during an API server outage (it went Unknown from the outage's start to
    guard.outage_grace_seconds after its end); records when a disruption began and ended."""
    lost = nodes.get(failure.node) if failure and failure.cause == "node" else None
    if lost is not None and lost.ready == "Unknown" and failure.since:
        settling = now - failure.since < guard.settle_seconds
        outage = (api_outage is not None and api_outage[0] <= failure.since <= api_outage[1] + guard.outage_grace_seconds
                  and now - failure.since < guard.max_hold_seconds)
        if settling or outage:
            failure = None
    held = status.get("disruption")
    if held and not disruption:
        # nodes come back one by one: the disruption lasts until every node it took is back
        # (a node lost after its wave is a failure of its own)
        wave_end = held["since"] + guard.settle_seconds
        behind = [n for n in nodes.values() if n.ready != "True" and (n.changed or 0.0) <= wave_end]
        if behind:
            disruption = f"{held['message']}; {len(behind)} of the run's nodes not back yet"
    if not disruption:
        if held:
            res.status.update({"disruption": None, "disruptionEndTime": now})
            _set_condition(res, status, "Disrupted", False, "NodesReturned", "", now)
            res.event("DisruptionEnded", f"nodes are back after {now - held['since']:.0f}s; normal failure "
                      "handling again")
        return failure
    since = held["since"] if held else now
    if not held:
        res.status["disruption"] = {"since": now, "message": disruption}
        _set_condition(res, status, "Disrupted", True, "MassNodeDisruption", disruption, now)
        res.event("Disruption", f"{disruption}: a control-plane or network disruption, not node failures; "
                  f"no quarantine and no restart for up to {guard.max_hold_seconds:.0f}s", warning=True)
    if failure and failure.cause in DISRUPTION_CAUSES and now - since < guard.max_hold_seconds:
        return None
    return failure


def _track_progress(upd: dict, status: dict, gang, spec: TrainingRunSpec, now: float) -> None:
    if gang.step is None:
        return
    upd["step"] = gang.step
    if spec.tokens_per_step:
        upd["tokens"] = gang.step * spec.tokens_per_step
    if gang.loss is not None:
        upd["loss"] = gang.loss
    if gang.tokens_per_second is not None:
        upd["tokensPerSecond"] = gang.tokens_per_second
    if gang.eval_perplexity is not None:
        upd["evalPerplexity"] = gang.eval_perplexity
    if not status.get("firstProgressTime"):
        upd["firstProgressTime"] = gang.last_progress_time or now  # the trainer's step end time
        upd["firstProgressSteps"] = gang.step - (gang.start_step or 0)  # steps trained by then
    last = status.get("lastStep")
    if last is None or gang.step > last:
        if last is not None and status.get("lastStepTime") and gang.step > last:
            # the trainer's step end times when both reports carry one; else when we saw them
            prev_t, new_t = status.get("lastProgressTime"), gang.last_progress_time
            exact = prev_t and new_t and new_t > prev_t
            observed = ((new_t - prev_t) if exact else (now - status["lastStepTime"])) / (gang.step - last)
            prev = status.get("stepSeconds")
            upd["stepSeconds"] = round(observed if prev is None else 0.7 * prev + 0.3 * observed, 3)
        upd["lastStep"] = gang.step
        upd["lastStepTime"] = now
    if gang.last_progress_time:
        upd["lastProgressTime"] = gang.last_progress_time


def _start_attempt(res: Result, run: dict, spec: TrainingRunSpec, status: dict, attempt: int, now: float,
                   reason: str, message: str, checkpoint: dict | None) -> Result:
    """``checkpoint``: the newest complete checkpoint now, which the new gang resumes from."""
    excluded = list(status.get("quarantinedNodes") or [])
    resume = checkpoint or status.get("lastCheckpoint") or None
    res.status.update({"phase": "Starting", "attempt": attempt, "attemptStartTime": now, "gangRunningTime": None,
                       "lastStep": None, "lastStepTime": None, "restartNotBefore": None, "teardownStartTime": None,
                       "resumeCheckpoint": resume})
    # Status first, then pods (the handler applies the status patch before the effects).
    res.effects += [Effect("ensure", p) for p in plan.pods(run, spec, attempt, excluded, resume)]
    res.event(reason, f"attempt {attempt}: {message}" + (
        f"; resuming from {resume['tag']}" if resume and resume.get("tag") and spec.trainer.is_command else ""))
    return res


def _resume_point(status: dict) -> dict | None:
    """The checkpoint the current attempt was started with (its pods must all say the same)."""
    return status.get("resumeCheckpoint") or None


def _on_failure(res: Result, run: dict, spec: TrainingRunSpec, status: dict, failure: Failure,
                current: list[PodView], gang, now: float, checkpoint: dict | None) -> Result:
    history = list(status.get("failures") or [])
    quarantined = list(status.get("quarantinedNodes") or [])
    ckpt_step = (checkpoint or status.get("lastCheckpoint") or {}).get("step")
    action = decide(failure, spec, history, quarantined, ckpt_step, now)
    failure_id = (status.get("failureCount") or len(history)) + 1  # identity: 1, 2, ... over the run
    record = {"id": failure_id, "time": now, "cause": failure.cause, "node": failure.node, "pod": failure.pod,
              "message": failure.message[:500], "attempt": status.get("attempt"), "action": action.kind,
              "detectedAfter": round(now - failure.since, 3) if failure.since else None,
              # the newest step end this pass saw: status.lastProgressTime is the previous pass's,
              # stale when the failure is found in the pass that first sees the gang's last steps
              "lastProgressTime": max(status.get("lastProgressTime") or 0.0, gang.last_progress_time or 0.0) or None,
              "step": gang.step,
              "checkpointStep": ckpt_step, "stepSeconds": status.get("stepSeconds")}
    timeline = history + [record]
    res.status["failureCount"] = failure_id
    if len(timeline) > MAX_FAILURES_KEPT:  # older failures leave the status; their lost time does not
        dropped, timeline = timeline[:-MAX_FAILURES_KEPT], timeline[-MAX_FAILURES_KEPT:]
        res.status["goodputArchive"] = goodput.archive(
            status.get("goodputArchive"), status.get("createdTime", now), status.get("firstProgressTime"),
            dropped, timeline[0]["time"], now, status.get("stepSeconds"), status.get("firstProgressSteps"))
    res.status["failures"] = timeline
    grace = int(spec.fault_tolerance.teardown_grace_seconds)
    if action.kind == "fail":
        res.status.update({"phase": "Failed", "message": action.reason})
        res.status["conditions"] = [_condition("Valid", True, "SpecValid", "", now, status.get("conditions")),
                                    _condition("Failed", True, "FailurePolicy", action.reason, now,
                                               status.get("conditions"))]
        res.event("Failed", action.reason, warning=True)
        res.effects += [Effect("delete_pod", name=p.name, grace=grace) for p in current if not p.deleting]
        _account(res.status, status, now)
        return res
    restarts = dict(status.get("restarts") or {})
    restarts[failure.cause] = restarts.get(failure.cause, 0) + 1
    res.status.update({"phase": "Restarting", "restarts": restarts, "restartCount": sum(restarts.values()),
                       "teardownStartTime": now,
                       "restartNotBefore": now + action.delay_seconds, "message": action.reason})
    if action.quarantine_node:
        res.effects.append(Effect("quarantine", name=action.quarantine_node, reason=failure.message))
        res.status["quarantinedNodes"] = quarantined + [action.quarantine_node]
        res.event("NodeQuarantined", f"{action.quarantine_node}: {failure.message}", warning=True)
    res.event("Restarting", f"{failure.cause}: {failure.message}; restarting the gang"
              + (f" in {action.delay_seconds:.0f}s" if action.delay_seconds else ""), warning=True)
    res.effects += [Effect("delete_pod", name=p.name, grace=grace) for p in current if not p.deleting]
    _account(res.status, status, now)
    return res


def _teardown(res: Result, run: dict, spec: TrainingRunSpec, status: dict, current: list[PodView],
              stale: list[PodView], attempt: int, now: float, checkpoint: dict | None) -> Result:
    started = status.get("teardownStartTime") or now
    force = now - started >= spec.fault_tolerance.teardown_grace_seconds
    _note_teardown_progress(res, status, current)
    for p in current:
        if force or not p.deleting:
            res.effects.append(Effect("delete_pod", name=p.name, grace=0 if force else
                                      int(spec.fault_tolerance.teardown_grace_seconds)))
    if current or stale:
        return res
    failures = list(res.status.get("failures", status.get("failures") or []))
    if failures and not failures[-1].get("teardownDoneTime"):
        failures[-1] = dict(failures[-1], teardownDoneTime=now)
        res.status["failures"] = failures
    if now < (status.get("restartNotBefore") or 0):
        return res
    quarantined = status.get("quarantinedNodes") or []
    return _start_attempt(res, run, spec, status, attempt + 1, now, "Restarted", "new gang created" + (
        f", avoiding {len(quarantined)} quarantined node(s)" if quarantined else ""), checkpoint)


def _note_teardown_progress(res: Result, status: dict, current: list[PodView]) -> None:
    """A gang stopped by SIGTERM finishes its step and checkpoint first: keep the failed
    attempt's newest step and its time on the failure record, so goodput counts that work."""
    failures = list(res.status.get("failures", status.get("failures") or []))
    gang = gang_state(current)
    if not failures or failures[-1].get("teardownDoneTime") or gang.step is None:
        return
    f = failures[-1]
    if gang.step > (f.get("step") or -1) or (gang.last_progress_time or 0) > (f.get("lastProgressTime") or 0):
        failures[-1] = dict(f, step=max(gang.step, f.get("step") or 0),
                            lastProgressTime=max(gang.last_progress_time or 0, f.get("lastProgressTime") or 0))
        res.status["failures"] = failures


def _account(upd: dict, status: dict, now: float) -> None:
    created = status.get("createdTime", upd.get("createdTime"))
    if created is not None:
        failures = upd.get("failures", status.get("failures") or [])
        first = upd.get("firstProgressTime", status.get("firstProgressTime"))
        upd["goodput"] = goodput.account(created, first, failures, now,
                                         upd.get("stepSeconds", status.get("stepSeconds")),
                                         upd.get("firstProgressSteps", status.get("firstProgressSteps")),
                                         upd.get("goodputArchive", status.get("goodputArchive")))
