"""The control loop's level-triggered parts (issue 22): children made sure of every pass, a run
created suspended, a create that failed shown in status, and pods placed on a node that never
start their container. Pure: reconcile over plain objects."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.unit.test_operator_core import RUN, SPEC, _node
from trainium_api.launch import node_token
from trainium_api.load import lenient, to_dict
from trainium_api.progress import ProgressReport
from trainium_api.status import TrainingRunStatus
from trainium_operator.judge import find_failure
from trainium_operator.observe import gang_state, node_view, pod_view
from trainium_operator.reconcile import reconcile_objects
from trainium_operator.spec import parse

CHILDREN = {"ServiceAccount", "Role", "RoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
            "Service", "ConfigMap", "PodDisruptionBudget"}


def _kinds(result) -> set[str]:
    return {e.obj["kind"] for e in result.effects if e.kind == "ensure"} - {"Pod"}


def _run(status: dict | None = None, **spec) -> dict:
    return {**RUN, "spec": {**SPEC, **spec}, "status": {"conditions": [{"type": "Valid", "status": "True"}],
                                                       **(status or {})}}


def _after(result, run: dict) -> dict:
    return {**run, "status": {**run["status"], **result.status}}


@pytest.mark.parametrize("phase, attempt", [("Starting", 1), ("Running", 1), ("Restarting", 2), ("Suspended", 1)])
def test_every_live_pass_ensures_every_child(phase, attempt):
    """Not only the pass that starts attempt 1: a create that failed then, or a child deleted
    later, is made again by whichever pass comes next."""
    r = reconcile_objects(_run({"phase": phase, "attempt": attempt, "createdTime": 0.0}, suspend=phase == "Suspended"),
                  [], {}, now=10.0)
    assert _kinds(r) == CHILDREN


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_finished_run_ensures_nothing(phase):
    assert not _kinds(reconcile_objects(_run({"phase": phase, "attempt": 1}), [], {}, now=10.0))


def test_a_run_created_suspended_starts_fully_when_resumed():
    run = _run(suspend=True)
    r = reconcile_objects(run, [], {}, now=5.0)
    assert r.status["phase"] == "Suspended" and r.after.attempt == 0 and not r.ensured("Pod")
    assert _kinds(r) == CHILDREN and r.after.created_time is None  # suspended time is not the run's
    run = _after(r, run)
    run["spec"] = {**SPEC, "suspend": False}
    r = reconcile_objects(run, [], {}, now=100.0)
    assert r.status["phase"] == "Starting" and r.status["attempt"] == 1 and len(r.ensured("Pod")) == SPEC["nodes"]
    assert r.status["createdTime"] == 100.0 and _kinds(r) == CHILDREN


def test_a_failed_create_is_in_status_until_a_pass_succeeds():
    run = _run({"phase": "Starting", "attempt": 1, "createdTime": 0.0})
    why = 'cannot create Service r: services "r" is forbidden: exceeded quota: no-services'
    r = reconcile_objects(run, [], {}, now=1.0, children_error=why)
    cond = next(c for c in r.after.conditions if c.type == "ChildrenCreated")
    assert (cond.status, cond.reason, cond.message) == ("False", "CreateFailed", why)
    assert [e.reason for e in r.effects if e.kind == "event"] == ["CreateFailed"]
    run = _after(r, run)
    again = reconcile_objects(run, [], {}, now=2.0, children_error=why)
    assert "conditions" not in again.status and not [e for e in again.effects if e.kind == "event"]  # said once
    fixed = reconcile_objects(run, [], {}, now=3.0)
    assert next(c for c in fixed.after.conditions if c.type == "ChildrenCreated").status == "True"


def _waiting(i: int, reason: str, message: str = "", scheduled: str = "2026-01-01T00:00:00Z", phase="Pending"):
    return pod_view({"metadata": {"name": f"r-a1-{i}", "creationTimestamp": scheduled,
                                  "labels": {"trainium.dev/attempt": "1", "trainium.dev/index": str(i)}},
                     "spec": {"nodeName": f"n{i}"},
                     "status": {"phase": phase,
                                "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled}],
                                "containerStatuses": [{"state": {"waiting": {"reason": reason, "message": message}}}]
                                if reason else []}})


T0 = 1767225600.0  # 2026-01-01T00:00:00Z, when the pods were placed
TIMEOUT = 600.0


@pytest.mark.parametrize("reason, seconds, shown, failure", [
    ("ContainerCreating", 30, False, False),           # starting as it should
    ("ContainerCreating", TIMEOUT + 1, False, True),   # a volume that never mounts
    ("ImagePullBackOff", 3, True, False),              # shown at once, acted on later
    ("ImagePullBackOff", TIMEOUT + 1, True, True),
    ("CreateContainerConfigError", 1, True, False),    # a missing Secret or ConfigMap key
    ("CreateContainerConfigError", TIMEOUT + 1, True, True),
    ("", TIMEOUT + 1, False, True),                     # Pending on its node with no word at all
])
def test_a_placed_pod_that_never_starts(reason, seconds, shown, failure):
    spec = {**SPEC, "faultTolerance": {"startupTimeoutSeconds": TIMEOUT}}
    pods = [_waiting(0, reason, "secret \"hf-token\" not found"), *[_waiting(i, "", phase="Running") for i in (1, 2, 3)]]
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    run = _run({"phase": "Starting", "attempt": 1, "createdTime": T0 - 5}, faultTolerance={"startupTimeoutSeconds": TIMEOUT})
    r = reconcile_objects(run, pods, nodes, now=T0 + seconds)
    cond = next((c for c in r.after.conditions if c.type == "PodsStarted"), None)
    assert (cond is not None and cond.status == "False") == shown, cond
    if shown:
        assert cond.reason == reason and "r-a1-0 on node n0" in cond.message and "hf-token" in cond.message
        assert r.after.message.startswith("pod r-a1-0 on node n0 has not started" if failure
                                          else "waiting for pods to start: pod r-a1-0"), r.after.message
    found, _ = find_failure(parse(spec), gang_state(pods), nodes, now=T0 + seconds, expected_pods=4,
                         gang_running_since=None, step_seconds=None, last_step_change=None)
    assert (found is not None and found.cause == "startup") == failure, found
    if failure:
        assert r.after.phase == "Restarting" and r.after.failures[-1].cause == "startup"
        assert (reason or "no reason given") in found.message and found.pod == "r-a1-0"


def test_startup_failures_spend_their_own_budget_then_fail_naming_the_reason():
    spec = {"faultTolerance": {"startupTimeoutSeconds": TIMEOUT, "restartBudget": {"startup": 1}}}
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    pods = [_waiting(i, "CreateContainerConfigError", 'secret "hf-token" not found') for i in range(4)]
    status = {"phase": "Starting", "attempt": 1, "createdTime": T0,
              "failures": [{"id": 1, "time": T0 + 100, "cause": "startup", "action": "restart", "attempt": 0}],
              "failureCount": 1}
    r = reconcile_objects(_run(status, **spec), pods, nodes, now=T0 + TIMEOUT + 5)
    assert r.after.phase == "Failed" and "startup exhausted" in r.after.message
    assert 'secret "hf-token" not found' in r.after.message and r.after.restarts.get("startup") is None


def test_the_started_condition_flips_back_once_every_pod_runs():
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    run = _run({"phase": "Starting", "attempt": 1, "createdTime": T0})
    r = reconcile_objects(run, [_waiting(0, "ErrImagePull")] + [_waiting(i, "", phase="Running") for i in (1, 2, 3)],
                  nodes, now=T0 + 5)
    run = _after(r, run)
    r = reconcile_objects(run, [_waiting(i, "", phase="Running") for i in range(4)], nodes, now=T0 + 9)
    cond = next(c for c in r.after.conditions if c.type == "PodsStarted")
    assert cond.status == "True" and r.after.message == ""
    assert lenient(TrainingRunStatus, to_dict(r.after)).conditions == r.after.conditions  # the types load back


@pytest.mark.parametrize("annotation, step, dropped", [
    ('{"step": 7, "time": 100.5, "loss": 2.5}', 7, []),
    ('{"step": 7, "time": "soon"}', 7, ["time"]),
    ('{"step": 7, "lastCheckpointStep": "5"}', 7, ["lastCheckpointStep"]),
    ('{"step": 7, "tokensPerSecond": -3}', 7, ["tokensPerSecond"]),
    ('{"step": 7, "loss": 1e400}', 7, ["loss"]),          # inf after JSON
    ('{"step": 7, "startStep": 2.5}', 7, ["startStep"]),
    ('{"step": true}', None, ["step"]),
    ('{"step": -1}', None, ["step"]),
    ('{"step": 99999999999999999999}', None, ["step"]),
    ('[1, 2]', None, []),
    ('{"step": ' * 5000, None, []),                     # too long, never parsed
    ("not json", None, []),
])
def test_a_malformed_progress_field_is_dropped_and_named_never_raised(annotation, step, dropped):
    view = pod_view({"metadata": {"name": "r-a1-0", "annotations": {"trainium.dev/progress": annotation},
                                  "labels": {"trainium.dev/attempt": "1", "trainium.dev/index": "0"}},
                     "spec": {"nodeName": "n0"}, "status": {"phase": "Running"}})
    assert (view.progress.step if view.progress else None) == step
    assert sorted({e.split(":")[0] for e in view.progress_errors} - {"not JSON", "not a JSON object"}
                  - {e for e in view.progress_errors if e.startswith("longer")}) == sorted(dropped)
    assert view.progress is None or all(json.loads(view.progress.to_annotation())[d] is None for d in dropped)
    if step is None and not dropped:
        assert view.progress is None and view.progress_errors  # a whole report refused, and why
    others = [pod_view({"metadata": {"name": f"r-a1-{i}", "labels": {"trainium.dev/attempt": "1",
                                                                    "trainium.dev/index": str(i)},
                                     "annotations": {"trainium.dev/progress": '{"step": 6, "time": 90.0}'}},
                        "spec": {"nodeName": f"n{i}"}, "status": {"phase": "Running"}}) for i in (1, 2, 3)]
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    run = _run({"phase": "Running", "attempt": 1, "createdTime": 0.0, "lastProgressTime": 80.0,
                "current": {"gangRunningTime": 50.0, "lastStep": 5, "lastStepTime": 80.0}})
    r = reconcile_objects(run, [view, *others], nodes, now=120.0)  # never raises
    cond = next((c for c in r.after.conditions if c.type == "ProgressValid"), None)
    assert (cond is not None and cond.status == "False") == bool(view.progress_errors)
    assert r.after.step == max(step or 0, 6)


def test_a_pod_labelled_with_no_attempt_is_no_attempts_pod():
    view = pod_view({"metadata": {"name": "x", "labels": {"trainium.dev/attempt": "one", "trainium.dev/index": "-2"}}})
    assert (view.attempt, view.index) == (-1, -1)


@pytest.mark.parametrize("name, ok", [("llama-7b", True), ("r" * 56, True), ("r" * 57, False), ("run.v2", False),
                                      ("7b-run", False), ("run-", False), ("Run", False)])
def test_a_run_name_that_cannot_name_its_service_is_refused_with_the_reason(name, ok):
    r = reconcile_objects({**_run(), "metadata": {**RUN["metadata"], "name": name}}, [], {}, now=1.0)
    valid = next(c for c in r.after.conditions if c.type == "Valid")
    assert (valid.status == "True") == ok, valid
    if not ok:
        assert valid.message.startswith("metadata.name: must be a DNS-1035 label") and not r.ensured("Pod")


def test_a_pass_that_read_an_older_status_never_deletes_the_newer_attempts_pods():
    """The status written with attempt 2 has not reached the watch yet, but attempt 2's pods
    have: the pass decides nothing. Pods of a newer attempt that live on for a minute without
    such a status (someone reset it) are stale after all."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    newer = [pod_view({"metadata": {"name": f"r-a2-{i}", "creationTimestamp": "2026-01-01T00:00:00Z",
                                    "labels": {"trainium.dev/attempt": "2", "trainium.dev/index": str(i)}},
                       "spec": {"nodeName": f"n{i}"}, "status": {"phase": "Pending"}}) for i in range(4)]
    run = _run({"phase": "Restarting", "attempt": 1, "createdTime": 0.0, "current": {"teardownStartTime": T0 - 10}})
    r = reconcile_objects(run, newer, nodes, now=T0 + 1)
    assert not r.status and not r.effects
    r = reconcile_objects(run, newer, nodes, now=T0 + 61)
    assert {e.name for e in r.effects if e.kind == "delete_pod"} == {f"r-a2-{i}" for i in range(4)}


def test_an_edit_the_operator_refuses_leaves_the_run_supervised_with_the_spec_in_force():
    """The API server lets faultTolerance change on a live run; a value only the operator can
    judge (hangTimeoutSeconds: soon) used to make every later pass return early, so a crash
    was never acted on while the phase said Running."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    run = _run({"phase": "Starting", "attempt": 1, "createdTime": 0.0})
    r = reconcile_objects(run, [], nodes, now=1.0)
    assert r.after.fault_tolerance_in_force["hangTimeoutSeconds"] == "auto"
    run = _after(r, run)
    run["spec"] = {**SPEC, "faultTolerance": {"hangTimeoutSeconds": "soon"}}
    crashed = [pod_view({"metadata": {"name": f"r-a1-{i}", "labels": {"trainium.dev/attempt": "1",
                                                                     "trainium.dev/index": str(i)}},
                         "spec": {"nodeName": f"n{i}"},
                         "status": {"phase": "Failed" if i == 0 else "Running", "containerStatuses": [
                             {"state": {"terminated": {"exitCode": 1, "reason": "Error"}}}] if i == 0 else []}})
               for i in range(4)]
    r = reconcile_objects(run, crashed, nodes, now=2.0)
    valid = next(c for c in r.after.conditions if c.type == "Valid")
    assert valid.status == "False" and valid.message.startswith("spec.faultTolerance.hangTimeoutSeconds")
    assert r.after.phase == "Restarting" and r.after.failures[-1].cause == "application"
    assert r.after.fault_tolerance_in_force["hangTimeoutSeconds"] == "auto"  # kept
    again = reconcile_objects(_after(r, run), [], nodes, now=3.0)
    assert "conditions" not in again.status and "InvalidEdit" not in [e.reason for e in again.effects if e.kind == "event"]


def test_an_evicted_pod_is_an_eviction_whatever_its_container_said():
    view = pod_view({"metadata": {"name": "r-a1-0", "labels": {"trainium.dev/attempt": "1", "trainium.dev/index": "0"}},
                     "spec": {"nodeName": "n0"},
                     "status": {"phase": "Failed", "reason": "Evicted", "message": "The node was low on memory.",
                                "containerStatuses": [{"state": {"terminated": {"exitCode": 137, "reason": "Error"}}}]}})
    others = [pod_view({"metadata": {"name": f"r-a1-{i}", "labels": {"trainium.dev/attempt": "1",
                                                                    "trainium.dev/index": str(i)}},
                        "spec": {"nodeName": f"n{i}"}, "status": {"phase": "Running"}}) for i in (1, 2, 3)]
    found, _ = find_failure(parse(SPEC), gang_state([view, *others]), {f"n{i}": _node(f"n{i}") for i in range(4)},
                         now=1.0, expected_pods=4, gang_running_since=None, step_seconds=None, last_step_change=None)
    assert found.cause == "eviction" and "Evicted" in found.message


def test_a_quarantined_node_that_stays_down_does_not_keep_a_disruption_open():
    from trainium_operator.disruption_guard import DisruptionGuard
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    nodes["bad"] = node_view({"metadata": {"name": "bad"}, "spec": {"taints": [{"key": "trainium.dev/quarantined"}]},
                              "status": {"conditions": [{"type": "Ready", "status": "False"}]}})  # never back
    running = [pod_view({"metadata": {"name": f"r-a1-{i}", "labels": {"trainium.dev/attempt": "1",
                                                                     "trainium.dev/index": str(i)}},
                         "spec": {"nodeName": f"n{i}"}, "status": {"phase": "Running"}}) for i in range(4)]
    run = _run({"phase": "Running", "attempt": 1, "createdTime": 0.0, "quarantinedNodes": ["bad"],
                "disruption": {"since": 100.0, "message": "5 of 8 nodes are NotReady or Unknown"}})
    r = reconcile_objects(run, running, nodes, now=200.0, disruption="", guard=DisruptionGuard())
    assert r.after.disruption is None and r.after.disruption_end_time == 200.0


def test_pods_the_api_server_will_not_create_fail_the_attempt_after_the_schedule_timeout():
    why = 'cannot create Pod r-a1-0: pods "r-a1-0" is forbidden: exceeded quota: trn (and 3 more pods)'
    run = _run({"phase": "Starting", "attempt": 1, "createdTime": 0.0, "current": {"startTime": 0.0}},
               faultTolerance={"scheduleTimeoutSeconds": 60})
    r = reconcile_objects(run, [], {}, now=30.0, children_error=why)
    assert r.after.phase == "Starting" and len(r.ensured("Pod")) == 4  # asked for again, shown in status
    assert next(c for c in r.after.conditions if c.type == "ChildrenCreated").message == why
    r = reconcile_objects(_after(r, run), [], {}, now=61.0, children_error=why)
    assert r.after.phase == "Restarting" and r.after.failures[-1].cause == "scheduling"
    assert "exceeded quota" in r.after.failures[-1].message


def test_a_run_created_suspended_then_edited_wrongly_stays_suspended_and_says_why():
    run = _run(suspend=True)
    r = reconcile_objects(run, [], {}, now=1.0)
    run = _after(r, run)
    run["spec"] = {**SPEC, "suspend": True, "faultTolerance": {"hangTimeoutSeconds": "soon"}}
    r = reconcile_objects(run, [], {}, now=2.0)
    assert r.after.phase == "Suspended"
    assert next(c for c in r.after.conditions if c.type == "Valid").status == "False"
    run = _after(r, run)
    run["spec"] = {**SPEC, "suspend": False}  # fixed and resumed
    r = reconcile_objects(run, [], {}, now=3.0)
    assert r.after.phase == "Starting" and len(r.ensured("Pod")) == 4
    assert next(c for c in r.after.conditions if c.type == "Valid").status == "True"


def test_budgets_count_every_failure_not_only_the_records_kept():
    """status.failures keeps the newest 50 records; the policy's counters keep counting: with a
    budget of 60, the 61st failure within the window fails the run although 50 are on record."""
    from tests.unit.test_operator_core import _pod
    now = 10_000.0
    kept = [{"id": i + 11, "time": now - 100 + i, "cause": "application", "action": "restart", "attempt": i + 11,
             "checkpointStep": i} for i in range(50)]
    counters = {"recent": {"application": [now - 200 + i for i in range(60)]}, "streak": 1,
                "streakCheckpointStep": 49}
    status = {"phase": "Running", "attempt": 61, "createdTime": 0.0, "failures": kept, "failureCount": 60,
              "failureCounters": counters, "current": {"gangRunningTime": now - 50, "lastStepTime": now - 1}}
    run = _run(status, faultTolerance={"restartBudget": {"application": 60}, "noProgressRestarts": 100})
    pods = [_pod(i, attempt=61, step=5) for i in range(3)] + [_pod(3, "Failed", code=1, attempt=61)]
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    r = reconcile_objects(run, pods, nodes, now=now)
    assert r.after.phase == "Failed" and "restart budget for application exhausted (60 restarts" in r.after.message
    # an older operator's status has no counters: they are counted from the records kept
    del run["status"]["failureCounters"]
    r = reconcile_objects(run, pods, nodes, now=now)
    assert r.after.phase == "Restarting" and r.after.failure_counters.recent["application"][-1] == now
    assert len(r.after.failure_counters.recent["application"]) == 51


def _reporting(attempt: int, step: int, at: float, start_step: int | None = None, written_by: int | None = None,
               **fields) -> list:
    """Pods of ``attempt`` with a progress report (by ``written_by``'s workers, where given)."""
    ann = {"step": step, "time": at, **({"startStep": start_step} if start_step is not None else {}),
           **({"attempt": written_by} if written_by is not None else {}), **fields}
    import json
    return [pod_view({"metadata": {"name": f"r-a{attempt}-{i}", "labels": {"trainium.dev/attempt": str(attempt),
                                                                       "trainium.dev/index": str(i)},
                                   "annotations": {"trainium.dev/progress": json.dumps(ann)}},
                      "spec": {"nodeName": f"n{i}"}, "status": {"phase": "Running"}}) for i in range(4)]


def test_time_suspended_is_neither_productive_nor_lost():
    """Suspended at t=100 for 100 s: the wall time leaves it out, the pods are stopped with the
    teardown grace (the trainer saves on SIGTERM), the resume starts attempt 2 from the newest
    checkpoint, and from the resume to its first step (14 s) is lost as schedule time."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    status = {"phase": "Running", "attempt": 1, "createdTime": 0.0, "firstProgressTime": 10.0, "firstProgressSteps": 0,
              "stepSeconds": 1.0, "current": {"gangRunningTime": 5.0, "lastStep": 90, "lastStepTime": 99.0}}
    run = _run(status, suspend=True)
    r = reconcile_objects(run, _reporting(1, 90, 99.0), nodes, now=100.0)
    assert r.after.phase == "Suspended" and r.after.suspension.since == 100.0
    assert {e.name for e in r.effects if e.kind == "delete_pod"} == {f"r-a1-{i}" for i in range(4)}
    assert all(e.grace == 30 for e in r.effects if e.kind == "delete_pod")  # graceful: the trainer saves
    run = _after(r, run)
    stopping = [replace(x, deleting=True) for x in _reporting(1, 92, 101.0)]
    run = _after(reconcile_objects(run, stopping, nodes, now=102.0), run)
    r = reconcile_objects(run, [], nodes, now=150.0)
    assert r.after.goodput.wall_seconds == 100.0  # 150 s since creation, 50 of them suspended
    run = _after(r, run)
    run["spec"] = {**run["spec"], "suspend": False}
    r = reconcile_objects(run, [], nodes, now=200.0, checkpoint={"tag": "step-90", "step": 90, "uri": "s3://b/r"})
    assert r.after.attempt == 2 and r.after.current.resume_checkpoint.step == 90 and not r.after.failures
    assert r.after.suspension.seconds == 100.0 and r.after.suspension.resumed_time == 200.0
    run = _after(r, run)
    r = reconcile_objects(run, _reporting(2, 95, 219.0, start_step=90), nodes, now=220.0)
    assert r.after.phase == "Running" and r.after.suspension.restart_seconds == 14.0  # 219 - 5 steps - 200
    assert r.after.goodput.wall_seconds == 120.0  # 220 - 100 suspended
    assert r.after.goodput.lost_seconds.schedule == 24.0  # the first start (10 s) and the restart (14 s)
    # the steps trained between the checkpoint (step 90) and the suspension (step 92, finished
    # while the gang stopped) are trained again: lost as recompute
    assert r.after.goodput.lost_seconds.recompute == 2.0
    assert r.after.goodput.productive_seconds == 94.0 and not r.after.restarts  # a suspension is no failure


def test_a_resume_finishes_stopping_a_gang_the_suspension_left_behind():
    """Suspended, but the deletes never landed (the operator was stopped after the status write)
    or a pod is stuck on a lost node: the resume deletes them, forcing after the teardown grace,
    and starts the next attempt only once they are gone."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    status = {"phase": "Suspended", "attempt": 1, "createdTime": 0.0, "firstProgressTime": 10.0,
              "suspension": {"since": 100.0}, "current": {"gangRunningTime": 5.0}}
    run = _run(status)  # spec.suspend cleared
    left = _reporting(1, 90, 99.0)
    r = reconcile_objects(run, left, nodes, now=110.0)
    assert {(e.name, e.grace) for e in r.effects if e.kind == "delete_pod"} == {(f"r-a1-{i}", 30) for i in range(4)}
    assert r.after.attempt == 1 and not r.ensured("Pod")
    stuck = [replace(x, deleting=True) for x in left]
    r = reconcile_objects(run, stuck, nodes, now=120.0)
    assert not [e for e in r.effects if e.kind == "delete_pod"]  # already going: not asked again in the grace
    r = reconcile_objects(run, stuck, nodes, now=131.0)  # past the 30 s grace since the suspension
    assert {(e.name, e.grace) for e in r.effects if e.kind == "delete_pod"} == {(f"r-a1-{i}", 0) for i in range(4)}
    r = reconcile_objects(run, [], nodes, now=132.0)
    assert r.after.attempt == 2 and len(r.ensured("Pod")) == SPEC["nodes"]


def test_a_step_going_back_is_progress_for_the_hang_clock():
    """A command trainer whose torchrun restarts its workers in place resumes from its checkpoint:
    the step it reports falls. That is progress, not a hang (the clock moved only on a rise)."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    status = {"phase": "Running", "attempt": 1, "createdTime": 0.0, "firstProgressTime": 10.0, "stepSeconds": 1.0,
              "current": {"gangRunningTime": 5.0, "lastStep": 90, "lastStepTime": 100.0}}
    r = reconcile_objects(_run(status), _reporting(1, 80, 150.0), nodes, now=150.0)
    assert r.after.current.last_step == 80 and r.after.current.last_step_time == 150.0
    assert r.after.step_seconds == 1.0  # a step back says nothing about the step time


def test_a_progress_time_from_the_future_is_dropped_and_named():
    """A pod whose clock jumped ahead (an NTP step) reports step end times in the future: the
    time is dropped (step time, goodput and the hang clock would follow it), the step is kept,
    and ProgressValid names the field."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    status = {"phase": "Running", "attempt": 1, "createdTime": 0.0, "firstProgressTime": 10.0, "stepSeconds": 1.0,
              "lastProgressTime": 99.0, "current": {"gangRunningTime": 5.0, "lastStep": 90, "lastStepTime": 100.0}}
    r = reconcile_objects(_run(status), _reporting(1, 91, 100.0 + 86_400), nodes, now=101.0)
    assert r.after.step == 91 and r.after.last_progress_time == 99.0 and r.after.step_seconds == 1.0
    cond = next(c for c in r.after.conditions if c.type == "ProgressValid")
    assert cond.status == "False" and "time" in cond.message


def test_a_pod_never_sent_sigterm_is_stopped_gracefully_however_late():
    """The suspension was written but its deletes never landed (the operator away longer than
    the grace): the pods still get a graceful delete first (the trainer saves on SIGTERM), and
    are forced only once their own grace period has run out (their deletionTimestamp)."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    status = {"phase": "Suspended", "attempt": 1, "createdTime": 0.0, "firstProgressTime": 10.0,
              "suspension": {"since": 100.0}, "current": {"gangRunningTime": 5.0}}
    for spec in ({"suspend": True}, {}):  # still suspended, or resumed meanwhile
        left = _reporting(1, 90, 99.0)
        r = reconcile_objects(_run(status, **spec), left, nodes, now=160.0)
        assert {(e.name, e.grace) for e in r.effects if e.kind == "delete_pod"} == {(f"r-a1-{i}", 30) for i in range(4)}
        going = [replace(x, deleting=True, gone_by=190.0) for x in left]
        assert not [e for e in reconcile_objects(_run(status, **spec), going, nodes, now=170.0).effects
                    if e.kind == "delete_pod"]
        r = reconcile_objects(_run(status, **spec), going, nodes, now=191.0)
        assert {(e.name, e.grace) for e in r.effects if e.kind == "delete_pod"} == {(f"r-a1-{i}", 0) for i in range(4)}


HBM_MESSAGE = ("neuron-runtime-fault: device NRT_EXEC_HW_ERR_HBM_UE local-rank -\n(FATAL-RT-UNDEFINED-STATE) "
               "Uncorrectable HBM memory error is detected. Execution results may be invalid.")


def _ended(i: int, code: int, message: str = "") -> object:
    term = {"exitCode": code, "reason": "Error", "finishedAt": "2026-01-01T00:00:00Z"}
    if message:
        term["message"] = message
    return pod_view({"metadata": {"name": f"r-a1-{i}", "labels": {"trainium.dev/attempt": "1", "trainium.dev/index": str(i)}},
                     "spec": {"nodeName": f"n{i}"},
                     "status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": term}}]}})


@pytest.mark.parametrize("trust", [False, True])
def test_a_culprit_that_reports_in_teardown_still_keeps_its_node_out(trust):
    """The victim's failure was acted on first (an application failure); the pod whose runtime
    timed out later ends in teardown saying so: its node is left out of the next attempt,
    avoided by this run (no taint: the run's own words, tied to no failure record); one such
    node per teardown; and the run tries it again after the budget window."""
    from trainium_operator.disruption_guard import DisruptionGuard
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    status = {"phase": "Restarting", "attempt": 1, "createdTime": 0.0, "firstProgressTime": 10.0,
              "current": {"gangRunningTime": 5.0, "teardownStartTime": 100.0, "restartNotBefore": 100.0},
              "failures": [{"id": 1, "time": 100.0, "cause": "application", "action": "restart", "node": "n0",
                            "pod": "r-a1-0", "attempt": 1}], "failureCount": 1, "restarts": {"application": 1}}
    pods = [_ended(0, 1), _ended(1, 143), _ended(2, 1, HBM_MESSAGE), _ended(3, 143)]
    r = reconcile_objects(_run(status), pods, nodes, now=103.0, guard=DisruptionGuard(trust_pod_reports=trust))
    # avoided whether trusted or not: a late report is tied to no failure record
    assert [a.node for a in r.after.avoided_nodes] == ["n2"] and not r.after.quarantined_nodes
    assert not [e for e in r.effects if e.kind == "quarantine"] and r.after.current.late_culprit == "n2"
    # the next attempt's pods stay off it
    run = _after(r, _run(status))
    r = reconcile_objects(run, [], nodes, now=104.0, guard=DisruptionGuard(trust_pod_reports=trust))
    pods = [e.obj for e in r.effects if e.kind == "ensure" and e.obj["kind"] == "Pod"]
    assert pods and all("n2" in str(p["spec"]["affinity"]["nodeAffinity"]) for p in pods)
    # the run tries the node again once the budget window has passed
    later = _after(r, run)
    later["status"] = {**later["status"], "phase": "Running", "attempt": 2}
    r = reconcile_objects(later, [], nodes, now=104.0 + 3601, guard=DisruptionGuard(trust_pod_reports=trust))
    assert r.after.avoided_nodes == []


def test_nodes_that_passed_the_preflight_check_recently_are_trusted_by_the_next_attempt():
    """The attempt's first report says how long its check took: its nodes passed then. The next
    attempt's pods are told so (every pod on such a node: the check is skipped), until
    preflightSkipMinutes have passed since; a node a skipped check trusted keeps its old time."""
    import json
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    pods = _reporting(1, 3, 99.0)
    for p in pods:
        p.progress = replace(p.progress, preflight_seconds=4.5)
    run = _run({"phase": "Running", "attempt": 1, "createdTime": 0.0, "firstProgressTime": 50.0,
                "current": {"gangRunningTime": 40.0, "lastStep": 2, "lastStepTime": 90.0}})
    r = reconcile_objects(run, pods, nodes, now=100.0)
    assert r.after.preflight_seconds == 4.5 and r.after.current.preflight_seconds == 4.5
    assert sorted((pp.node, pp.time) for pp in r.after.preflight_passed) == [(f"n{i}", 100.0) for i in range(4)]
    assert r.after.goodput.lost_seconds.preflight == 4.5
    # a later report of the same attempt adds nothing
    again = reconcile_objects(_after(r, run), pods, nodes, now=101.0)
    assert again.after.preflight_seconds == 4.5
    # the next attempt (teardown done, no pods left) trusts them ...
    restarting = _after(r, run)
    restarting["status"] = {**restarting["status"], "phase": "Restarting",
                            "current": {**restarting["status"]["current"], "teardownStartTime": 200.0,
                                        "restartNotBefore": 200.0}}
    r2 = reconcile_objects(restarting, [], nodes, now=300.0)
    made = [e.obj for e in r2.effects if e.kind == "ensure" and e.obj["kind"] == "Pod"]
    env = {e["name"]: e.get("value") for e in made[0]["spec"]["containers"][0]["env"]}
    # the list by file, from one ConfigMap every pod given it mounts (never in the environment,
    # nor on each pod)
    assert env["TRAINER_PREFLIGHT_PASSED_FILE"] == "/etc/trainium-preflight/passed"
    (lists,) = [e.obj for e in r2.effects if e.kind == "ensure" and e.obj["kind"] == "ConfigMap"
                and "-preflight-" in e.obj["metadata"]["name"]]
    assert sorted(lists["data"]["passed"].split()) == sorted(node_token(f"n{i}") for i in range(4))
    assert lists["metadata"]["ownerReferences"][0]["uid"] == run["metadata"]["uid"]
    # and the run's lists no pod mounts go (the pods, read back, name the list they mount)
    (prune,) = [e for e in r2.effects if e.kind == "prune_preflight_lists"]
    assert prune.keep == {lists["metadata"]["name"]}
    assert pod_view(made[0]).preflight_map == lists["metadata"]["name"]
    assert r2.after.current.preflight_trusted == ["n0", "n1", "n2", "n3"]
    for made_pod in made:
        volume = next(v for v in made_pod["spec"]["volumes"] if v["name"] == "trainium-preflight")
        assert volume == {"name": "trainium-preflight", "configMap": {"name": lists["metadata"]["name"]}}
        assert "trainium.dev/preflight-passed" not in made_pod["metadata"]["annotations"]
    assert {"name": "trainium-preflight", "mountPath": "/etc/trainium-preflight", "readOnly": True} in \
        made[0]["spec"]["containers"][0]["volumeMounts"]
    assert "--preflight" in made[0]["spec"]["containers"][0]["command"]
    # ... until preflightSkipMinutes (60) have passed since they passed
    r3 = reconcile_objects(restarting, [], nodes, now=100.0 + 3601)
    made = [e.obj for e in r3.effects if e.kind == "ensure" and e.obj["kind"] == "Pod"]
    assert "TRAINER_PREFLIGHT_PASSED" not in json.dumps(made[0]["spec"]["containers"][0]["env"])
    assert "trainium-preflight" not in json.dumps(made[0]["spec"]["volumes"])
    assert not [e for e in r3.effects if e.kind == "ensure" and "-preflight-" in e.obj["metadata"]["name"]]


def test_four_thousand_nodes_that_passed_fit_one_config_map_and_never_the_environment():
    """Issue 48: the list of 4,096 EKS node names was about 180 KB in one environment variable, past
    the kernel's 128 KB for one (E2BIG: the container would not start). As tokens it is 53 KB,
    stored once in a ConfigMap (1 MiB) that the pods given it share: the same list, the same
    object (named by its content); another list, another object."""
    from trainium_operator.plan import preflight_list, preflight_map
    names = [f"ip-10-{i // 250}-{i % 250}-{i % 7}.us-west-2.compute.internal" for i in range(4096)]
    listed = preflight_list(names)
    assert len(listed.encode()) == 4096 * 13 and len(listed.encode()) < 1024 * 1024 // 16
    spec = parse(SPEC)  # (a Trainium type: the check is on)
    one, same = preflight_map(RUN, spec, names), preflight_map(RUN, spec, list(reversed(names)))
    assert one == same and one["data"]["passed"] == listed
    assert preflight_map(RUN, spec, names[1:])["metadata"]["name"] != one["metadata"]["name"]
    assert preflight_map(RUN, spec, []) is None
    assert len(set(listed.split())) == 4096  # no two of these names share a token
    assert preflight_list([]) == ""
    assert preflight_list(names, room=len(listed) - 1) == ""  # past its room: left out, the check runs


def test_the_run_shows_a_preflight_phase_while_its_pods_say_the_check_runs():
    """Starting -> Preflight when every pod runs and one says its check is under way (the
    launcher's annotation); Preflight -> Running at the first report, the message cleared. A
    check every node of the gang may skip shows no Preflight; a pod's other values are ignored."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}

    def pods(value, step=None):
        out = []
        for i in range(4):
            ann = {"trainium.dev/preflight": value} if value else {}
            if step:
                ann["trainium.dev/progress"] = f'{{"step": {step}, "time": 100.0}}'
            out.append(pod_view({"metadata": {"name": f"r-a1-{i}", "annotations": ann, "labels": {
                "trainium.dev/attempt": "1", "trainium.dev/index": str(i)}}, "spec": {"nodeName": f"n{i}"},
                "status": {"phase": "Running"}}))
        return out
    run = _run({"phase": "Starting", "attempt": 1, "createdTime": T0})
    r = reconcile_objects(run, pods("running"), nodes, now=T0 + 5)
    assert r.status["phase"] == "Preflight" and "pre-flight check of the gang's 4 nodes" in r.after.message
    assert "Preflight" in [e.reason for e in r.effects if e.kind == "event"]
    run = _after(r, run)
    # the check passed; pre-compiling and the first step may take minutes: not "Preflight" then
    r = reconcile_objects(run, pods("done"), nodes, now=T0 + 600)
    assert r.status["phase"] == "Starting" and "pre-flight check passed" in r.after.message
    r = reconcile_objects(_after(r, run), pods("done", step=1), nodes, now=T0 + 620)
    assert r.status["phase"] == "Running"
    for value in ("", "passed", "running!"):  # not the launcher's word
        r = reconcile_objects(_run({"phase": "Starting", "attempt": 1, "createdTime": T0}), pods(value), nodes,
                              now=T0 + 5)
        assert r.after.phase == "Starting"
    trusted = _run({"phase": "Starting", "attempt": 1, "createdTime": T0,
                    "current": {"preflightTrusted": ["n0", "n1", "n2", "n3"]}})
    assert reconcile_objects(trusted, pods("running"), nodes, now=T0 + 5).after.phase == "Starting"


def test_an_attempts_checkpoint_restore_is_goodput_s_own_phase():
    """Each pod reports what reading and loading its checkpoint took; the slowest pod's time is
    the attempt's (the gang trains when it is done), counted once per attempt and taken out of
    schedule time as lostSeconds.restore."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    pods = _reporting(1, 3, 99.0)
    for i, p in enumerate(pods):
        p.progress = replace(p.progress, restore_seconds=[2.5, 6.0, 3.0, 1.0][i])
    run = _run({"phase": "Running", "attempt": 1, "createdTime": 0.0, "firstProgressTime": 50.0,
                "current": {"gangRunningTime": 40.0, "lastStep": 2, "lastStepTime": 90.0}})
    r = reconcile_objects(run, pods, nodes, now=100.0)
    assert r.after.current.restore_seconds == 6.0 and r.after.restore_seconds == 6.0
    assert r.after.goodput.lost_seconds.restore == 6.0
    again = reconcile_objects(_after(r, run), pods, nodes, now=101.0)  # said once per attempt
    assert again.after.restore_seconds == 6.0
    assert again.after.goodput.lost_seconds.schedule + again.after.goodput.lost_seconds.restore == \
        r.after.goodput.lost_seconds.schedule + 6.0


def test_restore_and_check_times_rise_to_the_slowest_pod_as_reports_arrive():
    """A pass may see only some pods' first reports: the attempt's figure rises to the slowest
    pod's when the others arrive, and the run's total by the difference only."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    run = _run({"phase": "Running", "attempt": 1, "createdTime": 0.0, "firstProgressTime": 50.0,
                "current": {"gangRunningTime": 40.0, "lastStep": 2, "lastStepTime": 90.0}})
    pods = _reporting(1, 3, 99.0)
    for p in pods:
        p.progress = None
    pods[0].progress = ProgressReport(step=3, time=99.0, restore_seconds=2.5, preflight_seconds=4.0, start_step=None)
    r = reconcile_objects(run, pods, nodes, now=100.0)
    assert (r.after.restore_seconds, r.after.preflight_seconds) == (2.5, 4.0)
    for i, p in enumerate(pods):
        p.progress = ProgressReport(step=3, time=99.0, restore_seconds=[2.5, 6.0, 3.0, 1.0][i],
                                    preflight_seconds=[4.0, 4.5, 4.0, 4.0][i], start_step=None)
    r = reconcile_objects(_after(r, run), pods, nodes, now=101.0)
    assert (r.after.current.restore_seconds, r.after.restore_seconds) == (6.0, 6.0)
    assert (r.after.current.preflight_seconds, r.after.preflight_seconds) == (4.5, 4.5)
    assert r.after.goodput.lost_seconds.restore == 6.0


def test_a_restart_seen_late_is_dated_from_the_trainers_first_step():
    """The operator was down while the new attempt started: the first report it sees is 5 steps
    in. With the trainer's ``firstStepTime`` the restart's training start is one step time before
    that step ended, whatever the run's step time says; without it, goodput reckons back by 5
    step times (the run's median, which a warm-up on a busy machine can inflate). A first step
    time outside the attempt (before its start, after its newest step: garbage, or a clock far
    off) is not used. Reports of another attempt's workers are not this attempt's."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    status = {"phase": "Starting", "attempt": 2, "createdTime": 0.0, "firstProgressTime": 10.0,
              "firstProgressSteps": 1, "stepSeconds": 2.0,
              "failures": [{"id": 1, "time": 100.0, "attempt": 1, "lastProgressTime": 98.0, "step": 95,
                            "checkpointStep": 90, "teardownDoneTime": 101.0, "recoveredTime": 104.0,
                            "restart": "inPlace"}],
              "failureCount": 1, "current": {"startTime": 102.0, "gangRunningTime": 104.0}}

    def resumed(**fields):
        r = reconcile_objects(_run(status), _reporting(2, 95, 120.0, start_step=90, **fields), nodes, now=121.0)
        return r.after.failures[-1].resumed_time, r.after.failures[-1].resumed_steps

    assert resumed(firstStepTime=111.5, written_by=2) == (111.5, 1)
    assert resumed() == (120.0, 5)
    for outside in (5e9, 1.0, 101.9):
        assert resumed(firstStepTime=outside) == (120.0, 5), outside
    # attempt 1's workers' report, still on a pod restarted in place: no progress of attempt 2
    assert resumed(firstStepTime=111.5, written_by=1) == (None, None)
    # the pods' first steps end apart (their clocks, the report's rounding): the last one's
    pods = _reporting(2, 95, 120.0, start_step=90, firstStepTime=111.5)
    pods[2] = _reporting(2, 95, 120.0, start_step=90, firstStepTime=111.9)[2]
    late = reconcile_objects(_run(status), pods, nodes, now=121.0).after.failures[-1]
    assert (late.resumed_time, late.resumed_steps) == (111.9, 1)


def test_the_first_start_and_a_resume_are_dated_from_the_trainers_first_step():
    """The first start's schedule time ends one step time before the first step ended, as the
    trainer reports it, and so does the restart after a resume (spec.suspend cleared)."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    status = {"phase": "Starting", "attempt": 1, "createdTime": 0.0, "stepSeconds": 1.0,
              "current": {"startTime": 0.0, "gangRunningTime": 5.0}}
    r = reconcile_objects(_run(status), _reporting(1, 6, 20.0, firstStepTime=15.0), nodes, now=21.0)
    assert (r.after.first_progress_time, r.after.first_progress_steps) == (15.0, 1)
    assert r.after.goodput.lost_seconds.schedule == 14.0  # 15 - 1 step - 0
    resuming = {"phase": "Starting", "attempt": 2, "createdTime": 0.0, "firstProgressTime": 10.0,
                "firstProgressSteps": 1, "stepSeconds": 1.0,
                "suspension": {"seconds": 100.0, "resumedTime": 200.0, "step": 90},
                "current": {"startTime": 200.0, "gangRunningTime": 205.0}}
    r = reconcile_objects(_run(resuming), _reporting(2, 95, 219.0, start_step=90, firstStepTime=211.0), nodes,
                          now=220.0)
    assert r.after.suspension.restart_seconds == 10.0  # 211 - 1 step - 200 (not 219 - 5 steps - 200)


def test_an_attempt_first_seen_failed_still_ends_the_restart_before_it():
    """The operator was down while attempt 2 trained from 80 and crashed: the pass that sees its
    reports and its crash at once dates the restart before it from the first step all the same
    (the attempt's training is not counted as the restart's schedule time)."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    status = {"phase": "Starting", "attempt": 2, "createdTime": 0.0, "firstProgressTime": 10.0,
              "firstProgressSteps": 1, "stepSeconds": 1.0,
              "failures": [{"id": 1, "time": 70.0, "attempt": 1, "lastProgressTime": 69.0, "step": 60,
                            "checkpointStep": 60, "teardownDoneTime": 72.0, "restart": "recreate"}],
              "failureCount": 1, "current": {"startTime": 73.0}}
    pods = _reporting(2, 120, 150.0, start_step=60, firstStepTime=80.0)
    pods[0] = replace(pods[0], phase="Failed", exit_code=1, reason="Error")
    r = reconcile_objects(_run(status), pods, nodes, now=151.0)
    first = r.after.failures[0]
    assert len(r.after.failures) == 2 and (first.resumed_time, first.resumed_steps, first.resumed_step) == (80.0, 1, 60)


def test_a_gang_not_placed_whole_is_released_and_placed_again_without_spending_a_budget():
    """Gang admission without a queue: part of the gang placed, the rest Unschedulable (another
    run holds the rest of the pool) past scheduleTimeoutSeconds: every pod is released (a
    recreate), the next gang is made after a jittered backoff, and no budget, streak or
    no-progress count moves, however often it happens."""
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/3 nodes are available: 1 Insufficient aws.amazon.com/neuron, 2 node(s) didn't "
                                "match pod anti-affinity rules"}

    def gang(attempt: int, created: float) -> list:
        return [pod_view({"metadata": {"name": f"r-a{attempt}-{i}", "creationTimestamp": created,
                                       "labels": {"trainium.dev/attempt": str(attempt), "trainium.dev/index": str(i)}},
                          "spec": {"nodeName": f"n{i}"} if i < 2 else {},
                          "status": {"phase": "Running" if i < 2 else "Pending",
                                     "conditions": [] if i < 2 else [unschedulable]}}) for i in range(4)]
    run = _run({"phase": "Starting", "attempt": 1, "createdTime": 0.0, "current": {"startTime": 0.0}},
               faultTolerance={"scheduleTimeoutSeconds": 60, "restartBudget": {"scheduling": 1}})
    now, attempt, nodes = 62.0, 1, {f"n{i}": _node(f"n{i}") for i in range(3)}
    for wait in range(3):  # three times in a row: more than the scheduling budget of 1
        r = reconcile_objects(run, gang(attempt, now - 61.5), nodes, now=now)
        failure = r.after.failures[-1]
        assert r.after.phase == "Restarting", (wait, r.after.message)
        assert failure.cause == "scheduling" and failure.restart == "recreate" and failure.action == "restart"
        assert "2 of 4 pod(s) unscheduled" in failure.message and "placed whole or not at all" in r.after.message
        assert not (r.after.failure_counters.recent.get("scheduling") if r.after.failure_counters else None)
        delay = r.after.current.restart_not_before - now
        assert 0.5 * 10 * 2 ** wait <= delay < 1.5 * 10 * 2 ** wait, (wait, delay)
        assert {e.name for e in r.effects if e.kind == "delete_pod"} >= {f"r-a{attempt}-{i}" for i in range(4)}
        run = _after(r, run)
        # the gang's pods gone, the backoff over: the next attempt's gang is made whole
        r = reconcile_objects(run, [], nodes, now=now + delay + 1)
        run, attempt, now = _after(r, run), r.after.attempt, now + delay + 62.0
        assert r.after.phase == "Starting" and len(r.ensured("Pod")) == 4, r.after.message
    assert r.after.restarts == {"scheduling": 3}


@pytest.mark.parametrize("why, placed_but_not_started", [
    ("0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector", False),
    ("0/3 nodes are available: 3 node(s) had untolerated taint {dedicated: other}", False),
    ("0/3 nodes are available: 3 Insufficient aws.amazon.com/neuron", True),
])
def test_a_gang_nothing_would_place_spends_the_scheduling_budget(why, placed_but_not_started):
    """Not a wait for capacity: a selector or a taint no node matches would never be placed, and a
    placed pod that has not started is the startup rule's; both spend restartBudget.scheduling."""
    pending = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}
    started = {"state": {"running": {}}} if not placed_but_not_started else \
        {"state": {"waiting": {"reason": "ImagePullBackOff"}}}
    pods = [pod_view({"metadata": {"name": f"r-a1-{i}", "creationTimestamp": 1.0,
                                   "labels": {"trainium.dev/attempt": "1", "trainium.dev/index": str(i)}},
                      "spec": {"nodeName": f"n{i}"} if i < 2 else {},
                      "status": {"phase": "Pending" if i >= 2 or placed_but_not_started else "Running",
                                 "containerStatuses": [started] if i < 2 else [],
                                 "conditions": [] if i < 2 else [pending]}}) for i in range(4)]
    run = _run({"phase": "Starting", "attempt": 1, "createdTime": 0.0, "current": {"startTime": 0.0}},
               faultTolerance={"scheduleTimeoutSeconds": 60})
    r = reconcile_objects(run, pods, {f"n{i}": _node(f"n{i}") for i in range(3)}, now=62.0)
    assert r.after.failures[-1].cause == "scheduling" and "placed whole" not in r.after.message
    assert r.after.failure_counters.recent["scheduling"] == [62.0]  # the budget is spent


def test_a_placed_pod_on_its_way_to_start_does_not_turn_a_wait_for_capacity_into_a_failure():
    """Two pods placed and still starting (init containers running: PodInitializing), two
    Insufficient: the usual race for a pool, a capacity wait, not the scheduling budget."""
    pending = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
               "message": "0/3 nodes are available: 3 Insufficient aws.amazon.com/neuron"}
    initializing = {"state": {"waiting": {"reason": "PodInitializing"}}}
    pods = [pod_view({"metadata": {"name": f"r-a1-{i}", "creationTimestamp": 1.0,
                                   "labels": {"trainium.dev/attempt": "1", "trainium.dev/index": str(i)}},
                      "spec": {"nodeName": f"n{i}"} if i < 2 else {},
                      "status": {"phase": "Pending", "containerStatuses": [initializing] if i < 2 else [],
                                 "conditions": [{"type": "PodScheduled", "status": "True",
                                                 "lastTransitionTime": 2.0}] if i < 2 else [pending]}})
            for i in range(4)]
    run = _run({"phase": "Starting", "attempt": 1, "createdTime": 0.0, "current": {"startTime": 0.0}},
               faultTolerance={"scheduleTimeoutSeconds": 60})
    r = reconcile_objects(run, pods, {f"n{i}": _node(f"n{i}") for i in range(3)}, now=62.0)
    assert "placed whole or not at all" in r.after.message
    assert not (r.after.failure_counters.recent.get("scheduling") if r.after.failure_counters else None)


def test_the_preflight_lists_names_are_the_operators_and_a_run_accepted_before_keeps_its_own():
    """Found by review: the new volume, mount path and variable of the pre-flight list are the
    operator's; a run an earlier release accepted while they were free keeps them (its spec
    still parses: it stays supervised) and its pods go without the list (the check runs); the
    variable an earlier trainer image reads stays refused (set by hand it would skip the check)."""
    from trainium_api.fields import ConfigError
    from trainium_operator.plan import pod
    own = {**SPEC, "volumes": [{"name": "trainium-preflight", "emptyDir": {}}],
           "volumeMounts": [{"name": "trainium-preflight", "mountPath": "/etc/trainium-preflight"}],
           "env": [{"name": "TRAINER_PREFLIGHT_PASSED_FILE", "value": "/mine"}]}
    for field, patch in (("spec.volumes[0].name", {k: own[k] for k in ("volumes", "volumeMounts")}),
                         ("spec.env[0].name", {"env": own["env"]}),
                         ("spec.env[0].name", {"env": [{"name": "TRAINER_PREFLIGHT_PASSED", "value": "n0"}]})):
        with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
            parse({**SPEC, **patch})
    with pytest.raises(ConfigError, match="TRAINER_PREFLIGHT_PASSED"):
        parse({**SPEC, "env": [{"name": "TRAINER_PREFLIGHT_PASSED", "value": "n0"}]}, accepted_before=True)
    from trainium_operator.plan import with_list
    assert "configMap" in next(v for v in pod(RUN, parse(SPEC), 2, 0, [], preflight_trusted=["n0", "n1"])[
        "spec"]["volumes"] if v["name"] == "trainium-preflight")  # (a run of its own names has it)
    kept = parse(own, accepted_before=True)
    made = pod(RUN, kept, 2, 0, [], preflight_trusted=["n0", "n1"])
    assert with_list(RUN, kept, ["n0", "n1"]) == []
    env = {e["name"]: e.get("value") for e in made["spec"]["containers"][0]["env"]}
    assert env["TRAINER_PREFLIGHT_PASSED_FILE"] == "/mine"  # the run's own, untouched
    assert [v["name"] for v in made["spec"]["volumes"]].count("trainium-preflight") == 1


def test_the_gangs_checkpoint_time_is_its_pods_own_and_one_pods_garbage_does_not_take_it_away():
    """gang_state's lastCheckpointTime: the pods' time of the newest checkpointed step, from
    reports whose time of it is not after their own newest step (a time in the future written
    by user code would make goodput drop the others' and fall back to the estimate)."""
    def pod(i: int, report: dict):
        return pod_view({"metadata": {"name": f"r-a1-{i}", "labels": {"trainium.dev/attempt": "1",
                                                                      "trainium.dev/index": str(i)},
                                      "annotations": {"trainium.dev/progress": json.dumps(report)}},
                         "spec": {"nodeName": f"n{i}"}, "status": {"phase": "Running"}})
    good = {"step": 18, "time": 1000.0, "lastCheckpointStep": 15, "lastCheckpointTime": 998.5}
    assert gang_state([pod(0, good), pod(1, {**good, "lastCheckpointTime": 998.6})]).last_checkpoint_time == 998.6
    future = {**good, "lastCheckpointTime": 9e10}
    assert gang_state([pod(0, good), pod(1, future)]).last_checkpoint_time == 998.5
    # a time without a checkpoint step is not one
    assert gang_state([pod(0, {"step": 3, "time": 10.0, "lastCheckpointTime": 9.0})]).last_checkpoint_time is None
