"""In-place gang restarts, the operator's side (pure): a failure that leaves the nodes trusted is
restarted in the gang's own pods through their agents' reports and the operator's orders
(trainium_api.agent), with a barrier between the attempts; anything else, or an agent that
does not answer, recreates the gang."""

from __future__ import annotations

import json

from trainium_api import keys
from trainium_api import agent
from trainium_operator import inplace
from trainium_operator.observe import node_view, pod_view
from trainium_operator.reconcile import reconcile_objects

from tests.unit.passes import SPEC

NODES = {f"n{i}": node_view({"metadata": {"name": f"n{i}"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
         for i in range(2)}


def run_with(status: dict, spec: dict | None = None) -> dict:
    return {"metadata": {"name": "r", "namespace": "ns", "uid": "u-1", "generation": 1,
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": spec or SPEC, "status": status}


def pod(i: int, gang: int = 1, report: dict | None = None, order: dict | None = None, progress: dict | None = None,
        phase: str = "Running", deleting: bool = False, node: str | None = None, env: list | None = None):
    ann = {}
    if report is not None:
        ann[keys.AGENT_REPORT] = json.dumps(report)
    if order is not None:
        ann[keys.ORDER] = json.dumps(order)
    if progress is not None:
        ann["trainium.dev/progress"] = json.dumps(progress)
    meta = {"name": f"r-a{gang}-{i}", "labels": {"trainium.dev/attempt": str(gang), "trainium.dev/index": str(i)},
            "annotations": ann, "creationTimestamp": "2026-01-01T00:00:01Z"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:10:00Z"
    return pod_view({"metadata": meta, "spec": {"nodeName": f"n{i}" if node is None else node},
                     "status": {"phase": phase}})


def running(attempt: int, step: int | None = None, **kw) -> dict:
    return {"attempt": attempt, "state": "running", **kw}


def step_report(step: int, attempt: int | None, t: float = 50.0) -> dict:
    return {"step": step, "time": t, "lastCheckpointStep": 10, "startStep": 0, "attempt": attempt}


def started_run() -> dict:
    """Attempt 1, its gang running and training (both agents say so)."""
    r = reconcile_objects(run_with({}), [], NODES, now=0.0)
    status = {**r.status, "conditions": [{"type": "Valid", "status": "True"}]}
    pods = [pod(i, report=running(1), progress=step_report(12, 1)) for i in range(2)]
    r = reconcile_objects(run_with(status), pods, NODES, now=5.0)
    status.update(r.status)
    assert status["phase"] == "Running" and status["attempt"] == 1
    return status


def test_a_crashed_rank_restarts_the_gang_in_its_own_pods_behind_a_barrier():
    status = started_run()
    crashed = {"attempt": 1, "state": "exited", "exitCode": 1, "message": "", "time": 55.0}
    r = reconcile_objects(run_with(status), [pod(0, report=crashed), pod(1, report=running(1))], NODES, now=60.0)
    status.update(r.status)
    assert status["phase"] == "Restarting" and status["restarts"] == {"application": 1}
    assert status["failures"][-1]["restart"] == "inPlace" and status["restartsInPlace"] == 1
    assert not [e for e in r.effects if e.kind == "delete_pod"]
    orders = {e.name: e.order for e in r.effects if e.kind == "order_pod"}
    assert orders == {f"r-a1-{i}": agent.Order(2, start=False, grace_seconds=30.0) for i in range(2)}
    stop = {"attempt": 2, "start": False, "graceSeconds": 30.0}

    # one agent said ready, the other has not seen the order yet: it is written again, to it only
    pods = [pod(0, report={"attempt": 2, "state": "ready"}, order=stop), pod(1, report=running(1))]
    r = reconcile_objects(run_with(status), pods, NODES, now=61.0)
    assert "attempt" not in r.status and "phase" not in r.status
    assert [e.name for e in r.effects if e.kind == "order_pod"] == ["r-a1-1"]
    assert not r.ensured("Pod") and not [e for e in r.effects if e.kind == "delete_pod"]

    # the barrier: every agent ready -> attempt 2 recorded, in attempt 1's pods, then told to start
    pods = [pod(i, report={"attempt": 2, "state": "ready"}, order=stop, progress=step_report(14, 1))
            for i in range(2)]
    r = reconcile_objects(run_with(status), pods, NODES, now=62.0)
    status.update(r.status)
    assert status["attempt"] == 2 and status["phase"] == "Starting"
    assert status["current"]["gangAttempt"] == 1 and status["current"]["inPlaceStreak"] == 1
    assert status["failures"][-1]["teardownDoneTime"] == 62.0
    # every pod is told its node rank and the rendezvous address
    assert {e.name: e.order for e in r.effects if e.kind == "order_pod"} == {
        f"r-a1-{i}": agent.Order(2, start=True, grace_seconds=30.0, index=i, master="r-0.r.ns.svc") for i in range(2)}
    role = r.ensured("Role")[0]
    assert role["rules"][0]["resourceNames"] == ["r-a1-0", "r-a1-1"] and role["metadata"]["labels"][
        "trainium.dev/attempt"] == "2"
    assert not r.ensured("Pod") and not [e for e in r.effects if e.kind == "delete_pod"]

    # attempt 1's pods are the gang now, not stale; its old progress is not attempt 2's step
    go = {"attempt": 2, "start": True, "graceSeconds": 30.0}
    pods = [pod(i, report=running(2), order=go, progress=step_report(14, 1)) for i in range(2)]
    r = reconcile_objects(run_with(status), pods, NODES, now=64.0)
    status.update(r.status)
    assert not [e for e in r.effects if e.kind in ("delete_pod", "order_pod")]
    assert status["current"]["gangRunningTime"] == 64.0 and status["failures"][-1]["recoveredAfter"] == 4.0
    assert status["phase"] == "Starting"  # no step of attempt 2 yet
    pods = [pod(i, report=running(2), order=go, progress=step_report(11, 2, t=66.0)) for i in range(2)]
    r = reconcile_objects(run_with(status), pods, NODES, now=66.5)
    status.update(r.status)
    assert status["phase"] == "Running" and status["failures"][-1]["resumedTime"] == 66.0


def test_an_agent_that_does_not_answer_and_a_pod_that_goes_recreate_the_gang():
    status = started_run()
    hung = {"attempt": 1, "state": "exited", "exitCode": 1, "message": "", "time": 55.0}
    r = reconcile_objects(run_with(status), [pod(0, report=hung), pod(1, report=running(1))], NODES, now=60.0)
    status.update(r.status)
    stop = {"attempt": 2, "start": False, "graceSeconds": 30.0}
    base = dict(status)
    # the grace (30 s) and the slack (15 s) pass without pod 1's agent saying ready
    pods = [pod(0, report={"attempt": 2, "state": "ready"}, order=stop), pod(1, report=running(1), order=stop)]
    r = reconcile_objects(run_with(status), pods, NODES, now=106.0)
    status.update(r.status)
    assert status["current"]["restart"] == "recreate" and status["failures"][-1]["restart"] == "recreate"
    assert status["restartsInPlace"] == 0 and "InPlaceRestartGivenUp" in [e.reason for e in r.effects if e.kind == "event"]
    assert {e.name for e in r.effects if e.kind == "delete_pod"} == {"r-a1-0", "r-a1-1"}
    # from here the normal teardown: the new gang once the old pods are gone, new pods
    r = reconcile_objects(run_with(status), [], NODES, now=107.0)
    assert r.status["attempt"] == 2 and len(r.ensured("Pod")) == 2 and r.status["current"].get("gangAttempt") is None
    # a pod of the gang deleted meanwhile: given up at once
    pods = [pod(0, report={"attempt": 2, "state": "ready"}, order=stop), pod(1, report=running(1), deleting=True)]
    r = reconcile_objects(run_with(dict(base)), pods, NODES, now=61.0)
    assert r.status["current"]["restart"] == "recreate"


def test_a_long_backoff_a_stale_status_and_a_late_give_up_keep_the_restart_right():
    status = started_run()
    crashed = {"attempt": 1, "state": "exited", "exitCode": 1, "message": "", "time": 55.0}
    spec = {**SPEC, "faultTolerance": {"backoffSeconds": 60}}
    r = reconcile_objects(run_with(status, spec), [pod(0, report=crashed), pod(1, report=running(1))], NODES, now=60.0)
    status.update(r.status)
    stop = {"attempt": 2, "start": False, "graceSeconds": 30.0}
    ready = [pod(i, report={"attempt": 2, "state": "ready"}, order=stop) for i in range(2)]
    r = reconcile_objects(run_with(status, spec), ready, NODES, now=62.0)
    status.update(r.status)
    # every agent ready, the backoff (60 s) longer than grace + slack: waited for, not given up
    r = reconcile_objects(run_with(status, spec), ready, NODES, now=106.0)
    assert "InPlaceRestartGivenUp" not in [e.reason for e in r.effects if e.kind == "event"]
    assert not [e for e in r.effects if e.kind == "delete_pod"]
    r = reconcile_objects(run_with(status, spec), ready, NODES, now=121.0)
    assert r.status["attempt"] == 2 and r.status["current"]["gangAttempt"] == 1
    # a pass that read the status from before the start (the agents already run attempt 2)
    go = {"attempt": 2, "start": True, "graceSeconds": 30.0}
    r = reconcile_objects(run_with(status, spec), [pod(i, report=running(2), order=go) for i in range(2)], NODES,
                          now=122.0)
    assert r.status == {} and r.effects == []
    # given up after the barrier had passed: the record's teardown is the deletion's again
    late = {**status, "failures": [{**status["failures"][-1], "teardownDoneTime": 62.0}]}
    gone = [ready[0], pod(1, report={"attempt": 2, "state": "ready"}, order=stop, deleting=True)]
    r = reconcile_objects(run_with(late, spec), gone, NODES, now=70.0)
    assert r.status["failures"][-1].get("teardownDoneTime") is None and r.status["failures"][-1]["restart"] == "recreate"


def test_only_failures_that_leave_the_nodes_trusted_and_answering_agents_restart_in_place():
    status = started_run()
    crashed = {"attempt": 1, "state": "exited", "exitCode": 1, "message": "", "time": 55.0}
    # a pod without an agent (an older image, or a launcher that could not reach the API server)
    r = reconcile_objects(run_with(status), [pod(0, report=crashed), pod(1)], NODES, now=60.0)
    assert r.status["failures"][-1]["restart"] == "recreate" and r.status["current"]["restart"] == "recreate"
    assert "not every pod's agent answers" in next(e.message for e in r.effects if e.kind == "event"
                                                   and e.reason == "Restarting")
    assert {e.name for e in r.effects if e.kind == "delete_pod"} == {"r-a1-0", "r-a1-1"}
    # a pod whose container ended (the agent ended it: a fault of this node) is not in place
    r = reconcile_objects(run_with(status), [pod(0, phase="Failed", report=running(1)), pod(1, report=running(1))],
                          NODES, now=60.0)
    assert r.status["failures"][-1]["restart"] == "recreate"
    # turned off
    off = {**SPEC, "faultTolerance": {"inPlaceRestarts": 0}}
    r = reconcile_objects(run_with(status, off), [pod(0, report=crashed), pod(1, report=running(1))], NODES, now=60.0)
    assert r.status["failures"][-1]["restart"] == "recreate"
    # the streak: the limit's in-place restarts without the checkpoint advancing, then recreate
    streak = {**status, "current": {**status["current"], "inPlaceStreak": 2,
                                    "resumeCheckpoint": {"tag": "step_10", "step": 10}},
              "lastCheckpoint": {"tag": "step_10", "step": 10}}
    r = reconcile_objects(run_with(streak), [pod(0, report=crashed), pod(1, report=running(1))], NODES, now=60.0)
    assert r.status["failures"][-1]["restart"] == "recreate"
    assert "did not advance the checkpoint" in next(e.message for e in r.effects if e.kind == "event"
                                                    and e.reason == "Restarting")


def test_a_report_the_runs_code_forges_neither_stalls_the_run_nor_sets_its_clocks():
    status = started_run()
    # an attempt far ahead in the pod's own report: not the operator's order, so passes go on
    forged = {"attempt": 2147483647, "state": "running"}
    r = reconcile_objects(run_with(status), [pod(0, report=forged), pod(1, report=running(1))], NODES, now=60.0)
    assert r.effects, "the pass decided nothing"
    # a failure time far in the future or past is kept between the attempt's start and now
    for when in (1e11, 0.0):
        crashed = {"attempt": 1, "state": "exited", "exitCode": 1, "message": "", "time": when}
        r = reconcile_objects(run_with(status), [pod(0, report=crashed), pod(1, report=running(1))], NODES, now=60.0)
        after = r.status["failures"][-1].get("detectedAfter")  # (none at the attempt's start: 0.0 here)
        assert after is None or 0.0 <= after <= 60.0, r.status["failures"][-1]


def test_the_agent_protocol_parses_strictly():
    assert agent.parse_report(agent.report_payload(agent.Report(3, "exited", 1, "boom\x00", 5.0))) == \
        agent.Report(3, "exited", 1, "boom ", 5.0)
    for bad in (None, "", "[]", "{", "x" * 5000, '{"attempt": 0, "state": "running"}',
                '{"attempt": 1, "state": "dancing"}', '{"attempt": true, "state": "running"}',
                '{"attempt": 1, "state": "exited"}', '{"attempt": 1, "state": "exited", "exitCode": 1e9}',
                '{"attempt": 1.5, "state": "ready"}'):
        assert agent.parse_report(bad) is None, bad
    assert agent.parse_report('{"attempt": 1, "state": "ready", "time": "soon", "message": 7}') == \
        agent.Report(1, "ready", None, "", None)
    assert agent.parse_order(agent.order_payload(agent.Order(4, True, 10.0))) == agent.Order(4, True, 10.0)
    for bad in (None, "{}", '{"attempt": -1}', '{"attempt": 2, "start": "yes"}'):
        assert agent.parse_order(bad) is None, bad
    assert agent.parse_order('{"attempt": 2, "graceSeconds": 1e300}').grace_seconds == 3600.0
    assert agent.parse_report('{"attempt": 1, "state": "exited", "exitCode": 0}') is None  # finished workers end the pod


def node(name: str, ready: str = "True"):
    return node_view({"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": ready}]}})


def events(r, reason: str) -> list[str]:
    return [e.message for e in r.effects if e.kind == "event" and e.reason == reason]


def test_a_lost_node_replaces_its_pod_alone_while_the_others_restart_in_place():
    """Node n1 goes NotReady: its pod is deleted (forced after the grace: the node may still run
    it) and the node quarantined; pod 0's agent is told to stop its workers. Once that pod is gone,
    its replacement is created under attempt 2's name, off the quarantined node, and waits at the
    barrier (its agent starts no workers). Once both agents said ready, attempt 2 starts in them
    both: one pod created in all, none of the others deleted."""
    status = started_run()
    nodes = {"n0": node("n0"), "n1": node("n1", "False"), "n2": node("n2")}
    r = reconcile_objects(run_with(status), [pod(i, report=running(1)) for i in range(2)], nodes, now=60.0)
    status.update(r.status)
    assert status["phase"] == "Restarting" and status["restarts"] == {"node": 1}
    assert status["failures"][-1]["restart"] == "replace" and status["restartsReplaced"] == 1
    assert status["current"]["replacing"] == 1 and status["current"]["replacement"] == "r-a2-1"
    assert status["quarantinedNodes"] == ["n1"]
    # the machine behind it, should its Node object register again (status.quarantinedMachines)
    assert [(m["node"], m["since"]) for m in status["quarantinedMachines"]] == [("n1", 60.0)]
    # a NotReady node may still run it (a partition): graceful, forced after the grace; at once
    # only on a node known dead (deleted, or tainted out-of-service)
    assert {e.name: e.grace for e in r.effects if e.kind == "delete_pod"} == {"r-a1-1": 30}
    gone = reconcile_objects(run_with(started_run()), [pod(i, report=running(1)) for i in range(2)],
                             {"n0": node("n0"), "n2": node("n2")}, now=60.0)
    assert {e.name: e.grace for e in gone.effects if e.kind == "delete_pod"} == {"r-a1-1": 0}
    # a deleted node is not quarantined: nothing to taint, and a node registering later under
    # its name is another machine (a quarantine left pending would land on it)
    assert not [e for e in gone.effects if e.kind == "quarantine"] and not gone.status.get("quarantinedNodes")
    assert "not quarantined: its Node object is gone" in events(gone, "NodeGone")[0]
    assert {e.name: e.order for e in r.effects if e.kind == "order_pod"} == {
        "r-a1-0": agent.Order(2, start=False, grace_seconds=30.0)}
    assert events(r, "Restarting") and "replacing pod r-a1-1" in events(r, "Restarting")[0]
    stop = {"attempt": 2, "start": False, "graceSeconds": 30.0}

    # pod 1 still there (its delete not done): nothing created yet
    kept = pod(0, report={"attempt": 2, "state": "ready"}, order=stop)
    r = reconcile_objects(run_with(status), [kept, pod(1, report=running(1), deleting=True)], nodes, now=61.0)
    assert not r.ensured("Pod") and "attempt" not in r.status
    # gone: the replacement, attempt 2's name, told to wait for the order, kept off n1
    r = reconcile_objects(run_with(status), [kept], nodes, now=62.0)
    status.update(r.status)
    (new,) = r.ensured("Pod")
    assert new["metadata"]["name"] == "r-a2-1" and new["metadata"]["labels"]["trainium.dev/attempt"] == "2"
    env = {e["name"]: e.get("value") for e in new["spec"]["containers"][0]["env"]}
    assert env[agent.AWAIT_START_ENV] == "1" and env["ATTEMPT"] == "2" and env["NODE_RANK"] == "1"
    excluded = new["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert excluded["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["n1"]
    # the trainer identity may reach the replacement before it starts (its agent watches its pod)
    assert r.ensured("Role")[0]["rules"][0]["resourceNames"] == ["r-a1-0", "r-a1-1", "r-a2-1"]
    assert status["phase"] == "Restarting" and status["failures"][-1]["teardownDoneTime"] == 62.0

    # the replacement is not placed yet: not a newer attempt's pod, nothing stale, nothing decided
    waiting = pod(1, gang=2, phase="Pending", node="")
    r = reconcile_objects(run_with(status), [kept, waiting], nodes, now=63.0)
    assert not [e for e in r.effects if e.kind in ("delete_pod", "order_pod")] and "attempt" not in r.status
    assert not r.ensured("Pod")
    # placed and its agent ready: the barrier passes, attempt 2 starts in both
    placed = pod(1, gang=2, report={"attempt": 2, "state": "ready"}, node="n2")
    r = reconcile_objects(run_with(status), [kept, placed], nodes, now=64.0)
    status.update(r.status)
    assert status["attempt"] == 2 and status["phase"] == "Starting"
    assert status["current"]["gangAttempt"] == 1 and status["current"]["podNames"] == ["r-a1-0", "r-a2-1"]
    assert status["current"].get("replacing") is None
    assert status["failures"][-1]["teardownDoneTime"] == 62.0  # placing the replacement: its schedule phase
    assert {e.name: e.order for e in r.effects if e.kind == "order_pod"} == {
        n: agent.Order(2, start=True, grace_seconds=30.0, index=i, master="r-0.r.ns.svc")
        for i, n in enumerate(("r-a1-0", "r-a2-1"))}
    assert r.ensured("Role")[0]["rules"][0]["resourceNames"] == ["r-a1-0", "r-a2-1"]
    assert "pod r-a2-1 on node n2 replaced the failed one" in events(r, "Restarted")[0]

    # a pass that read the status from before the start decides nothing
    go = {"attempt": 2, "start": True, "graceSeconds": 30.0}
    both = [pod(0, report=running(2), order=go), pod(1, gang=2, report=running(2), order=go, node="n2")]
    stale = {**status, "attempt": 1, "phase": "Restarting", "current": {"restart": "replace", "replacing": 1}}
    r = reconcile_objects(run_with(stale), both, nodes, now=65.0)
    assert r.status == {} and r.effects == []
    # the mixed gang runs attempt 2: nothing stale, the recovery recorded
    r = reconcile_objects(run_with(status), both, nodes, now=66.0)
    status.update(r.status)
    assert not [e for e in r.effects if e.kind in ("delete_pod", "order_pod")] and not r.ensured("Pod")
    assert status["current"]["gangRunningTime"] == 66.0 and status["failures"][-1]["recoveredAfter"] == 6.0

    # and a crash after it restarts that mixed gang in place
    crashed = {"attempt": 2, "state": "exited", "exitCode": 1, "message": "", "time": 70.0}
    both[1] = pod(1, gang=2, report=crashed, order=go, node="n2")
    r = reconcile_objects(run_with(status), both, nodes, now=71.0)
    assert r.status["failures"][-1]["restart"] == "inPlace"
    assert {e.name for e in r.effects if e.kind == "order_pod"} == {"r-a1-0", "r-a2-1"}
    assert not [e for e in r.effects if e.kind == "delete_pod"]


def test_a_replacement_that_is_not_placed_or_an_agent_that_does_not_answer_recreates_the_gang():
    status = started_run()
    nodes = {"n0": node("n0"), "n1": node("n1", "False")}
    spec = {**SPEC, "faultTolerance": {"scheduleTimeoutSeconds": 30, "startupTimeoutSeconds": 30}}
    # the other pod's agent does not answer: the whole gang is recreated at once
    r = reconcile_objects(run_with(status, spec), [pod(0), pod(1, report=running(1))], nodes, now=60.0)
    assert r.status["failures"][-1]["restart"] == "recreate"
    assert "not every other pod's agent answers" in events(r, "Restarting")[0]
    # replaced; the replacement is never placed (no node left): recreated after both timeouts
    r = reconcile_objects(run_with(status, spec), [pod(i, report=running(1)) for i in range(2)], nodes, now=60.0)
    status.update(r.status)
    stop = {"attempt": 2, "start": False, "graceSeconds": 30.0}
    kept = pod(0, report={"attempt": 2, "state": "ready"}, order=stop)
    created = pod_view({"metadata": {"name": "r-a2-1", "creationTimestamp": "1970-01-01T00:01:02Z",
                                     "labels": {"trainium.dev/attempt": "2", "trainium.dev/index": "1"}},
                        "spec": {}, "status": {"phase": "Pending", "conditions": [
                            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                             "message": "0/2 nodes are available"}]}})
    r = reconcile_objects(run_with(status, spec), [kept, created], nodes, now=85.0)
    assert not events(r, "InPlaceRestartGivenUp") and not [e for e in r.effects if e.kind == "delete_pod"]
    # meanwhile the status says what the restart waits for, and until when
    assert "the replacement pod r-a2-1 waits to be placed (0/2 nodes are available); the gang is recreated if it " \
           "is not placed within 30s" in r.status["message"], r.status["message"]
    r = reconcile_objects(run_with(status, spec), [kept, created], nodes, now=93.0)  # 31 s unplaced
    status.update(r.status)
    assert "0/2 nodes are available" in events(r, "InPlaceRestartGivenUp")[0]
    assert status["current"]["restart"] == "recreate" and status["failures"][-1]["restart"] == "recreate"
    assert status["restartsReplaced"] == 0
    assert {e.name for e in r.effects if e.kind == "delete_pod"} == {"r-a1-0", "r-a2-1"}
    # the usual teardown from here; the given-up replacement is waited for (the new gang takes its name)
    r = reconcile_objects(run_with(status, spec), [created], nodes, now=93.5)
    assert r.status.get("attempt") is None and not r.ensured("Pod")
    assert [e.name for e in r.effects if e.kind == "delete_pod"] == ["r-a2-1"]
    # once every pod is gone, a new gang of attempt 2
    r = reconcile_objects(run_with(status, spec), [], nodes, now=94.0)
    assert r.status["attempt"] == 2 and [p["metadata"]["name"] for p in r.ensured("Pod")] == ["r-a2-0", "r-a2-1"]


def test_which_failures_replace_a_pod():
    status = started_run()
    # an eviction of one pod from outside the operator replaces it (its node stays usable)
    r = reconcile_objects(run_with(status), [pod(0, report=running(1)), pod(1, report=running(1), deleting=True)],
                          NODES, now=60.0)
    assert r.status["restarts"] == {"eviction": 1} and r.status["failures"][-1]["restart"] == "replace"
    assert not r.status.get("quarantinedNodes")
    # the same eviction when the pod was gone before a pass saw it (its last view: departed):
    # the same restart, and the same exemption
    gone = pod(1, report=running(1), deleting=True)
    gone.reason = "EvictionByEvictionAPI"
    r = reconcile_objects(run_with(status), [pod(0, report=running(1))], NODES, now=60.0, departed=[gone])
    last = r.status["failures"][-1]
    assert last["restart"] == "replace" and last["pod"] == "r-a1-1" and last.get("exempt") == "voluntary", last
    # a crashed rank is restarted in place, not replaced
    crashed = {"attempt": 1, "state": "exited", "exitCode": 1, "message": "", "time": 55.0}
    r = reconcile_objects(run_with(status), [pod(0, report=crashed), pod(1, report=running(1))], NODES, now=60.0)
    assert r.status["failures"][-1]["restart"] == "inPlace"
    # off with in-place restarts
    off = {**SPEC, "faultTolerance": {"inPlaceRestarts": 0}}
    nodes = {"n0": node("n0"), "n1": node("n1", "False")}
    r = reconcile_objects(run_with(status, off), [pod(i, report=running(1)) for i in range(2)], nodes, now=60.0)
    assert r.status["failures"][-1]["restart"] == "recreate"


def spare(serial: int, node: str | None, report: dict | None = None, order: dict | None = None,
          labels: dict | None = None, phase: str = "Running"):
    ann = {keys.AGENT_REPORT: json.dumps(report)} if report else {}
    if order is not None:
        ann[keys.ORDER] = json.dumps(order)
    meta = {"name": f"r-spare-{serial}", "labels": labels or {"trainium.dev/run": "r", "trainium.dev/spare": "true"},
            "annotations": ann, "creationTimestamp": f"2026-01-01T00:00:0{serial}Z",
            "ownerReferences": [{"uid": "u-1", "controller": True}]}
    return pod_view({"metadata": meta, "spec": {"nodeName": node}, "status": {"phase": phase}})


def test_a_warm_spare_takes_a_lost_pods_index_at_once_and_a_new_spare_is_requested():
    """faultTolerance.spares 1: once the gang is placed a standby pod is created (its agent told
    to wait), kept off the gang's nodes by the run's anti-affinity; it shows in status.spares
    once its agent waits. Pod 0's node is lost: the spare takes index 0 in the failure's own pass
    (labelled as attempt 2's pod 0, told to stop), a new spare is requested, and once the spare
    and pod 1 said ready, attempt 2 starts with the spare told its index, and every pod the
    new rendezvous address (the spare's own hostname): no pod created for the gang."""
    spec = {**SPEC, "faultTolerance": {"spares": 1}}
    nodes = {n: node(n) for n in ("n0", "n1", "n2", "n3")}
    r = reconcile_objects(run_with({}, spec), [], nodes, now=0.0)
    assert not [o for o in r.ensured("Pod") if "spare" in o["metadata"]["name"]]  # not before the gang is placed
    status = {**r.status, "conditions": [{"type": "Valid", "status": "True"}]}
    gang = [pod(i, report=running(1), progress=step_report(12, 1)) for i in range(2)]
    r = reconcile_objects(run_with(status, spec), gang, nodes, now=5.0)
    status.update(r.status)
    (made,) = r.ensured("Pod")
    assert made["metadata"]["name"] == "r-spare-1" and status["sparesCreated"] == 1
    assert made["metadata"]["labels"]["trainium.dev/spare"] == "true" and "trainium.dev/index" not in made[
        "metadata"]["labels"]
    assert made["spec"]["hostname"] == "r-s1" and made["spec"]["subdomain"] == "r"  # (a DNS label for any run name)
    assert {e["name"]: e.get("value") for e in made["spec"]["containers"][0]["env"]}[agent.AWAIT_START_ENV] == "1"
    assert "r-spare-1" in r.ensured("Role")[0]["rules"][0]["resourceNames"]
    # the next pass may not see the new pod yet: no second spare for it (until the settle time)
    r = reconcile_objects(run_with(status, spec), gang, nodes, now=5.5)
    assert not r.ensured("Pod")
    r = reconcile_objects(run_with(status, spec), gang, nodes, now=16.0)
    assert [o["metadata"]["name"] for o in r.ensured("Pod")] == ["r-spare-2"]  # it went: another
    # placed and waiting: a spare in status; not created again
    waiting = spare(1, "n2", report={"attempt": 1, "state": "ready"})
    r = reconcile_objects(run_with(status, spec), gang + [waiting], nodes, now=6.0)
    status.update(r.status)
    assert status["spares"] == ["r-spare-1"] and not r.ensured("Pod") and not [
        e for e in r.effects if e.kind == "delete_pod"]

    # pod 0's node is lost: the spare takes index 0 at once, a new spare is requested
    nodes["n0"] = node("n0", "False")
    r = reconcile_objects(run_with(status, spec), gang + [waiting], nodes, now=10.0)
    status.update(r.status)
    assert status["failures"][-1]["restart"] == "replace" and status["current"]["replacement"] == "r-spare-1"
    assert "by spare r-spare-1 on node n2" in events(r, "Restarting")[0]
    taken = next(e for e in r.effects if e.kind == "order_pod" and e.name == "r-spare-1")
    assert taken.order == agent.Order(2, start=False, grace_seconds=30.0)
    assert dict(taken.labels) == {"trainium.dev/attempt": "2", "trainium.dev/index": "0", "trainium.dev/spare": None}
    assert status["spares"] == [] and [o["metadata"]["name"] for o in r.ensured("Pod")] == ["r-spare-2"]
    assert {e.name: e.grace for e in r.effects if e.kind == "delete_pod"} == {"r-a1-0": 30}

    # pod 0 gone, the spare (labelled now) and pod 1 ready: attempt 2 starts, no gang pod created
    stop = {"attempt": 2, "start": False, "graceSeconds": 30.0}
    promoted = spare(1, "n2", report={"attempt": 2, "state": "ready"}, order=stop,
                     labels={"trainium.dev/run": "r", "trainium.dev/attempt": "2", "trainium.dev/index": "0"})
    kept = pod(1, report={"attempt": 2, "state": "ready"}, order=stop)
    r = reconcile_objects(run_with(status, spec), [promoted, kept], nodes, now=11.0)
    status.update(r.status)
    assert status["attempt"] == 2 and status["current"]["podNames"] == ["r-spare-1", "r-a1-1"]
    master = "r-s1.r.ns.svc"
    assert {e.name: e.order for e in r.effects if e.kind == "order_pod"} == {
        "r-spare-1": agent.Order(2, start=True, grace_seconds=30.0, index=0, master=master),
        "r-a1-1": agent.Order(2, start=True, grace_seconds=30.0, index=1, master=master)}
    assert not [o for o in r.ensured("Pod") if o["metadata"]["name"].startswith("r-a")]
    assert r.ensured("Role")[0]["rules"][0]["resourceNames"][:2] == ["r-spare-1", "r-a1-1"]
    # the spare is the gang's pod 0 now: running attempt 2, nothing stale
    go = {"attempt": 2, "start": True, "graceSeconds": 30.0, "index": 0, "master": master}
    promoted = spare(1, "n2", report=running(2), order=go,
                     labels={"trainium.dev/run": "r", "trainium.dev/attempt": "2", "trainium.dev/index": "0"})
    r = reconcile_objects(run_with(status, spec), [promoted, pod(1, report=running(2), order={**go, "index": 1})],
                          nodes, now=12.0)
    assert not [e for e in r.effects if e.kind == "delete_pod"]
    assert r.status["current"]["gangRunningTime"] == 12.0


def test_spares_are_refused_without_in_place_restarts_and_go_when_the_run_is_suspended():
    from trainium_api.fields import ConfigError
    from trainium_operator.spec import parse
    import pytest
    with pytest.raises(ConfigError, match="spec.faultTolerance.spares"):
        parse({**SPEC, "faultTolerance": {"spares": 1, "inPlaceRestarts": 0}})
    with pytest.raises(ConfigError, match="at most spec.nodes"):
        parse({**SPEC, "faultTolerance": {"spares": 3}})
    status = started_run()
    spec = {**SPEC, "faultTolerance": {"spares": 1}, "suspend": True}
    r = reconcile_objects(run_with(status, spec), [pod(i, report=running(1)) for i in range(2)]
                          + [spare(1, "n2", report={"attempt": 1, "state": "ready"})], NODES, now=20.0)
    assert "r-spare-1" in {e.name for e in r.effects if e.kind == "delete_pod"}
    assert not r.ensured("Pod")


def test_the_agent_order_carries_an_index_and_a_rendezvous_address_strictly():
    order = agent.Order(3, True, 5.0, index=2, master="r-spare-1.r.ns.svc")
    assert agent.parse_order(agent.order_payload(order)) == order
    for bad in ('{"attempt": 2, "index": -1}', '{"attempt": 2, "index": true}', '{"attempt": 2, "master": "a b"}',
                '{"attempt": 2, "master": "x;rm -rf /"}', '{"attempt": 2, "master": 7}'):
        assert agent.parse_order(bad) is None, bad
    from trainer.pod.agent import _placed
    argv = ["--nnodes", "2", "--node_rank", "0", "--master_addr", "r-0.r.ns.svc", "-m", "trainer"]
    assert _placed(argv, 1, "r-spare-1.r.ns.svc") == ["--nnodes", "2", "--node_rank", "1", "--master_addr",
                                                      "r-spare-1.r.ns.svc", "-m", "trainer"]
    assert _placed(argv, None, None) == argv


def test_a_replace_gives_up_at_once_or_on_time_when_it_cannot_finish():
    """Found in review: a replacement the API server refuses to create, or whose node is lost
    after it said ready, another pod's node lost too, a one-pod gang: recreated, never stuck."""
    spec = {**SPEC, "faultTolerance": {"scheduleTimeoutSeconds": 30}}
    status = started_run()
    nodes = {"n0": node("n0"), "n1": node("n1", "False"), "n2": node("n2")}
    r = reconcile_objects(run_with(status, spec), [pod(i, report=running(1)) for i in range(2)], nodes, now=60.0)
    status.update(r.status)
    stop = {"attempt": 2, "start": False, "graceSeconds": 30.0}
    kept = pod(0, report={"attempt": 2, "state": "ready"}, order=stop)
    # the create is refused (a quota): asked for at 61, given up once the schedule timeout passed
    refused = "pods \"r-a2-1\" is forbidden: exceeded quota"
    r = reconcile_objects(run_with(status, spec), [kept], nodes, now=61.0, children_error=refused)
    status.update(r.status)
    assert status["current"]["replacementSince"] == 61.0 and r.ensured("Pod")
    r = reconcile_objects(run_with(status, spec), [kept], nodes, now=90.0, children_error=refused)
    assert not events(r, "InPlaceRestartGivenUp")
    r = reconcile_objects(run_with(status, spec), [kept], nodes, now=92.0, children_error=refused)
    assert "exceeded quota" in events(r, "InPlaceRestartGivenUp")[0] and r.status["current"]["restart"] == "recreate"
    # the replacement said ready, then its node was lost: not started, given up
    placed = pod(1, gang=2, report={"attempt": 2, "state": "ready"}, node="n2")
    nodes_lost = {**nodes, "n2": node("n2", "Unknown")}
    r = reconcile_objects(run_with(status, spec), [kept, placed], nodes_lost, now=63.0)
    assert "lost its node" in events(r, "InPlaceRestartGivenUp")[0] and "attempt" not in r.status
    # two nodes lost at once: the whole gang is recreated at once
    base = started_run()
    four = {**SPEC, "nodes": 4, "training": {**SPEC["training"], "globalBatchSize": 8}}
    gang = [pod(i, report=running(1)) for i in range(4)]
    both = {f"n{i}": node(f"n{i}", "False" if i in (1, 2) else "True") for i in range(4)}  # (2 of 4: no disruption)
    r = reconcile_objects(run_with({**base, "worldSize": 8}, four), gang, both, now=60.0)
    assert r.status["failures"][-1]["restart"] == "recreate"
    assert "another pod's node is lost too" in events(r, "Restarting")[0]
    # a one-pod gang has nothing to keep
    one = {**SPEC, "nodes": 1}
    r = reconcile_objects(run_with(base, one), [pod(0, report=running(1))], {"n0": node("n0", "False")}, now=60.0)
    assert r.status["failures"][-1]["restart"] == "recreate"


def test_a_run_suspended_mid_replace_stops_its_replacement_and_resumes():
    status = started_run()
    nodes = {"n0": node("n0"), "n1": node("n1", "False"), "n2": node("n2")}
    r = reconcile_objects(run_with(status), [pod(i, report=running(1)) for i in range(2)], nodes, now=60.0)
    status.update(r.status)
    stop = {"attempt": 2, "start": False, "graceSeconds": 30.0}
    kept = pod(0, report={"attempt": 2, "state": "ready"}, order=stop)
    waiting = pod(1, gang=2, report={"attempt": 2, "state": "ready"}, node="n2")
    suspended = {**SPEC, "suspend": True}
    r = reconcile_objects(run_with(status, suspended), [kept, waiting], nodes, now=62.0)
    status.update(r.status)
    assert status["phase"] == "Suspended" and {e.name for e in r.effects if e.kind == "delete_pod"} == {
        "r-a1-0", "r-a2-1"}
    # suspended, the replacement still going: seen (not a newer attempt's pod), stopped, and the
    # resume waits for it (forced once its grace ran out), then starts a new attempt
    going = pod_view({"metadata": {"name": "r-a2-1", "deletionTimestamp": "1970-01-01T00:01:32Z",  # grace to 92
                                   "labels": {"trainium.dev/attempt": "2", "trainium.dev/index": "1"}},
                      "spec": {"nodeName": "n2"}, "status": {"phase": "Running"}})
    r = reconcile_objects(run_with(status), [going], nodes, now=70.0)
    assert r.effects and "attempt" not in r.status
    r = reconcile_objects(run_with(status), [going], nodes, now=93.0)
    assert {e.name: e.grace for e in r.effects if e.kind == "delete_pod"} == {"r-a2-1": 0}
    r = reconcile_objects(run_with(status), [], nodes, now=94.0)
    assert r.status["attempt"] == 2 and r.status["phase"] == "Starting" and len(r.ensured("Pod")) == 2


def test_a_pod_told_to_await_the_start_never_runs_its_workers_without_an_agent(monkeypatch):
    from trainer.pod import agent as pod_agent
    from trainium_api import exitcodes
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.setenv(agent.AWAIT_START_ENV, "1")
    assert pod_agent.serve(["--nnodes", "2"]) == exitcodes.RETRYABLE  # the pod ends: the operator recreates
    monkeypatch.delenv(agent.AWAIT_START_ENV)
    assert pod_agent.serve(["--nnodes", "2"]) is None  # an ordinary pod runs its workers without one


def test_spares_yield_to_the_gang_and_are_replaced_when_they_fail():
    """Found in review: spares are deleted while the gang waits for a node (a recreated gang),
    a taken spare that goes hands the index to the next ready spare, a failed spare or one on a
    lost node is replaced (forced there), lowering spares keeps the ready one, and a pod someone
    else labelled a spare is none."""
    spec = {**SPEC, "faultTolerance": {"spares": 2}}
    nodes = {n: node(n) for n in ("n0", "n1", "n2", "n3")}
    status = {**started_run(), "spares": ["r-spare-1", "r-spare-2"], "sparesCreated": 2}
    ready = {"attempt": 1, "state": "ready"}
    spares = [spare(1, "n2", report=ready), spare(2, "n3", report=ready)]
    gang = [pod(i, report=running(1)) for i in range(2)]
    # a crashed rank restarts the gang in place: the spares stay
    crashed = {"attempt": 1, "state": "exited", "exitCode": 1, "message": "", "time": 55.0}
    r = reconcile_objects(run_with(status, spec), [pod(0, report=crashed), gang[1]] + spares, nodes, now=60.0)
    assert r.status["failures"][-1]["restart"] == "inPlace" and not [e for e in r.effects if e.kind == "delete_pod"]
    # a recreated gang (an agent that does not answer): the spares go, none is created
    nodes_lost = {**nodes, "n0": node("n0", "False")}
    r = reconcile_objects(run_with(status, spec), [pod(0, report=running(1)), pod(1)] + spares, nodes_lost, now=60.0)
    assert r.status["failures"][-1]["restart"] == "recreate"
    assert {"r-spare-1", "r-spare-2"} <= {e.name for e in r.effects if e.kind == "delete_pod"}
    assert not r.ensured("Pod")
    # the spare given index 0 is deleted before the start: the next ready spare takes it
    r = reconcile_objects(run_with(status, spec), gang + spares, nodes_lost, now=60.0)
    taking = {**status, **r.status}
    assert taking["current"]["replacement"] == "r-spare-1"
    promoted_labels = {"trainium.dev/run": "r", "trainium.dev/attempt": "2", "trainium.dev/index": "0"}
    going = pod_view({"metadata": {"name": "r-spare-1", "labels": promoted_labels, "deletionTimestamp":
                                   "2026-01-01T00:10:00Z", "ownerReferences": [{"uid": "u-1", "controller": True}]},
                      "spec": {"nodeName": "n2"}, "status": {"phase": "Running"}})
    r = reconcile_objects(run_with(taking, spec), [gang[1], going, spares[1]], nodes_lost, now=61.0)
    assert r.status["current"]["replacement"] == "r-spare-2" and "spare r-spare-2 takes index 0" in events(
        r, "SpareLost")[0]
    assert dict(next(e for e in r.effects if e.kind == "order_pod" and e.name == "r-spare-2").labels)[
        "trainium.dev/index"] == "0"
    # a failed spare is deleted (an event) and, once the other is seen, another created; a
    # spare on a lost node is forced out
    failed = spare(2, "n3", phase="Failed")
    r = reconcile_objects(run_with(status, spec), gang + [spares[0], failed], nodes, now=70.0)
    assert "r-spare-2" in {e.name for e in r.effects if e.kind == "delete_pod"} and events(r, "SpareReplaced")
    assert [o["metadata"]["name"] for o in r.ensured("Pod")] == ["r-spare-3"]
    r = reconcile_objects(run_with(status, spec), gang + spares, {**nodes, "n3": node("n3", "Unknown")}, now=70.0)
    assert {e.name: e.grace for e in r.effects if e.kind == "delete_pod"} == {"r-spare-2": 0}
    # down to 1: the ready spare stays, the one still starting goes
    one = {**SPEC, "faultTolerance": {"spares": 1}}
    starting = spare(1, "n2", phase="Pending")
    r = reconcile_objects(run_with(status, one), gang + [starting, spares[1]], nodes, now=70.0)
    assert {e.name for e in r.effects if e.kind == "delete_pod"} == {"r-spare-1"}
    assert r.status["spares"] == ["r-spare-2"]
    # a pod labelled a spare by someone else: not one (no index for it, no trainer identity)
    foreign = pod_view({"metadata": {"name": "r-spare-9", "labels": {"trainium.dev/run": "r",
                                                                    "trainium.dev/spare": "true"}},
                        "spec": {"nodeName": "n2"}, "status": {"phase": "Running"}})
    r = reconcile_objects(run_with({**status, "spares": []}, spec), gang + [foreign], nodes, now=70.0)
    assert "r-spare-9" not in r.ensured("Role")[0]["rules"][0]["resourceNames"]
    assert "r-spare-9" not in {e.name for e in r.effects if e.kind == "delete_pod"}


def test_a_replace_status_edited_by_hand_recreates_instead_of_stalling():
    status = started_run()
    nodes = {"n0": node("n0"), "n1": node("n1", "False"), "n2": node("n2")}
    r = reconcile_objects(run_with(status), [pod(i, report=running(1)) for i in range(2)], nodes, now=60.0)
    status.update(r.status)
    for bad in ({"replacing": None}, {"replacing": 7}, {"replacement": "someone-elses-pod"}, {"replacement": "r-a1-0"}):
        edited = {**status, "current": {**status["current"], **bad}}
        r = reconcile_objects(run_with(edited), [pod(0, report={"attempt": 2, "state": "ready"})], nodes, now=61.0)
        made = [o["metadata"]["name"] for o in r.ensured("Pod")]
        assert events(r, "InPlaceRestartGivenUp") or made == ["r-a2-1"], (bad, made)


def test_warm_process_names_round_trip_and_refuse_what_they_did_not_make():
    """trainer.pod.warm: a warm-started launcher or worker names its attempt and rank (its /proc
    environment is the parked one's); a name cut at Linux's 15 bytes is not trusted."""
    from trainium_api.agent import NAME_LIMIT, parse_process_name, process_name
    assert parse_process_name(process_name(7)) == (7, None)
    assert parse_process_name(process_name(12, 127) + "\n") == (12, 127)  # as /proc/<pid>/comm reads
    assert parse_process_name("python3") is None and parse_process_name("tr-a1-rx") is None
    long = process_name(123456, 12345)
    assert len(long) >= NAME_LIMIT and parse_process_name(long[:NAME_LIMIT]) is None


def test_a_hung_gang_is_stopped_once_idle():
    """A hang: the stop order keeps the grace but ends it once the workers are idle for
    IDLE_STOP_SECONDS (a hung gang cannot agree on its stop-save; one only taken for hung
    computes and keeps the grace), written again with the same terms while an agent has not
    seen it; an agent that has not answered within the grace and ANSWER_SLACK_SECONDS has the
    gang recreated."""
    status = started_run()
    pods = [pod(i, report=running(1), progress=step_report(12, 1)) for i in range(2)]
    r = reconcile_objects(run_with(status), pods, NODES, now=5000.0)
    status.update(r.status)
    assert status["phase"] == "Restarting" and status["failures"][-1]["cause"] == "hang", status
    hung = agent.Order(2, start=False, grace_seconds=30.0, idle_seconds=inplace.IDLE_STOP_SECONDS)
    assert {e.name: e.order for e in r.effects if e.kind == "order_pod"} == {f"r-a1-{i}": hung for i in range(2)}
    stop = json.loads(agent.order_payload(hung))
    assert stop["idleSeconds"] == inplace.IDLE_STOP_SECONDS
    one_unseen = [pod(0, report={"attempt": 2, "state": "ready"}, order=stop), pod(1, report=running(1))]
    r = reconcile_objects(run_with(status), one_unseen, NODES, now=5001.0)
    assert [(e.name, e.order) for e in r.effects if e.kind == "order_pod"] == [("r-a1-1", hung)]
    silent = [pod(i, report=running(1), order=stop) for i in range(2)]
    r = reconcile_objects(run_with(status), silent, NODES, now=5000.0 + 44.0)
    assert not [e for e in r.effects if e.kind == "delete_pod"]
    r = reconcile_objects(run_with(status), silent, NODES, now=5000.0 + 46.0)
    assert {e.name for e in r.effects if e.kind == "delete_pod"} == {"r-a1-0", "r-a1-1"}
    assert r.status["failures"][-1]["restart"] == "recreate"


def test_a_grace_shortened_mid_teardown_does_not_give_up_on_agents_given_the_longer():
    """An order is not written again: agents told to stop with a 30 s grace honour it after
    teardownGraceSeconds is edited to 5. The answer is due by the longest grace ordered
    (status.current.stopGraceSeconds, plus the slack), not the edited one."""
    status = started_run()
    pods = [pod(i, report=running(1), progress=step_report(12, 1)) for i in range(2)]
    status.update(reconcile_objects(run_with(status), pods, NODES, now=5000.0).status)
    stop = json.loads(agent.order_payload(agent.Order(2, start=False, grace_seconds=30.0,
                                                      idle_seconds=inplace.IDLE_STOP_SECONDS)))
    short = {**SPEC, "faultTolerance": {**SPEC.get("faultTolerance", {}), "teardownGraceSeconds": 5}}
    silent = [pod(i, report=running(1), order=stop) for i in range(2)]
    r = reconcile_objects(run_with(status, short), silent, NODES, now=5000.0 + 44.0)
    assert not [e for e in r.effects if e.kind == "delete_pod"], r.status.get("message")
    r = reconcile_objects(run_with(status, short), silent, NODES, now=5000.0 + 46.0)
    assert {e.name for e in r.effects if e.kind == "delete_pod"} == {"r-a1-0", "r-a1-1"}
    assert status["current"]["stopGraceSeconds"] == 30.0
    # the deadline is the status's, not the pods' annotations' (which a run could write where
    # the admission policy is off)
    forged = [pod(i, report=running(1), order={**stop, "graceSeconds": 3600.0}) for i in range(2)]
    r = reconcile_objects(run_with(status, short), forged, NODES, now=5000.0 + 46.0)
    assert {e.name for e in r.effects if e.kind == "delete_pod"} == {"r-a1-0", "r-a1-1"}
    assert inplace.answer_within(None, 5.0) == 5.0 + inplace.ANSWER_SLACK_SECONDS  # none ordered yet


def test_an_order_without_a_valid_idle_time_keeps_the_whole_grace():
    base = {"attempt": 2, "start": False, "graceSeconds": 30.0}
    assert agent.parse_order(json.dumps(base)).idle_seconds is None
    assert agent.parse_order(json.dumps({**base, "idleSeconds": 2})).idle_seconds == 2.0
    for bad in (0, 0.05, -1, 1e9, True, "1", None):
        assert agent.parse_order(json.dumps({**base, "idleSeconds": bad})).idle_seconds is None, bad
    assert agent.parse_order('{"attempt": 2, "idleSeconds": NaN}').idle_seconds is None
