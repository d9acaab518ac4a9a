"""Paced disruptions (issue 43): a drain's cordon, an eviction through the API and the scheduler's
preemption are voluntary: the gang moves once, at a save, and no restart budget is spent; the
run's PodDisruptionBudget holds a drain's eviction meanwhile (tables over whole passes)."""

from __future__ import annotations

import pytest

from tests.unit.test_operator_core import RUN, SPEC
from trainium_api.progress import ProgressReport
from trainium_operator import plan
from trainium_operator.observe import NodeView, PodView, draining
from trainium_operator.reconcile import reconcile_objects
from trainium_operator.spec import parse

NOW = 1000.0
RUNNING = {"phase": "Running", "attempt": 1, "createdTime": NOW - 100, "firstProgressTime": NOW - 90, "step": 5,
           "lastProgressTime": NOW - 1, "current": {"startTime": NOW - 95, "gangRunningTime": NOW - 92},
           "conditions": [{"type": "Valid", "status": "True"}]}


def node(name: str, unschedulable: bool = False, taints: tuple[str, ...] = ()) -> NodeView:
    return NodeView(name, "True", set(taints), neuron_allocatable=16, neuron_capacity=16, unschedulable=unschedulable)


def gang(**first) -> list[PodView]:
    return [PodView(f"r-a1-{i}", 1, i, first.get("phase", "Running") if i == 0 else "Running", f"n{i}",
                    bool(first.get("deleting")) if i == 0 else False, progress=ProgressReport(step=5, time=NOW - 1),
                    **({k: v for k, v in first.items() if k not in ("phase", "deleting")} if i == 0 else {}))
            for i in range(4)]


MOVES = [
    # name, node n0 as seen, pod 0 as seen -> a voluntary move?
    ("cordoned by kubectl drain", node("n0", unschedulable=True), {}, True),
    ("tainted by Karpenter before its drain", node("n0", taints=("karpenter.sh/disrupted",)), {}, True),
    ("evicted through the API (no budget held it)", node("n0"),
     {"phase": "Failed", "exit_code": 143, "reason": "EvictionByEvictionAPI"}, True),
    ("preempted by the scheduler", node("n0"), {"phase": "Failed", "exit_code": 143, "reason": "PreemptionByScheduler"},
     True),
    ("evicted through the API, seen before it ends (its DisruptionTarget)", node("n0"),
     {"deleting": True, "reason": "EvictionByEvictionAPI"}, True),
    ("preempted by the scheduler, seen before it ends", node("n0"),
     {"deleting": True, "reason": "PreemptionByScheduler"}, True),
    ("deleted by someone: counted", node("n0"), {"deleting": True}, False),
    ("evicted by the kubelet for node pressure: counted", node("n0"),
     {"phase": "Failed", "exit_code": 137, "reason": "Evicted"}, False),
    ("the operator's own quarantine taint is no drain", node("n0", taints=("trainium.dev/quarantined",)), {}, None),
]


@pytest.mark.parametrize("name,n0,first,voluntary", MOVES, ids=[m[0] for m in MOVES])
def test_a_voluntary_disruption_moves_the_gang_without_spending_budget(name, n0, first, voluntary):
    nodes = {"n0": n0, **{f"n{i}": node(f"n{i}") for i in range(1, 4)}}
    r = reconcile_objects({**RUN, "status": RUNNING}, gang(**first), nodes, now=NOW)
    if voluntary is None:
        assert not r.after.failures
        return
    (record,) = r.after.failures
    assert r.after.phase == "Restarting" and record.cause == "eviction"
    assert (record.exempt == "voluntary") == voluntary
    counted = sum(len(v) for v in (r.after.failure_counters.recent if r.after.failure_counters else {}).values())
    assert counted == (0 if voluntary else 1)
    assert not r.after.quarantined_nodes  # a drained node is not blamed
    if voluntary:
        assert r.after.current.restart_not_before == NOW  # no backoff


def test_a_node_merely_cordoned_leaves_a_run_without_a_budget_where_it_is():
    nodes = {"n0": node("n0", unschedulable=True), **{f"n{i}": node(f"n{i}") for i in range(1, 4)}}
    r = reconcile_objects({**RUN, "spec": {**SPEC, "faultTolerance": {"doNotDisrupt": False}}, "status": RUNNING},
                          gang(), nodes, now=NOW)
    assert not r.after.failures and r.after.phase == "Running"


@pytest.mark.parametrize("taint", ["karpenter.sh/disrupted", "aws-node-termination-handler/spot-itn",
                                   "aws-node-termination-handler/scheduled-maintenance"])
def test_a_termination_notice_moves_even_a_run_without_a_budget_at_once(taint):
    """The node goes whatever budget holds its drain (a Spot interruption: two minutes): the gang
    moves now, at a save, spending no budget."""
    nodes = {"n0": node("n0", taints=(taint,)), **{f"n{i}": node(f"n{i}") for i in range(1, 4)}}
    r = reconcile_objects({**RUN, "spec": {**SPEC, "faultTolerance": {"doNotDisrupt": False}}, "status": RUNNING},
                          gang(), nodes, now=NOW)
    (record,) = r.after.failures
    assert record.cause == "eviction" and record.exempt == "voluntary" and record.node == "n0"
    assert f"is to be terminated ({taint} taint)" in record.message
    assert r.after.current.restart_not_before == NOW and not r.after.quarantined_nodes


def test_a_rebalance_recommendation_is_only_a_hint():
    nodes = {"n0": node("n0", taints=("aws-node-termination-handler/rebalance-recommendation",)),
             **{f"n{i}": node(f"n{i}") for i in range(1, 4)}}
    r = reconcile_objects({**RUN, "status": RUNNING}, gang(), nodes, now=NOW)
    assert not r.after.failures


def test_draining():
    assert draining(node("a", unschedulable=True)) and draining(node("a", taints=("karpenter.sh/disrupted",)))
    assert not draining(node("a")) and not draining(node("a", taints=("aws.amazon.com/neuron",)))


def test_the_disruption_budget_holds_the_whole_gang_and_not_the_spares():
    pdb = plan.disruption_budget(RUN, parse(SPEC))
    assert pdb["spec"]["minAvailable"] == 4 and pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["spec"]["selector"]["matchExpressions"] == [{"key": "trainium.dev/spare", "operator": "NotIn",
                                                            "values": ["true"]}]
    off = reconcile_objects({**RUN, "spec": {**SPEC, "faultTolerance": {"doNotDisrupt": False}}, "status": RUNNING},
                            gang(), {f"n{i}": node(f"n{i}") for i in range(4)}, now=NOW)
    assert not off.ensured("PodDisruptionBudget")


@pytest.mark.parametrize("reason,voluntary", [("EvictionByEvictionAPI", True), ("PreemptionByScheduler", True),
                                              ("", False)])
def test_a_pod_gone_before_a_pass_saw_it_keeps_its_evictions_reason(reason, voluntary):
    """An evicted pod on a fast kubelet is deleted within milliseconds: the pass that first sees
    the gang short of it reads its last view the watcher kept (departures.py), and a drain's
    eviction stays voluntary. Without a view, or one without such a reason, it is counted."""
    nodes = {f"n{i}": node(f"n{i}") for i in range(4)}
    pods = gang()
    gone = PodView("r-a1-0", 1, 0, "Running", "n0", True, reason=reason)
    r = reconcile_objects({**RUN, "status": RUNNING}, pods[1:], nodes, now=NOW, departed=[gone])
    (record,) = r.after.failures
    assert record.cause == "eviction" and record.pod == "r-a1-0" and record.node == "n0"
    assert (record.exempt == "voluntary") == voluntary, record


def test_one_evicted_pod_does_not_exempt_another_missing_without_a_reason():
    nodes = {f"n{i}": node(f"n{i}") for i in range(4)}
    gone = PodView("r-a1-0", 1, 0, "Running", "n0", True, reason="EvictionByEvictionAPI")
    r = reconcile_objects({**RUN, "status": RUNNING}, gang()[2:], nodes, now=NOW, departed=[gone])
    (record,) = r.after.failures
    assert record.exempt is None and record.cause == "eviction", record


def test_the_watcher_keeps_departures_only_of_its_runs_and_drops_a_reused_names():
    """pod_changed notes a pod on its way out only for a run whose loop runs (else nothing would
    ever prune it), and a live pod of the same name makes the earlier one's view stale."""
    import asyncio

    from trainium_operator.watcher import Watcher

    def body(name: str, deleting: bool, uid: str = "p-1") -> dict:
        meta = {"name": name, "namespace": "ns", "uid": uid,
                "labels": {"trainium.dev/run": "r", "trainium.dev/attempt": "1", "trainium.dev/index": "0"}}
        if deleting:
            meta["deletionTimestamp"] = "2026-01-01T00:10:00Z"
        return {"metadata": meta, "spec": {"nodeName": "n0"}, "status": {"phase": "Running", "conditions": [
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}] if deleting else []}}

    w = Watcher.__new__(Watcher)  # (the services it starts are not needed to watch pods)
    from trainium_operator.departures import Departures
    w.departures, w.wake, w.pod_shapes = Departures(), {}, {}
    w.pod_changed(True, "ns", "r-a1-0", "r", body("r-a1-0", True))
    assert w.departures.of("ns", "r") == []  # no loop for run r: not kept
    w.wake[("ns", "r")] = asyncio.Event()
    w.pod_changed(False, "ns", "r-a1-0", "r", body("r-a1-0", True))
    assert [v.reason for v in w.departures.of("ns", "r")] == ["EvictionByEvictionAPI"]
    w.pod_changed(False, "ns", "r-a1-0", "r", body("r-a1-0", False, uid="p-2"))  # its name reused
    assert w.departures.of("ns", "r") == []


def test_a_departed_pod_of_another_attempt_is_no_evidence():
    """Only the gang's own pods count: a pod of an earlier attempt evicted lately does not make a
    pod missing now voluntary."""
    nodes = {f"n{i}": node(f"n{i}") for i in range(4)}
    old = PodView("r-a0-0", 0, 0, "Running", "n0", True, reason="EvictionByEvictionAPI")
    r = reconcile_objects({**RUN, "status": RUNNING}, gang()[1:], nodes, now=NOW, departed=[old])
    (record,) = r.after.failures
    assert record.exempt is None and "1 pod(s) deleted" in record.message


def test_departures_keep_a_pods_last_view_for_a_while():
    from trainium_operator.departures import Departures
    d = Departures(keep=10.0)
    d.note("ns", "r", PodView("r-a1-0", 1, 0, "Running", "n0", True, reason="EvictionByEvictionAPI"), now=0.0)
    d.note("ns", "r", PodView("r-a1-0", 1, 0, "Failed", "n0", True, reason="EvictionByEvictionAPI"), now=1.0)
    assert [v.phase for v in d.of("ns", "r", now=5.0)] == ["Failed"]  # the newest view
    assert d.of("ns", "other", now=5.0) == []
    assert d.of("ns", "r", now=12.0) == []  # kept for ``keep`` seconds
    d.note("ns", "r", PodView("r-a1-1", 1, 1, "Running", "n1", True), now=20.0)
    assert [v.name for v in d.of("ns", "r", now=20.0)] == ["r-a1-1"]  # the old one pruned
    d.forget("ns", "r")
    assert d.of("ns", "r", now=20.0) == []
