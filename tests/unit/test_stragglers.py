"""Straggler detection over progress reports (stragglers.update, the judge's straggler rule and
the policy's quarantine for it). Pure."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.test_judge import GUARD, NOW, node, pod
from tests.unit.test_operator_core import SPEC
from trainium_api.spec import FaultToleranceConfig
from trainium_api.status import FailureCounters
from trainium_operator import stragglers
from trainium_operator.judge import Clocks, Guards, Observed, judge
from trainium_operator.observe import gang_state, node_view, pod_view
from trainium_operator.policy import decide
from trainium_operator.spec import parse

FT = FaultToleranceConfig(straggler_factor=1.5, straggler_reports=3)


def reports(t: float, compute: dict[int, float]) -> list:
    out = []
    for i in range(4):
        raw = pod(i)
        raw["metadata"]["annotations"]["trainium.dev/progress"] = (
            f'{{"step": 50, "time": {t}, "computeSeconds": {compute.get(i, 0.2)}}}')
        out.append(pod_view(raw))
    return out


def run(rounds: list[dict[int, float]], ft: FaultToleranceConfig = FT, same_time: bool = False):
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
    assert run([{2: 0.5}] * 5, ft=replace(FT, stragglers="off")) == ([], [])


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
        action = decide(verdict.failure, spec, FailureCounters(), [], 40, NOW)
        assert action.kind == "restart" and action.quarantine_node == "n2"


def test_bad_values_are_refused_with_the_field_named():
    from trainium_api.spec import ConfigError
    for patch, field in [({"stragglerFactor": 1.0}, "stragglerFactor"), ({"stragglers": "kill"}, "stragglers"),
                         ({"stragglerReports": 0}, "stragglerReports")]:
        with pytest.raises(ConfigError, match=field):
            parse({**SPEC, "faultTolerance": patch})
