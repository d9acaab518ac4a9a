"""The pre-flight check's verdict (trainer.pod.preflight.verdict, pure), its message, the judge's
preflight rule and goodput's preflight phase."""

from __future__ import annotations

import pytest

from tests.unit.test_judge import GUARD, NOW, node, pod
from tests.unit.test_operator_core import SPEC
from trainer.pod.preflight import pairings, verdict
from trainium_api import exitcodes, preflight
from trainium_api.status import FailureRecord
from trainium_operator import goodput
from trainium_operator.judge import Clocks, Guards, Observed, judge
from trainium_operator.observe import gang_state, node_view, pod_view
from trainium_operator.failure_policy import decide
from trainium_operator.spec import parse


def results(matmul: dict[int, float], nodes: int = 4, ranks: int = 2, errors: dict[int, str] | None = None) -> list:
    return [{"node": f"n{n}", "node_rank": n, "local_rank": r, "matmul": matmul.get(n, 0.01) * (1 + r / 100),
             "allreduce": 0.002, "errors": [errors[n]] if errors and n in errors and r == 0 else []}
            for n in range(nodes) for r in range(ranks)]


def test_every_node_is_in_two_pairs():
    for n in (3, 4, 5, 8, 9):
        pairs = pairings(n)
        assert all(sum(x in p for p in pairs) == 2 for x in range(n)), (n, pairs)
        assert all(a != b for a, b in pairs)


def test_healthy_gang_passes():
    assert verdict(results({}), {(0, 1): 0.01, (2, 3): 0.01, (1, 2): 0.011, (3, 0): 0.01}, 2.0) == {}


def test_a_slow_node_is_named_by_its_slowest_rank():
    named = verdict(results({2: 0.05}), {}, 2.0)
    assert list(named) == [2] and "n2: matmul 50" in named[2]


def test_a_device_error_is_named():
    named = verdict(results({}, errors={1: "15 Neuron devices in the container, the instance type has 16"}), {}, 2.0)
    assert named == {1: "node n1: 15 Neuron devices in the container, the instance type has 16"}


def test_a_slow_link_names_the_node_both_of_its_pairs_share():
    """Node 2's link is slow: both of its pairs, (2,3) and (1,2), are slow; 1 and 3 each have one
    fast pair, so only 2 is named (not the whole gang)."""
    links = {(0, 1): 0.01, (2, 3): 0.05, (1, 2): 0.05, (3, 0): 0.01}
    named = verdict(results({}), links, 2.0)
    assert list(named) == [2] and "pair partners" in named[2]


def test_a_node_named_for_compute_does_not_get_its_pair_partners_named():
    """3 nodes, node 2 slow: both pairs with node 2 are slow, and a noisy (0,1) must not make
    node 0 or 1 look like the link's culprit (found by a cold CI run: the run failed as 'most
    nodes failed' instead of naming node 2)."""
    links = {(0, 1): 0.05, (2, 0): 0.2, (1, 2): 0.01}
    named = verdict(results({2: 0.5}, nodes=3), links, 3.0)
    assert list(named) == [2] and "matmul" in named[2]


def test_most_nodes_failing_is_fatal_only_when_the_failures_name_the_runs_configuration():
    """3 of 4 nodes named: the run's backend that cannot start, or Neuron devices unlike the
    instance type's, on most of them is the run's configuration (FATAL); failing matmuls or a
    device that did not start for another reason on most nodes at once is not (RETRYABLE: the
    gang is restarted, no node left out). Fewer than most: no gang verdict (the nodes are named)."""
    from trainer.pod.preflight import most_failed
    backend = "the run's backend cuda cannot start: cuda requested but no CUDA device is available"
    devices = "15 Neuron devices in the container, the instance type has 16"
    for error in (backend, devices, "neuron-ls is not on PATH (it ships with the Neuron training images)"):
        res = results({}, errors={0: error, 1: error, 2: error})
        assert most_failed(verdict(res, {}, 2.0), res) == exitcodes.FATAL, error
    failed = "the matmuls failed on this rank: RuntimeError: the device timed out"
    res = results({}, errors={0: failed, 1: failed, 2: failed})
    assert most_failed(verdict(res, {}, 2.0), res) == exitcodes.RETRYABLE
    res = results({}, errors={0: "the device did not start on local rank 0: RuntimeError: timeout",
                              1: "the device did not start on local rank 0: RuntimeError: timeout", 2: backend})
    assert most_failed(verdict(res, {}, 2.0), res) == exitcodes.RETRYABLE
    res = results({}, errors={0: backend})
    assert most_failed(verdict(res, {}, 2.0), res) is None  # one node: named, not the gang's verdict


def test_the_message_is_parsed_strictly():
    text = preflight.format_message("node n2: matmul 50.0 ms\x1b[0m")
    assert preflight.parse_message(text) == "node n2: matmul 50.0 ms [0m"
    assert preflight.parse_message("oops") is None and preflight.parse_message(None) is None
    assert len(preflight.parse_message(preflight.MESSAGE_PREFIX + " " + "x" * 5000)) == preflight.REASON_LIMIT


def test_the_judge_names_the_node_the_check_failed_and_the_run_avoids_it():
    spec = parse({**SPEC, "faultTolerance": {"preflight": "on"}})
    failed = pod(1, "Failed", step=None, code=exitcodes.PREFLIGHT, term=preflight.format_message("node n1: slow"))
    pods = [pod_view(failed)] + [pod_view(pod(i, step=None)) for i in (0, 2, 3)]
    nodes = {f"n{i}": node_view(node(i)) for i in range(4)}
    verdict_ = judge(Observed(spec, gang_state(pods), nodes, NOW), Clocks(gang_running_time=NOW - 5), Guards(GUARD))
    f = verdict_.failure
    assert (f.cause, f.node, f.pod_reported) == ("preflight", "n1", True) and "node n1: slow" in f.message
    from trainium_api.status import FailureCounters
    action = decide(f, spec, FailureCounters(), [], None, NOW)
    assert action.kind == "restart" and action.avoid_node == "n1"


@pytest.mark.parametrize("mode, itype, on", [("auto", "trn1.32xlarge", True), ("auto", "cpu", False),
                                             ("on", "cpu", True), ("off", "trn1.32xlarge", False)])
def test_auto_is_on_for_trainium_only(mode, itype, on):
    body = {**SPEC, "instanceType": itype, "faultTolerance": {"preflight": mode}}
    if itype == "cpu":
        body = {**body, "parallelism": {"tensor": 1}, "model": {"preset": "tiny"}}
    assert parse(body).preflight_on() is on


def test_bad_values_are_refused_with_the_field_named():
    from trainium_api.spec import ConfigError
    for patch, field in [({"preflight": "maybe"}, "preflight"), ({"preflightSlowFactor": 1}, "preflightSlowFactor"),
                         ({"preflightTimeoutSeconds": 0}, "preflightTimeoutSeconds")]:
        with pytest.raises(ConfigError, match=field):
            parse({**SPEC, "faultTolerance": patch})


def test_goodput_counts_the_check_as_its_own_phase():
    """Created at 0, training from 30 (its check took 8 s); a hang at 100 (last step 95, torn
    down 105); attempt 2 ran from 110 and failed its check at 130 (20 s of checking); attempt 3
    checked for 15 s and trained from 160. The 43 s of checks come out of schedule."""
    g = goodput.account(0.0, 30.0, [], 40.0, 1.0, 0, preflight_seconds=8.0)
    assert (g.lost_seconds.schedule, g.lost_seconds.preflight) == (22.0, 8.0)
    hang = FailureRecord(id=1, time=100.0, cause="hang", last_progress_time=95.0, teardown_done_time=105.0)
    failed_check = FailureRecord(id=2, time=130.0, cause="preflight", teardown_done_time=131.0, resumed_time=160.0,
                                 resumed_steps=0)
    g = goodput.account(0.0, 30.0, [hang, failed_check], 200.0, 1.0, 0, preflight_seconds=43.0)
    assert g.lost_seconds.preflight == 43.0 and g.lost_seconds.schedule == 84.0 - 43.0
    assert (g.lost_seconds.detect, g.lost_seconds.teardown) == (5.0, 6.0)


def test_a_failed_check_adds_its_seconds_and_a_blamed_node_is_checked_again():
    from tests.unit.test_control_loop import _run
    from trainium_operator.reconcile import reconcile_objects
    from tests.unit.test_operator_core import _node
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    failed = pod(1, "Failed", step=None, code=exitcodes.PREFLIGHT, term=preflight.format_message("node n1: slow"))
    pods = [pod_view(failed)] + [pod_view(pod(i, step=None)) for i in (0, 2, 3)]
    run = _run({"phase": "Starting", "attempt": 1, "createdTime": 0.0, "preflightSeconds": 8.0,
                "preflightPassed": [{"node": "n1", "time": NOW - 100}, {"node": "n2", "time": NOW - 100}],
                "current": {"startTime": NOW - 30, "gangRunningTime": NOW - 20}})
    r = reconcile_objects(run, pods, nodes, now=NOW)
    assert r.after.failures[-1].cause == "preflight" and r.after.preflight_seconds == 28.0
    assert [pp.node for pp in r.after.preflight_passed] == ["n2"]
    # a 76 from a run that is training, or without the check's message, is an ordinary crash
    spec = parse({**SPEC, "faultTolerance": {"preflight": "on"}})
    training = [pod_view(pod(1, "Failed", step=30, code=exitcodes.PREFLIGHT, term=preflight.format_message("x")))] + \
        [pod_view(pod(i)) for i in (0, 2, 3)]
    nodes_v = {f"n{i}": node_view(node(i)) for i in range(4)}
    v = judge(Observed(spec, gang_state(training), nodes_v, NOW), Clocks(gang_running_time=NOW - 5), Guards(GUARD))
    assert v.failure.cause == "application"
    bare = [pod_view(pod(1, "Failed", step=None, code=exitcodes.PREFLIGHT))] + [pod_view(pod(i, step=None)) for i in (0, 2, 3)]
    v = judge(Observed(spec, gang_state(bare), nodes_v, NOW), Clocks(gang_running_time=NOW - 5), Guards(GUARD))
    assert v.failure.cause == "application"


def test_a_timeout_or_factor_out_of_range_is_refused():
    from trainium_api.spec import ConfigError
    for patch, field in [({"preflightTimeoutSeconds": 1e15}, "preflightTimeoutSeconds"),
                         ({"preflightTimeoutSeconds": 5}, "preflightTimeoutSeconds"),
                         ({"preflightSlowFactor": float("nan")}, "preflightSlowFactor"),
                         ({"stragglerFactor": float("inf")}, "stragglerFactor")]:
        with pytest.raises(ConfigError, match=field):
            parse({**SPEC, "faultTolerance": patch})


def test_only_a_lost_peer_makes_a_rank_wait_to_be_stopped():
    """A collective that fails because another rank went away (torch's DistError, or gloo's
    transport words in a plain RuntimeError, as gloo 2.9 raises them) is a peer's failure; any
    other error on this rank (its device, its code) is its own and ends it."""
    import torch.distributed as dist

    from trainer.pod.preflight import lost_a_peer
    assert lost_a_peer(dist, dist.DistStoreError("wait timeout after 30000ms"))
    assert lost_a_peer(dist, RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Read error "
                                          "[127.0.0.1]:18861: Connection reset by peer"))
    assert not lost_a_peer(dist, RuntimeError("nrt_execute failed: NRT_EXEC_HW_ERR_HBM_UE (status 1201)"))
