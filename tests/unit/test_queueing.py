"""queueing and workload: the operator as the owner of a run's Kueue Workload, pass by pass
(tables over whole passes: reconcile over plain objects, the Workload as Kueue writes it).
Kueue's real controller runs in tests/cluster/test_kueue.py."""

from __future__ import annotations

import pytest

from tests.unit.test_operator_core import RUN, SPEC, _node
from trainium_api.progress import ProgressReport
from trainium_operator import workload
from trainium_operator.effects import DeletePod, Ensure, PatchWorkload
from trainium_operator.judge import Observed, _unborn, Clocks
from trainium_operator.observe import PodView, gang_state
from trainium_operator.queueing import state_of
from trainium_operator.reconcile import reconcile_objects
from trainium_operator.spec import parse

NOW = 1000.0
QUEUED_LABELS = {workload.QUEUE_LABEL: "team"}
T0 = "2026-01-01T00:00:00Z"


def run(status: dict | None = None, labels: dict | None = None, **spec) -> dict:
    meta = {**RUN["metadata"], "labels": dict(QUEUED_LABELS if labels is None else labels)}
    return {"metadata": meta, "spec": {**SPEC, **spec},
            "status": {"conditions": [{"type": "Valid", "status": "True"}], **(status or {})}}


def cond(kind: str, status: str, reason: str = "", message: str = "") -> dict:
    return {"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": T0}


def wl(*conditions: dict, admitted_to: str = "", flavor: str = "trn1", owner: str = "u-1", active: bool = True,
       checks: list | None = None) -> workload.WorkloadView:
    status: dict = {"conditions": list(conditions)}
    if admitted_to:
        status["admission"] = {"clusterQueue": admitted_to, "podSetAssignments": [
            {"name": "trainer", "count": 4, "flavors": {"aws.amazon.com/neuron": flavor,
                                                        "vpc.amazonaws.com/efa": flavor}}]}
    if checks is not None:
        status["admissionChecks"] = checks
    return workload.view({"metadata": {"name": "trainingrun-r", "resourceVersion": "7", "generation": 1,
                                       "ownerReferences": [{"uid": owner, "controller": True}]},
                          "spec": {"active": active}, "status": status})


ADMITTED = (cond("QuotaReserved", "True", "QuotaReserved"), cond("Admitted", "True", "Admitted"))
FLAVORS = {"trn1": workload.flavor_view({"spec": {"nodeLabels": {"karpenter.sh/nodepool": "trn1-reserved"},
                                                  "tolerations": [{"key": "reserved", "operator": "Exists",
                                                                   "effect": "NoSchedule"}]}})}


def running(attempt: int = 1, n: int = 4, **kw) -> list[PodView]:
    return [PodView(f"r-a{attempt}-{i}", attempt, i, "Running", f"n{i}", False, **kw) for i in range(n)]


def pods_of(result) -> list[dict]:
    return result.ensured("Pod")


def patches(result) -> list[PatchWorkload]:
    return [e for e in result.effects if isinstance(e, PatchWorkload)]


def active_patches(result) -> list[dict]:
    """The spec.active patches (not the pod sets' updates)."""
    return [x.patch for x in patches(result) if not x.status and "active" in x.patch.get("spec", {})]


def conditions_in(patch: PatchWorkload) -> dict[str, dict]:
    return {c["type"]: c for c in patch.patch["status"]["conditions"]}


# -- before admission ------------------------------------------------------------------------

QUEUED = [
    # name, the Workload as seen, queue state, Kueue's reason, words of its message
    ("no Workload seen yet", None, "Queued", "Creating", "being created"),
    ("waiting for quota", wl(cond("QuotaReserved", "False", "Pending", "couldn't assign flavors to pod set trainer: "
                                  "insufficient unused quota for aws.amazon.com/neuron in flavor trn1")),
     "Queued", "Pending", "insufficient unused quota"),
    ("quota reserved, admission checks pending", wl(cond("QuotaReserved", "True", "QuotaReserved"),
                                                    admitted_to="cq", checks=[{"name": "prov", "state": "Pending"}]),
     "Queued", "QuotaReserved", "waiting for admission checks"),
    ("another run's Workload of the same name", wl(*ADMITTED, admitted_to="cq", owner="u-old"), "Queued", "Creating",
     "being created"),
]


@pytest.mark.parametrize("name,w,state,reason,words", QUEUED, ids=[c[0] for c in QUEUED])
def test_a_queued_run_makes_its_workload_and_no_pod_until_admitted(name, w, state, reason, words):
    r = reconcile_objects(run(), [], {}, now=NOW, workload=w, flavors=FLAVORS)
    assert r.after.phase == "Queued" and r.after.attempt == 0 and not pods_of(r)
    (made,) = r.ensured("Workload")
    assert made["spec"]["queueName"] == "team" and made["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert [(s["name"], s["count"]) for s in made["spec"]["podSets"]] == [("trainer", 4)]
    requests = made["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests == {"aws.amazon.com/neuron": "16", "vpc.amazonaws.com/efa": "8"}
    q = r.after.queue
    assert (q.state, q.reason) == (state, reason) and words in q.message and q.workload == "trainingrun-r"
    assert r.after.created_time is None  # no clock runs while queued


def test_an_unlabelled_run_has_no_workload_and_starts_at_once():
    r = reconcile_objects(run(labels={}), [], {}, now=NOW)
    assert not r.ensured("Workload") and r.after.queue is None and len(pods_of(r)) == 4


def test_a_priority_class_label_names_the_workload_priority_class_and_spares_share_the_gangs_pod_set():
    r = reconcile_objects(run(labels={**QUEUED_LABELS, workload.PRIORITY_LABEL: "high"},
                              faultTolerance={"spares": 1}), [], {}, now=NOW)
    (made,) = r.ensured("Workload")
    assert made["spec"]["priorityClassRef"] == {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                                "name": "high"}
    # one pod set, so one flavor for the gang and its spares (a spare takes a gang pod's place)
    assert [(s["name"], s["count"]) for s in made["spec"]["podSets"]] == [("trainer", 5)]
    assert made["spec"]["active"] is True


# -- admitted --------------------------------------------------------------------------------

def test_without_the_label_the_pods_priority_class_is_the_workloads():
    r = reconcile_objects(run(podTemplate={"spec": {"priorityClassName": "training-high"}}), [], {}, now=NOW)
    (made,) = r.ensured("Workload")
    assert made["spec"]["priorityClassRef"] == {"group": "scheduling.k8s.io", "kind": "PriorityClass",
                                                "name": "training-high"}


def test_a_template_edited_while_the_run_holds_no_quota_reaches_the_workloads_pod_sets():
    status = {"phase": "Suspended", "queue": {"workload": "trainingrun-r", "state": "Queued", "deactivated": True}}
    edited = run(status, suspend=True, podTemplate={"spec": {"resources": {"requests": {"cpu": "8"}}}})
    w = wl(cond("QuotaReserved", "False", "Pending"), active=False)  # its digest: the old pod sets'
    (patch,) = [x for x in patches(reconcile_objects(edited, [], {}, now=NOW, workload=w)) if "podSets" in
                x.patch.get("spec", {})]
    requests = patch.patch["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests["cpu"] == "8" and patch.patch["metadata"]["annotations"][workload.DIGEST_ANNOTATION]
    held = wl(*ADMITTED, admitted_to="cq")  # with quota reserved, Kueue's CRD refuses it: not asked
    r = reconcile_objects(run({"phase": "Running", "attempt": 1}, podTemplate={"spec": {"resources": {
        "requests": {"cpu": "8"}}}}), running(), {f"n{i}": _node(f"n{i}") for i in range(4)}, now=NOW, workload=held,
        flavors=FLAVORS)
    assert not [x for x in patches(r) if "podSets" in x.patch.get("spec", {})]


def test_admitted_the_gang_starts_with_the_flavors_node_labels_and_tolerations():
    r = reconcile_objects(run({"phase": "Queued"}), [], {}, now=NOW,
                          workload=wl(*ADMITTED, admitted_to="cq"), flavors=FLAVORS)
    assert r.after.phase == "Starting" and r.after.attempt == 1
    pods = pods_of(r)
    assert len(pods) == 4
    for p in pods:
        assert p["spec"]["nodeSelector"] == {"karpenter.sh/nodepool": "trn1-reserved",
                                             "node.kubernetes.io/instance-type": "trn1.32xlarge"}
        assert {"key": "reserved", "operator": "Exists", "effect": "NoSchedule"} in p["spec"]["tolerations"]
        assert p["metadata"]["labels"][workload.PODSET_LABEL] == "trainer"
        assert p["metadata"]["labels"][workload.QUEUE_LABEL] == "team"
    assert (r.after.queue.state, r.after.queue.cluster_queue) == ("Admitted", "cq")
    (ready,) = patches(r)  # PodsReady False, waiting for the start
    assert conditions_in(ready)["PodsReady"]["reason"] == "WaitForStart"
    assert ready.patch["metadata"]["resourceVersion"] == "7"  # refused if the Workload changed since


def test_admission_checks_pod_set_updates_reach_the_pods():
    w = wl(*ADMITTED, admitted_to="cq", checks=[{"name": "prov", "state": "Ready", "podSetUpdates": [
        {"name": "trainer", "labels": {"capacity": "block-1"}, "nodeSelector": {"capacity-block": "cb-1"}}]}])
    r = reconcile_objects(run({"phase": "Queued"}), [], {}, now=NOW, workload=w, flavors=FLAVORS)
    p = pods_of(r)[0]
    assert p["metadata"]["labels"]["capacity"] == "block-1" and p["spec"]["nodeSelector"]["capacity-block"] == "cb-1"


PODS_READY = [
    # name, phase, PodsReady as Kueue last had it, -> PodsReady written (status, reason) or None
    ("the gang runs: Started", "Running", None, ("True", "Started")),
    ("every pod runs before the first step (compile, restore): Started", "Starting", None, ("True", "Started")),
    ("already said", "Running", cond("PodsReady", "True", "Started"), None),
    ("a restart after it ran: WaitForRecovery", "Restarting", cond("PodsReady", "True", "Started"),
     ("False", "WaitForRecovery")),
    ("running again after it: Recovered", "Running", cond("PodsReady", "False", "WaitForRecovery"),
     ("True", "Recovered")),
    ("still recovering: nothing new", "Restarting", cond("PodsReady", "False", "WaitForRecovery"), None),
]


@pytest.mark.parametrize("name,phase,before,written", PODS_READY, ids=[c[0] for c in PODS_READY])
def test_pods_ready_follows_the_gang(name, phase, before, written):
    status = {"phase": phase, "attempt": 1, "createdTime": NOW - 100, "current": {"startTime": NOW - 90,
                                                                                  "gangRunningTime": NOW - 80},
              "lastProgressTime": NOW - 1, "step": 5, "queue": {"workload": "trainingrun-r", "state": "Admitted"}}
    if phase == "Restarting":
        status.update(attempt=2, current={"startTime": NOW - 5, "teardownStartTime": NOW - 5,
                                          "restartNotBefore": NOW + 100, "restart": "recreate"})
    if phase == "Starting":
        status.update(current={"startTime": NOW - 5}, step=None, lastProgressTime=None)
    w = wl(*ADMITTED, *([before] if before else []), admitted_to="cq")
    pods = (running(progress=ProgressReport(step=5, time=NOW - 1)) if phase == "Running" else
            running() if phase == "Starting" else [])
    r = reconcile_objects(run(status), pods, {f"n{i}": _node(f"n{i}") for i in range(4)}, now=NOW, workload=w,
                          flavors=FLAVORS)
    got = [conditions_in(x)["PodsReady"] for x in patches(r)]
    assert [(c["status"], c["reason"]) for c in got] == ([written] if written else [])


# -- eviction, preemption --------------------------------------------------------------------

PREEMPTED = (cond("QuotaReserved", "True", "QuotaReserved"), cond("Admitted", "True", "Admitted"),
             cond("Evicted", "True", "Preempted", "Preempted to accommodate a workload (UID: x) due to "
                  "prioritization in the ClusterQueue"),
             cond("Preempted", "True", "InClusterQueue", "Preempted to accommodate a workload"))


def test_a_preempted_run_stops_its_gang_gracefully_and_spends_nothing():
    status = {"phase": "Running", "attempt": 1, "createdTime": NOW - 100, "firstProgressTime": NOW - 90,
              "current": {"startTime": NOW - 95, "gangRunningTime": NOW - 92}, "lastProgressTime": NOW - 1, "step": 5,
              "queue": {"workload": "trainingrun-r", "state": "Admitted", "reason": "Admitted", "since": NOW - 95}}
    r = reconcile_objects(run(status), running(), {f"n{i}": _node(f"n{i}") for i in range(4)}, now=NOW,
                          workload=wl(*PREEMPTED, admitted_to="cq"), flavors=FLAVORS)
    graces = {e.grace for e in r.effects if isinstance(e, DeletePod)}
    assert len([e for e in r.effects if isinstance(e, DeletePod)]) == 4 and 0 not in graces  # graceful: a save
    assert r.after.phase == "Queued" and not r.after.failures and not r.after.restart_count
    q = r.after.queue
    assert (q.state, q.reason, q.evictions) == ("Preempted", "InClusterQueue", 1)
    assert r.after.suspension.since == NOW  # the time queued leaves goodput's wall time
    # the quota is handed back only once the gang is gone (PodsReady says False meanwhile, as
    # jobframework's does for a job that is not admitted)
    assert [list(conditions_in(x)) for x in patches(r) if "admission" in x.patch["status"]] == []
    assert [e.reason for e in r.effects if e.kind == "event"] == ["Preempted"]


@pytest.mark.parametrize("reason,requeued", [("Preempted", "True"), ("PodsReadyTimeout", "False")])
def test_once_the_gang_is_gone_the_quota_is_handed_back(reason, requeued):
    status = {"phase": "Queued", "attempt": 1, "createdTime": NOW - 100, "suspension": {"since": NOW - 10},
              "queue": {"workload": "trainingrun-r", "state": "Preempted", "since": NOW - 10, "evictions": 1}}
    w = wl(cond("QuotaReserved", "True", "QuotaReserved"), cond("Admitted", "True", "Admitted"),
           cond("Evicted", "True", reason, "evicted"), admitted_to="cq")
    r = reconcile_objects(run(status), [], {}, now=NOW, workload=w, flavors=FLAVORS)
    (back,) = patches(r)
    assert back.status and back.patch["status"]["admission"] is None
    c = conditions_in(back)
    assert (c["QuotaReserved"]["status"], c["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert (c["Admitted"]["status"], c["Admitted"]["reason"]) == ("False", "NoReservation")
    assert (c["Requeued"]["status"], c["Requeued"]["reason"]) == (requeued, reason)
    assert c["Evicted"]["status"] == "True"  # Kueue's own, kept
    assert r.after.queue.evictions == 1 and not pods_of(r)  # counted once


def test_admitted_again_the_next_attempt_resumes_from_the_newest_save():
    status = {"phase": "Queued", "attempt": 1, "createdTime": NOW - 100, "firstProgressTime": NOW - 90,
              "suspension": {"since": NOW - 10}, "lastCheckpoint": {"tag": "step_20", "step": 20, "uri": "s3://c/r"},
              "queue": {"workload": "trainingrun-r", "state": "Preempted", "since": NOW - 10, "evictions": 1}}
    r = reconcile_objects(run(status), [], {}, now=NOW, workload=wl(*ADMITTED, admitted_to="cq"), flavors=FLAVORS)
    assert (r.after.phase, r.after.attempt) == ("Starting", 2)
    assert r.after.current.resume_checkpoint.step == 20 and r.after.suspension.seconds == 10.0
    assert not r.after.failures


# -- the end, and spec.suspend ---------------------------------------------------------------

def test_a_finished_run_marks_its_workload_finished_once():
    status = {"phase": "Succeeded", "attempt": 1, "message": "all 4 pods finished at step 100",
              "queue": {"workload": "trainingrun-r", "state": "Admitted"}}
    r = reconcile_objects(run(status), [], {}, now=NOW, workload=wl(*ADMITTED, admitted_to="cq"))
    (done,) = patches(r)
    assert (conditions_in(done)["Finished"]["status"], conditions_in(done)["Finished"]["reason"]) == ("True", "Succeeded")
    assert not r.ensured("Workload")
    r = reconcile_objects(run(status), [], {}, now=NOW,
                          workload=wl(*ADMITTED, cond("Finished", "True", "Succeeded"), admitted_to="cq"))
    assert not patches(r) and r.after.queue.state == "Finished"


def test_suspend_deactivates_the_workload_and_resume_activates_it_again():
    status = {"phase": "Running", "attempt": 1, "createdTime": NOW - 100,
              "queue": {"workload": "trainingrun-r", "state": "Admitted"}}
    r = reconcile_objects(run(status, suspend=True), running(), {}, now=NOW, workload=wl(*ADMITTED, admitted_to="cq"))
    assert r.after.phase == "Suspended" and r.after.queue.deactivated
    assert active_patches(r) == [{"spec": {"active": False}}]
    inactive = wl(cond("Evicted", "True", "Deactivated", "The workload is deactivated"), active=False)
    back = {**status, "phase": "Suspended", "queue": {**status["queue"], "deactivated": True}}
    r = reconcile_objects(run(back), [], {}, now=NOW, workload=inactive)
    assert active_patches(r) == [{"spec": {"active": True}}]
    assert r.after.phase == "Queued" and not [e for e in r.effects if e.kind == "event" and e.reason == "Evicted"]


def test_a_run_created_suspended_activates_its_workload_when_resumed():
    first = reconcile_objects(run(suspend=True), [], {}, now=NOW, workload=None)
    assert first.after.phase == "Suspended"
    assert first.ensured("Workload")[0]["spec"]["active"] is True  # made active, deactivated next
    r = reconcile_objects(run({**first.status, "phase": "Suspended"}, suspend=True), [], {}, now=NOW + 1,
                          workload=wl())
    assert active_patches(r) == [{"spec": {"active": False}}]
    resumed = reconcile_objects(run({**first.status, **r.status, "phase": "Suspended"}), [], {}, now=NOW + 2,
                                workload=wl(cond("Evicted", "True", "Deactivated"), active=False))
    assert active_patches(resumed) == [{"spec": {"active": True}}]


def test_admitted_to_a_flavor_not_seen_yet_the_run_waits_for_it():
    r = reconcile_objects(run({"phase": "Queued"}), [], {}, now=NOW, workload=wl(*ADMITTED, admitted_to="cq",
                                                                                 flavor="unseen"), flavors=FLAVORS)
    assert r.after.phase == "Queued" and not pods_of(r)
    assert (r.after.queue.state, r.after.queue.reason) == ("Queued", "FlavorNotSeen")


def test_a_queue_label_added_to_a_training_run_waits_for_its_next_suspension():
    status = {"phase": "Running", "attempt": 1, "createdTime": NOW - 100, "current": {"startTime": NOW - 90}}
    r = reconcile_objects(run(status), running(), {f"n{i}": _node(f"n{i}") for i in range(4)}, now=NOW)
    assert r.after.phase == "Running" and not r.ensured("Workload") and not [
        e for e in r.effects if isinstance(e, DeletePod)]


def test_a_queue_label_removed_from_a_live_run_does_not_take_it_out_of_kueue():
    status = {"phase": "Queued", "queue": {"workload": "trainingrun-r", "state": "Queued", "reason": "Pending"}}
    r = reconcile_objects(run(status, labels={}), [], {}, now=NOW,
                          workload=wl(cond("QuotaReserved", "False", "Pending", "no quota")))
    assert r.after.phase == "Queued" and not pods_of(r)


def test_a_workload_kueue_deactivated_itself_stays_so():
    status = {"phase": "Queued", "attempt": 1, "queue": {"workload": "trainingrun-r", "state": "Queued"}}
    r = reconcile_objects(run(status), [], {}, now=NOW,
                          workload=wl(cond("Evicted", "True", "DeactivatedDueToRequeuingLimitExceeded"), active=False))
    assert not active_patches(r) and r.after.phase == "Queued"
    # said: the state users most need to hear about
    assert [e.reason for e in r.effects if e.kind == "event"] == ["Evicted"]


def test_events_are_sent_when_the_state_changes_not_every_pass():
    w = wl(cond("QuotaReserved", "False", "Pending", "no quota"))
    first = reconcile_objects(run(), [], {}, now=NOW, workload=w)
    assert [e.reason for e in first.effects if e.kind == "event"] == ["Queued"]
    again = reconcile_objects({**run(), "status": {**run()["status"], **first.status}}, [], {}, now=NOW + 1, workload=w)
    assert not [e for e in again.effects if e.kind == "event"] and "queue" not in again.status


STATES = [
    (None, "Queued"), (wl(*ADMITTED, admitted_to="cq"), "Admitted"),
    (wl(*PREEMPTED, admitted_to="cq"), "Preempted"),
    (wl(*ADMITTED, cond("Evicted", "True", "PodsReadyTimeout"), admitted_to="cq"), "Evicted"),
    (wl(*ADMITTED, cond("Finished", "True", "Succeeded"), admitted_to="cq"), "Finished"),
    (wl(cond("Admitted", "True", "Admitted")), "Queued"),  # no admission: not admitted whatever the condition says
]


@pytest.mark.parametrize("w,state", STATES)
def test_state_of(w, state):
    assert state_of(w)[0] == state


# -- pods an admission policy refuses --------------------------------------------------------

REFUSALS = [
    ('cannot create Pod r-a1-0: pods "r-a1-0" is forbidden: ValidatingAdmissionPolicy \'q\' with binding \'q\' '
     'denied request: pods need a kueue.x-k8s.io/queue-name label', True),
    ('cannot create Pod r-a1-0: admission webhook "v.example.com" denied the request: no', True),
    ('cannot create Pod r-a1-0: pods "r-a1-0" is forbidden: violates PodSecurity "restricted:latest": privileged',
     True),
    ('cannot create Pod r-a1-0: pods "r-a1-0" is forbidden: exceeded quota: q, requested: pods=1', False),
    ('cannot create Pod r-a1-0: Internal error occurred: failed calling webhook "v.example.com": connection refused',
     False),
    ('cannot create Service r: admission webhook "v.example.com" denied the request: no', False),
    ('cannot create PodDisruptionBudget r: admission webhook "v.example.com" denied the request: no', False),
    ('cannot create Pod r-spare-1: admission webhook "v.example.com" denied the request: no', False),
]


@pytest.mark.parametrize("error,fatal", REFUSALS)
def test_pods_an_admission_policy_refuses_fail_the_run_at_once(error, fatal):
    spec = parse(SPEC)

    def seen(refused_since: float) -> Observed:
        return Observed(spec, gang_state([]), {}, NOW, gang_complete=False, children_error=error,
                        children_error_since=refused_since)
    clocks = Clocks(attempt_start_time=NOW - 60)  # the attempt older than the refusal: the refusal's own clock counts
    assert _unborn(seen(NOW - 1), clocks) is None  # a passing denial gets its chance
    failure = _unborn(seen(NOW - 25), clocks)
    assert (failure is not None and failure.fatal) == fatal
    if fatal:
        assert error.split(": ", 1)[1] in failure.message
