"""failure_policy: a failure -> the action the judge's verdict carries (tables): fail, or restart
with its backoff, the node quarantined or avoided, and its kind (in place, replace, recreate);
the budgets and the node limit, one type each."""

from __future__ import annotations

import pytest

from tests.unit.passes import NOW, pod, spec_with
from trainium_api.agent import Report
from trainium_api.status import FailureCounters, StragglerStreak
from trainium_operator.failure_policy import Budget, NodeLimit, Standing, act, decide, replaceable_stragglers
from trainium_operator.observe import Failure
from trainium_operator.spec import parse

FT = {"budgetWindowMinutes": 60, "backoffSeconds": 10, "maxBackoffSeconds": 300, "maxQuarantinedNodes": 2,
      "restartBudget": {"application": 2, "node": 3}, "noProgressRestarts": 2}
CRASH = Failure("application", "pod r-a1-0 failed", node="n0", pod="r-a1-0")
NODE = Failure("node", "node n1 is NotReady", node="n1", pod="r-a1-1")
REPORTED = Failure("neuron-device", "the runtime named n1", node="n1", pod="r-a1-1", pod_reported=True)


def recent(cause: str, *ago: float) -> FailureCounters:
    return FailureCounters(recent={cause: [NOW - a for a in ago]})


DECIDE = [
    # name, failure, counters, quarantined, avoided, trust -> kind, reason starts, quarantined node, avoided node, delay
    ("a first crash restarts after the base backoff x2", CRASH, FailureCounters(), [], [], False,
     "restart", "pod r-a1-0", "", "", 10.0),
    ("fatal fails", Failure("application", "x", fatal=True), FailureCounters(), [], [], False,
     "fail", "fatal error", "", "", 0.0),
    ("the budget spent fails", CRASH, recent("application", 10, 20), [], [], False,
     "fail", "restart budget for application exhausted (2 restarts in 60 min)", "", "", 0.0),
    ("failures out of the window are not counted", CRASH, recent("application", 4000, 5000), [], [], False,
     "restart", "pod r-a1-0", "", "", 10.0),
    ("the backoff doubles with each failure in the window", CRASH, recent("node", 10, 20), [], [], False,
     "restart", "pod r-a1-0", "", "", 40.0),
    ("no progress fails", CRASH, FailureCounters(streak=2, streak_checkpoint_step=40), [], [], False,
     "fail", "no progress: 2 restarts", "", "", 0.0),
    ("a node failure quarantines the node", NODE, FailureCounters(), [], [], False,
     "restart", "node n1", "n1", "", 10.0),
    ("a pod's word only avoids", REPORTED, FailureCounters(), [], [], False, "restart", "the runtime", "", "n1", 10.0),
    ("a pod's word quarantines when trusted", REPORTED, FailureCounters(), [], [], True,
     "restart", "the runtime", "n1", "", 10.0),
    ("past the node limit fails", NODE, FailureCounters(), ["a"], ["b"], False,
     "fail", "cluster unhealthy: leaving out n1 would exceed 2", "", "", 0.0),
    ("a node in both lists counts once", NODE, FailureCounters(), ["a"], ["a"], False,
     "restart", "node n1", "n1", "", 10.0),
    ("a node already left out is not left out again", NODE, FailureCounters(), ["n1", "b"], [], False,
     "restart", "node n1", "", "", 10.0),
]


@pytest.mark.parametrize("name,failure,counters,quarantined,avoided,trust,kind,reason,node,avoid,delay", DECIDE,
                         ids=[c[0] for c in DECIDE])
def test_decide(name, failure, counters, quarantined, avoided, trust, kind, reason, node, avoid, delay):
    a = decide(failure, parse(spec_with(**FT)), counters, quarantined, 40, NOW, avoided, trust)
    assert (a.kind, a.quarantine_node, a.avoid_node, a.delay_seconds) == (kind, node, avoid, delay)
    assert a.reason.startswith(reason), a.reason


def answering(attempt: int = 1) -> Report:
    return Report(attempt, "running")


GANG = (pod(0, agent=answering()), pod(1, agent=answering()))
KINDS = [
    # name, faultTolerance, failure, gang, streak, lost nodes -> restart kind, why recreated, index replaced
    ("in-place off recreates", {"inPlaceRestarts": 0}, CRASH, GANG, 1, (), "recreate", "in-place restarts are off", None),
    ("a crash restarts in place", {"inPlaceRestarts": 2}, CRASH, GANG, 1, (), "inPlace", "", None),
    ("too many in place in a row recreate", {"inPlaceRestarts": 2}, CRASH, GANG, 3, (), "recreate",
     "2 in-place restart(s) in a row did not advance the checkpoint", None),
    ("an agent that does not answer recreates", {"inPlaceRestarts": 2}, CRASH, (pod(0, agent=answering()), pod(1)), 1,
     (), "recreate", "not every pod's agent answers", None),
    ("a lost node replaces its pod", {"inPlaceRestarts": 2}, NODE, GANG, 1, ("n1",), "replace", "", 1),
    ("another pod's node lost too recreates", {"inPlaceRestarts": 2}, NODE, GANG, 1, ("n0", "n1"), "recreate",
     "another pod's node is lost too", None),
    ("a hang names no pod: recreated", {"inPlaceRestarts": 2, "quarantine": False}, Failure("hang", "stuck"),
     (pod(0), pod(1)), 1, (), "recreate", "not every pod's agent answers", None),
]


@pytest.mark.parametrize("name,ft,failure,gang,streak,lost,kind,why,index", KINDS, ids=[c[0] for c in KINDS])
def test_the_verdict_carries_the_restart_kind(name, ft, failure, gang, streak, lost, kind, why, index):
    standing = Standing(checkpoint_step=40, in_place_streak=streak, pods=gang, attempt=1, lost_nodes=frozenset(lost))
    a = act(failure, parse(spec_with(**FT, **ft)), standing, NOW, False)
    assert (a.kind, a.restart, a.recreated_because, a.replace_index) == ("restart", kind, why, index)
    assert a.replace_pod == ("" if index is None else f"r-a1-{index}")


def test_a_failed_run_carries_no_restart_kind():
    a = act(Failure("application", "x", fatal=True), parse(spec_with(**FT)), Standing(pods=GANG, attempt=1), NOW, False)
    assert (a.kind, a.restart) == ("fail", None)


LIMITS = [
    # name, limit, excluded, node -> room
    ("room", 2, ("a",), "b", True),
    ("full", 2, ("a", "b"), "c", False),
    ("one already out takes no more room", 2, ("a", "b"), "b", True),
    ("no node: one more", 1, (), "", True),
]


@pytest.mark.parametrize("name,limit,excluded,node,room", LIMITS, ids=[c[0] for c in LIMITS])
def test_the_node_limit(name, limit, excluded, node, room):
    assert NodeLimit(limit, excluded).room_for(node) is room


BUDGETS = [
    # name, counters, cause -> spent, allows
    ("none spent", FailureCounters(), "application", 0, True),
    ("one in the window", recent("application", 3599), "application", 1, True),
    ("at the window's edge", recent("application", 3600, 3600), "application", 2, False),
    ("past it", recent("application", 3601, 3601), "application", 0, True),
    ("another cause's", recent("node", 1, 1), "application", 0, True),
]


@pytest.mark.parametrize("name,counters,cause,spent,allows", BUDGETS, ids=[c[0] for c in BUDGETS])
def test_the_budget_window(name, counters, cause, spent, allows):
    budget = Budget(parse(spec_with(**FT)))
    assert (budget.spent(counters, cause, NOW), budget.allows(counters, cause, NOW)) == (spent, allows)
    assert budget.avoiding(NOW - 3599, NOW) and not budget.avoiding(NOW - 3600, NOW)


def straggler(node: str = "n1") -> StragglerStreak:
    return StragglerStreak(pod="r-a1-1", node=node, reports=3, ratio=2.0, flagged_time=NOW)


STRAGGLERS = [
    # name, faultTolerance, standing -> acted on
    ("replace, room and budget: acted on", {"stragglers": "replace"}, Standing(), 1),
    ("report only: not", {"stragglers": "report"}, Standing(), 0),
    ("the node limit reached: reported only", {"stragglers": "replace"}, Standing(quarantined=("a", "b")), 0),
    ("the straggler budget spent: reported only", {"stragglers": "replace", "restartBudget": {"straggler": 1}},
     Standing(counters=recent("straggler", 10)), 0),
    ("its node already left out: not again", {"stragglers": "replace"}, Standing(avoided=("n1",)), 0),
]


@pytest.mark.parametrize("name,ft,standing,acted", STRAGGLERS, ids=[c[0] for c in STRAGGLERS])
def test_the_straggler_budget(name, ft, standing, acted):
    spec = parse(spec_with(**{**FT, **ft, "restartBudget": {**FT["restartBudget"], **ft.get("restartBudget", {})}}))
    assert len(replaceable_stragglers(spec, standing, (straggler(),), NOW)) == acted


CAPACITY = Failure("scheduling", "1 of 2 pod(s) unscheduled for 600s: 0/3 nodes are available", capacity=True)


def test_a_gang_not_placed_whole_is_released_and_placed_again_without_spending_a_budget():
    spec = parse(spec_with(**FT))
    spent = recent("scheduling", 10, 20, 30, 40)  # the scheduling budget (3) spent, and streaks
    action = decide(CAPACITY, spec, FailureCounters(recent=spent.recent, streak=5, streak_checkpoint_step=None),
                    [], None, NOW, run_key="uid-a")
    assert action.kind == "restart" and "placed whole or not at all" in action.reason
    assert 5 <= action.delay_seconds < 15 and action.quarantine_node == action.avoid_node == ""
    # a recreate: the whole gang is released (its pods hold no node while it waits)
    standing = Standing(counters=spent, attempt=1, run_key="uid-a")
    assert act(CAPACITY, spec, standing, NOW, False).restart == "recreate"


def test_the_capacity_backoff_doubles_to_the_cap_and_runs_racing_do_not_retry_in_step():
    from trainium_operator.failure_policy import capacity_backoff
    spec = parse(spec_with(**FT))
    delays = [capacity_backoff(spec, waits, "uid-a") for waits in range(8)]
    for waits, delay in enumerate(delays):  # 10 s doubling, x [0.5, 1.5), capped at maxBackoffSeconds
        assert min(300.0, 5.0 * 2 ** waits) <= delay <= min(300.0, 15.0 * 2 ** waits), (waits, delay)
    # no backoff asked for (maxBackoffSeconds 0): still a jittered one, or racing runs retry in step
    no_backoff = parse(spec_with(**{**FT, "maxBackoffSeconds": 0}))
    assert 5 <= capacity_backoff(no_backoff, 0, "uid-a") < 15
    runs = {capacity_backoff(spec, 3, f"uid-{i}") for i in range(20)}
    assert len(runs) >= 15 and max(runs) - min(runs) > 10  # two runs seldom come back together


def test_a_failure_that_is_not_capacity_still_spends_the_scheduling_budget():
    spec = parse(spec_with(**FT))
    pods_not_created = Failure("scheduling", "2 pod(s) not created 700s after the attempt started: quota")
    assert decide(pods_not_created, spec, recent("scheduling", 10, 20, 30), [], None, NOW).kind == "fail"
