"""Straggler detection over progress reports (stragglers.update, the judge's straggler rule and
the policy's quarantine for it). Pure."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.test_judge import GUARD, NOW, node, pod
from tests.unit.test_operator_core import SPEC
from trainium_api.status import FailureCounters
from trainium_operator import stragglers
from trainium_operator.judge import Clocks, Guards, Observed, judge
from trainium_operator.observe import gang_state, node_view, pod_view
from trainium_operator.failure_policy import decide
from trainium_operator.spec import parse

def spec_with(**ft):
    return parse({**SPEC, "faultTolerance": {"stragglerFactor": 1.5, "stragglerReports": 3, **ft}})


FT = spec_with()


def reports(t: float, compute: dict[int, float]) -> list:
    out = []
    for i in range(4):
        raw = pod(i)
        raw["metadata"]["annotations"]["trainium.dev/progress"] = (
            f'{{"step": 50, "time": {t}, "computeSeconds": {compute.get(i, 0.2)}}}')
        out.append(pod_view(raw))
    return out


def run(rounds: list[dict[int, float]], ft=FT, same_time: bool = False):
    streaks, flagged = [], []
    for r, compute in enumerate(rounds):
        streaks, new = stragglers.update(streaks, reports(NOW if same_time else NOW + r, compute), ft, NOW + r)
        flagged += new
    return streaks, flagged


def test_a_pod_slower_than_the_others_median_for_n_reports_is_a_straggler():
    streaks, flagged = run([{2: 0.5}] * 3)
    assert [(s.pod, s.node, s.reports, s.ratio) for s in flagged] == [("r-a1-2", "n2", 3, 2.5)]
    assert stragglers.flagged(streaks) == flagged
    # flagged once: more slow reports keep it flagged, with no second flag
    streaks, again = stragglers.update(streaks, reports(NOW + 10, {2: 0.5}), FT, NOW + 10)
    assert not again and stragglers.flagged(streaks)[0].reports == 4


def test_one_report_at_speed_ends_the_streak():
    streaks, flagged = run([{2: 0.5}, {2: 0.5}, {}, {2: 0.5}, {2: 0.5}])
    assert not flagged and [s.reports for s in streaks] == [2]


def test_a_report_is_counted_once():
    """Passes run far more often than reports arrive: the same report must not count again."""
    streaks, flagged = run([{2: 0.5}] * 5, same_time=True)
    assert not flagged and streaks[0].reports == 1


def test_at_the_factor_is_not_slow_and_off_watches_nothing():
    assert run([{2: 0.3}] * 5) == ([], [])  # exactly 1.5x
    assert run([{2: 0.5}] * 5, ft=spec_with(stragglers="off")) == ([], [])


def test_two_pods_one_slow_is_seen():
    """The median of the *other* pods: with two pods the slow one is compared with the fast."""
    streaks = []
    for r in range(3):
        two = reports(NOW + r, {1: 0.6})[:2]
        streaks, new = stragglers.update(streaks, two, FT, NOW + r)
    assert [s.pod for s in stragglers.flagged(streaks)] == ["r-a1-1"]


def test_pods_without_compute_time_are_left_out():
    """A command trainer reports none; a lazy (XLA) device none either."""
    views = [pod_view(pod(i)) for i in range(4)]
    assert stragglers.update([], views, FT, NOW) == ([], [])


@pytest.mark.parametrize("mode, cause", [("report", None), ("replace", "straggler")])
def test_the_judge_acts_on_a_straggler_only_when_told_to_replace(mode, cause):
    streaks, flagged = run([{2: 0.5}] * 3)
    spec = parse({**SPEC, "faultTolerance": {"stragglers": mode}})
    pods = reports(NOW, {2: 0.5})
    nodes = {f"n{i}": node_view(node(i)) for i in range(4)}
    clocks = Clocks(gang_running_time=NOW - 300, last_step_time=NOW - 1, step_seconds=1.0,
                    stragglers=tuple(flagged))
    verdict = judge(Observed(spec, gang_state(pods), nodes, NOW), clocks, Guards(GUARD))
    assert (verdict.failure.cause if verdict.failure else None) == cause
    if cause:
        assert verdict.failure.node == "n2" and "2.5x" in verdict.failure.message
        # the evidence is the run's own: its pods avoid the node, no taint for everyone ...
        action = decide(verdict.failure, spec, FailureCounters(), [], 40, NOW)
        assert action.kind == "restart" and (action.quarantine_node, action.avoid_node) == ("", "n2")
        # ... unless the operator trusts pod reports
        action = decide(verdict.failure, spec, FailureCounters(), [], 40, NOW, trust_pod_reports=True)
        assert (action.quarantine_node, action.avoid_node) == ("n2", "")


def test_bad_values_are_refused_with_the_field_named():
    from trainium_api.spec import ConfigError
    for patch, field in [({"stragglerFactor": 1.0}, "stragglerFactor"), ({"stragglers": "kill"}, "stragglers"),
                         ({"stragglerReports": 0}, "stragglerReports")]:
        with pytest.raises(ConfigError, match=field):
            parse({**SPEC, "faultTolerance": patch})


def test_stale_tiny_and_absurd_reports_are_not_compared():
    # a pod whose reports stopped long ago is no one's baseline
    views = reports(NOW, {2: 0.5})
    for i in (0, 1, 3):
        views[i].progress = replace(views[i].progress, time=NOW - 3600)
    assert stragglers.update([], views, FT, NOW) == ([], [])
    # a tiny value cannot make a ratio of infinity (it would not even be JSON in the status)
    views = reports(NOW, {0: 5e-324, 1: 5e-324, 3: 5e-324, 2: 1e6})
    streaks, _ = stragglers.update([], views, FT, NOW)
    assert streaks == []


def test_one_pods_clock_running_ahead_leaves_the_others_watched():
    """Issue 48: measured from the newest report, one clock ahead made every other pod's report
    stale, and nothing was compared. Measured against the operator's own clock, the slow pod is
    still found (the observer refuses a report dated more than 300 s ahead)."""
    streaks, flagged = [], []
    for r in range(3):
        views = reports(NOW + r, {2: 0.5})
        views[0].progress = replace(views[0].progress, time=NOW + r + 240)
        streaks, new = stragglers.update(streaks, views, FT, NOW + r)
        flagged += new
    assert [(s.pod, s.reports) for s in flagged] == [("r-a1-2", 3)]
    assert all(s.pod != "r-a1-0" for s in streaks)


def test_steps_longer_than_the_window_are_still_compared():
    """Found by review: against now alone, reports of steps longer than three progress intervals
    (a report dates the step's end) were all stale, and nothing was ever compared."""
    streaks, flagged = [], []
    for r in range(3):
        streaks, new = stragglers.update(streaks, reports(NOW + 100 * r, {2: 0.5}), FT, NOW + 100 * r + 60)
        flagged += new
    assert [(s.pod, s.reports) for s in flagged] == [("r-a1-2", 3)]


@pytest.mark.parametrize("patch, why", [
    ({"parallelism": {"tensor": 8, "pipeline": 2, "sequenceParallel": True}}, "pipeline"),
    ({"faultTolerance": {"stragglers": "off"}}, "is Disabled"),
])
def test_layouts_that_wait_on_other_pods_are_not_watched(patch, why):
    spec = parse({**SPEC, **patch})
    assert why in stragglers.watchable(spec)
    assert stragglers.update([], reports(NOW, {2: 0.5}), spec, NOW) == ([], [])
    assert stragglers.watchable(FT) == ""


def test_replace_only_while_the_node_can_be_left_out_and_the_budget_has_room():
    from trainium_operator.failure_policy import straggler_replace_allowed
    spec = spec_with(stragglers="replace")
    assert straggler_replace_allowed(spec, FailureCounters(), [], NOW)
    assert not straggler_replace_allowed(spec, FailureCounters(), ["a"] * spec.quarantine_limit(), NOW)
    assert not straggler_replace_allowed(spec, FailureCounters(recent={"straggler": [NOW - 1] * 3}), [], NOW)
    assert not straggler_replace_allowed(spec_with(stragglers="replace", quarantine=False), FailureCounters(), [], NOW)


def test_a_hold_keeps_the_straggler_rule_quiet():
    from tests.unit.test_judge import PEER
    spec = spec_with(stragglers="replace")
    streaks, flagged = run([{2: 0.5}] * 3)
    pods = reports(NOW, {2: 0.5})
    held = pod(0, "Failed", code=1, term=PEER, finished_ago=1)
    pods[0] = pod_view(held)
    nodes = {f"n{i}": node_view(node(i)) for i in range(4)}
    clocks = Clocks(gang_running_time=NOW - 300, last_step_time=NOW - 1, step_seconds=1.0, stragglers=tuple(flagged))
    verdict = judge(Observed(spec, gang_state(pods), nodes, NOW), clocks, Guards(GUARD))
    assert verdict.failure is None and "caused" in verdict.hold.reason
