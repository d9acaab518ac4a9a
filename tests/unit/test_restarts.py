"""restarts: the verdict's action applied (one map from restart kind to what starts it), a
restart seen through (the barrier and its one watchdog), and the one force-delete rule (tables)."""

from __future__ import annotations

import pytest

from tests.unit.passes import NOW, deletes, events, make_pass, node, orders, pod, spec_with, taints
from trainium_api.agent import Report
from trainium_operator.failure_policy import Action, Standing
from trainium_operator.judge import Verdict
from trainium_operator.observe import Failure, gang_state
from trainium_operator.reasons import Reason
from trainium_operator.restarts import act_on, teardown
from trainium_operator.run_pass import OUT_OF_SERVICE_TAINT, overdue

SPEC = spec_with(inPlaceRestarts=2, teardownGraceSeconds=30, quarantine=True)
OVERDUE = [
    # name, deleting, gone by, since, node dead, dead counts -> forced
    ("not being deleted", False, None, NOW - 100, False, False, False),
    ("its deletionTimestamp passed", True, NOW - 1, None, False, False, True),
    ("its deletionTimestamp ahead", True, NOW + 1, NOW - 100, False, False, False),
    ("no deletionTimestamp: the grace since the teardown began", True, None, NOW - 30, False, False, True),
    ("...not yet", True, None, NOW - 29, False, False, False),
    ("no deletionTimestamp, no start: never", True, None, None, False, False, False),
    ("its node known dead, where that counts", True, NOW + 1, None, True, True, True),
    ("its node known dead, where it does not", True, NOW + 1, None, True, False, False),
]


@pytest.mark.parametrize("name,deleting,gone_by,since,node_dead,dead,forced", OVERDUE, ids=[c[0] for c in OVERDUE])
def test_the_one_force_delete_rule(name, deleting, gone_by, since, node_dead, dead, forced):
    nodes = {"n0": node("n0", taints=(OUT_OF_SERVICE_TAINT,) if node_dead else ())}
    p = make_pass(pods=[], node_views=nodes, spec=SPEC)
    assert overdue(p, pod(0, deleting=deleting, gone_by=gone_by), since, dead) is forced


def failure(cause: str, index: int) -> Failure:
    return Failure(cause, f"pod r-a1-{index} failed", node=f"n{index}", pod=f"r-a1-{index}")


ACT = [
    # name, failure, action -> events, stop orders, deletes, taints, status.current.replacement
    ("in place: every agent told to stop", failure("application", 0),
     Action("restart", "x", restart="inPlace", delay_seconds=10), [Reason.RESTARTING], ["r-a1-0", "r-a1-1"], [], [], ""),
    ("replace: the failed pod goes, the other stops, a new pod will take its index", failure("node", 1),
     Action("restart", "x", restart="replace", replace_pod="r-a1-1", replace_index=1, quarantine_node="n1"),
     [Reason.NODE_QUARANTINED, Reason.RESTARTING], ["r-a1-0"], [("r-a1-1", 30)], ["n1"], "r-a2-1"),
    ("recreate: the gang goes", failure("hang", 0), Action("restart", "x", restart="recreate", recreated_because="y"),
     [Reason.RESTARTING], [], [("r-a1-0", 30), ("r-a1-1", 30)], [], ""),
    ("fail: the gang goes, the run fails", failure("application", 0), Action("fail", "fatal"),
     [Reason.FAILED], [], [("r-a1-0", 30), ("r-a1-1", 30)], [], ""),
]


@pytest.mark.parametrize("name,failed,action,said,stopped,deleted,tainted,replacement", ACT, ids=[c[0] for c in ACT])
def test_the_verdict_applied(name, failed, action, said, stopped, deleted, tainted, replacement):
    p = make_pass({"phase": "Running", "attempt": 1}, [pod(0), pod(1)], spec=SPEC)
    act_on(p, Verdict(failed, action=action), Standing(checkpoint_step=40), gang_state(p.current))
    assert (events(p), orders(p), deletes(p), taints(p)) == (said, stopped, deleted, tainted)
    # every restart kind keeps the grace it ordered, or would have, in status (found by review:
    # a recreate's stopGraceSeconds was lost once); a failed run orders nothing
    assert p.new.current.stop_grace_seconds == (30.0 if action.kind == "restart" else None)
    (record,) = p.new.failures  # written once, whole
    assert (record.cause, record.action, record.restart, record.checkpoint_step) == \
        (failed.cause, action.kind, action.restart, 40)
    assert p.new.phase == ("Failed" if action.kind == "fail" else "Restarting")
    assert (p.new.current.replacement or "") == replacement


def ready(attempt: int = 2) -> Report:
    return Report(attempt, "ready")


def restarting(**current) -> dict:
    return {"phase": "Restarting", "attempt": 1, "failures": [{"id": 1, "time": NOW - 10, "cause": "application",
                                                               "action": "restart", "attempt": 1, "restart": "inPlace"}],
            "current": {"restart": "inPlace", "teardownStartTime": NOW - 10, "restartNotBefore": NOW - 1,
                        "stopGraceSeconds": 30, **current}}


IN_PLACE = [
    # name, status, pods -> attempt after, events, restart kind after
    ("every agent ready, the backoff over: the next attempt in the same pods", restarting(),
     [pod(0, agent=ready()), pod(1, agent=ready())], 2, [Reason.RESTARTED], "inPlace"),
    ("...the backoff not over: it waits", restarting(restartNotBefore=NOW + 5),
     [pod(0, agent=ready()), pod(1, agent=ready())], 1, [], "inPlace"),
    ("an agent not answering yet: ordered again", restarting(),
     [pod(0, agent=ready()), pod(1, agent=Report(1, "running"))], 1, [], "inPlace"),
    ("not answering within the grace and the slack: given up", restarting(teardownStartTime=NOW - 46),
     [pod(0, agent=ready()), pod(1, agent=Report(1, "running"))], 1, [Reason.IN_PLACE_GIVEN_UP], "recreate"),
    ("a pod going: given up", restarting(), [pod(0, agent=ready()), pod(1, agent=ready(), deleting=True)], 1,
     [Reason.IN_PLACE_GIVEN_UP], "recreate"),
    ("a pod gone: given up", restarting(), [pod(0, agent=ready())], 1, [Reason.IN_PLACE_GIVEN_UP], "recreate"),
]


@pytest.mark.parametrize("name,status,pods,attempt,said,kind", IN_PLACE, ids=[c[0] for c in IN_PLACE])
def test_an_in_place_restart_through_its_barrier(name, status, pods, attempt, said, kind):
    p = make_pass(status, pods, spec=SPEC)
    teardown(p)
    assert (p.new.attempt, events(p)) == (attempt, said)
    if attempt == 2:
        assert p.new.current.gang_attempt == 1  # in the same pods
    else:
        assert p.new.current.restart == kind


def replacing(**current) -> dict:
    return restarting(**{"restart": "replace", "replacing": 1, "replacement": "r-a2-1", "replacementSince": NOW - 10,
                         **current})


REPLACE = [
    # name, status, pods, nodes -> events, deletes, restart kind after
    ("the failed pod on a dead node: forced at once", replacing(),
     [pod(0, agent=ready()), pod(1, deleting=True, gone_by=NOW + 20)], {"n0": node("n0")}, [], [("r-a1-1", 0)],
     "replace"),
    ("...on a NotReady node: its grace first", replacing(),
     [pod(0, agent=ready()), pod(1, deleting=True, gone_by=NOW + 20)], {"n0": node("n0"), "n1": node("n1", "False")},
     [], [], "replace"),
    ("the replacement never created: given up", replacing(replacementSince=NOW - 700, teardownStartTime=NOW - 700),
     [pod(0, agent=ready())], {"n0": node("n0")}, [Reason.IN_PLACE_GIVEN_UP], [("r-a1-0", 30)], "recreate"),
    ("another pod's node lost: given up", replacing(), [pod(0, agent=ready())], {"n0": node("n0", "Unknown")},
     [Reason.IN_PLACE_GIVEN_UP], [("r-a1-0", 30)], "recreate"),
]


@pytest.mark.parametrize("name,status,pods,nodes,said,deleted,kind", REPLACE, ids=[c[0] for c in REPLACE])
def test_a_replace_through_its_barrier(name, status, pods, nodes, said, deleted, kind):
    p = make_pass(status, pods, nodes, spec=spec_with(inPlaceRestarts=2, teardownGraceSeconds=30,
                                                      scheduleTimeoutSeconds=600))
    teardown(p)
    assert (events(p), deletes(p), p.new.current.restart) == (said, deleted, kind)
