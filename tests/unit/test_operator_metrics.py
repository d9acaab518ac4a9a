"""The operator's per-run series: what alerts and the dashboard read (charts/trainium-operator)."""

from __future__ import annotations

from prometheus_client import generate_latest

from tests.conftest import tiny_run_spec
from trainium_operator import metrics
from trainium_operator.reconcile import read_status

M = metrics.Metrics()  # one operator's series (its own registry, made here, not at import)


def spec(**checkpoint):
    return tiny_run_spec(checkpoint=checkpoint)


def series(run: str) -> dict[str, float]:
    out = {}
    for line in generate_latest(M.registry).decode().splitlines():
        if not line.startswith("#") and f'run="{run}"' in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


STATUS = {"phase": "Running", "step": 120, "current": {"lastStepTime": 1000.0}, "stepSeconds": 2.0, "tokensPerSecond": 5e4,
          "loss": 2.5, "restarts": {"node": 2, "application": 1}, "createdTime": 10.0,
          "lastCheckpoint": {"step": 100, "time": 900.0}, "quarantinedNodes": ["n1"],
          "goodput": {"effectiveRatio": 0.93, "lostSeconds": {"detect": 1.0, "schedule": 30.0}}}


def test_observe_run_exports_the_status():
    M.observe_run("ml", "m1", spec(intervalSteps=50), read_status(STATUS))
    s = series("m1")
    assert s['trainium_run_phase{namespace="ml",phase="Running",run="m1"}'] == 1
    assert s['trainium_run_phase{namespace="ml",phase="Failed",run="m1"}'] == 0
    assert s['trainium_run_restarts{cause="node",namespace="ml",run="m1"}'] == 2
    assert s['trainium_run_restarts{cause="hang",namespace="ml",run="m1"}'] == 0  # every cause, from 0
    assert s['trainium_run_lost_seconds{namespace="ml",phase="schedule",run="m1"}'] == 30
    assert s['trainium_run_lost_seconds{namespace="ml",phase="recompute",run="m1"}'] == 0
    for name, value in (("effective_training_ratio", 0.93), ("step", 120), ("last_step_timestamp_seconds", 1000),
                        ("tokens_per_second", 5e4), ("loss", 2.5), ("last_checkpoint_step", 100),
                        ("last_checkpoint_timestamp_seconds", 900), ("created_timestamp_seconds", 10),
                        ("quarantined_nodes", 1), ("checkpoint_interval_seconds", 100),
                        ("hang_timeout_seconds", 120)):  # the example sets hangTimeoutSeconds: 120
        assert s[f'trainium_run_{name}{{namespace="ml",run="m1"}}'] == value, name


def test_unknown_values_are_absent_not_zero():
    M.observe_run("ml", "m2", spec(intervalSteps=50), read_status({"phase": "Starting", "createdTime": 5.0}))
    s = series("m2")
    for name in ("step", "loss", "last_checkpoint_step", "effective_training_ratio", "checkpoint_interval_seconds"):
        assert not any(k.startswith(f"trainium_run_{name}{{") for k in s), name
    M.observe_run("ml", "m2", None, read_status({"phase": "Failed"}))  # an invalid spec: no spec-derived series
    assert series("m2")['trainium_run_phase{namespace="ml",phase="Failed",run="m2"}'] == 1


def test_expected_checkpoint_interval():
    assert metrics.expected_checkpoint_interval(spec(intervalSteps=50, intervalMinutes=0), None) is None
    assert metrics.expected_checkpoint_interval(spec(intervalSteps=50, intervalMinutes=0), 2.0) == 100
    assert metrics.expected_checkpoint_interval(spec(intervalSteps=0, intervalMinutes=30), None) == 1800
    assert metrics.expected_checkpoint_interval(spec(intervalSteps=1000, intervalMinutes=30), 2.0) == 1800
    assert metrics.expected_checkpoint_interval(spec(intervalSteps=0, intervalMinutes=0), 2.0) is None


def test_forget_drops_every_series_of_a_deleted_run():
    M.observe_run("ml", "gone", spec(), read_status(STATUS))
    M.count_error("ml", "gone")
    assert series("gone")
    M.forget("ml", "gone")
    assert series("gone") == {}
    M.forget("ml", "never-seen")  # harmless


def test_a_pass_ending_after_its_run_was_deleted_or_the_term_ended_exports_nothing():
    """Found by review: a pass runs on its own thread; one that ended after the run's deletion
    (forget) or the replica's step-down (forget_all) put the ghost's series back."""
    M.observe_run("ml", "late", spec(), read_status(STATUS), uid="u-late")
    M.forget("ml", "late", "u-late")
    M.observe_run("ml", "late", spec(), read_status(STATUS), uid="u-late")  # the pass that was under way
    assert series("late") == {}
    M.observe_run("ml", "late", spec(), read_status(STATUS), uid="u-new")  # created again: a new uid exports
    assert series("late")
    M.forget("ml", "late", "u-new")
    M.observe_run("ml", "led", spec(), read_status(STATUS), uid="u-led", leading=lambda: False)
    assert series("led") == {}


def test_a_term_ends_with_no_run_series_left():
    """Found by review: a replica that stopped leading kept exporting what it last saw (a run
    Running, its checkpoint time), and the alerts (max by run over both replicas) fired for runs
    that ended or went while another replica led."""
    M.observe_run("ml", "a", spec(), read_status(STATUS))
    M.observe_run("team", "b", spec(), read_status(STATUS))
    M.forget_all()
    assert series("a") == {} and series("b") == {}
    M.observe_run("ml", "a", spec(), read_status(STATUS))  # the next term exports again
    assert series("a")
    M.forget("ml", "a")


def test_latency_histograms_exist_for_every_cause_before_any_failure():
    text = generate_latest(M.registry).decode()
    for cause in ("application", "node", "neuron-device", "hang", "eviction", "scheduling"):
        assert f'trainium_failure_detection_seconds_count{{cause="{cause}"}}' in text
        assert f'trainium_failure_recovery_seconds_count{{cause="{cause}"}}' in text


def test_restarts_by_kind_restore_source_and_the_pods_nodes():
    st = read_status({**STATUS, "restartCount": 5, "restartsInPlace": 2, "restartsReplaced": 1, "attempt": 3,
                      "current": {"restoreSource": "peer"}})
    placed = {"k-a3-0": ("n1", "i-0aaa"), "k-a3-1": ("n2", "")}
    M.observe_run("ml", "k", spec(), st, placed)
    s = series("k")
    for kind, count in (("inPlace", 2), ("replace", 1), ("recreate", 2)):
        assert s[f'trainium_run_restarts_by_kind{{namespace="ml",restart="{kind}",run="k"}}'] == count
    assert s['trainium_run_restore_source{namespace="ml",run="k",source="peer"}'] == 1
    assert s['trainium_run_restore_source{namespace="ml",run="k",source="store"}'] == 0
    assert s['trainium_run_pod_node{instance_id="i-0aaa",namespace="ml",node="n1",pod="k-a3-0",run="k"}'] == 1
    # the next attempt's pods replace the last's; a pass without the snapshot's pods changes nothing
    M.observe_run("ml", "k", spec(), st, {"k-a4-0": ("n3", "i-0ccc")})
    M.observe_run("ml", "k", spec(), st)
    assert [k for k in series("k") if k.startswith("trainium_run_pod_node")] == [
        'trainium_run_pod_node{instance_id="i-0ccc",namespace="ml",node="n3",pod="k-a4-0",run="k"}']
    # before a restore, no source at all (absent, not 0)
    M.observe_run("ml", "k", spec(), read_status(STATUS))
    assert not any(k.startswith("trainium_run_restore_source") for k in series("k"))
    M.forget("ml", "k")
    assert series("k") == {}


def test_instance_id_and_placed_pods():
    from trainium_operator.observe import NodeView, PodView
    assert metrics.instance_id("aws:///us-west-2d/i-0123456789abcdef0") == "i-0123456789abcdef0"
    assert metrics.instance_id("") == metrics.instance_id("kind://docker/kind/n1") == ""
    assert metrics.instance_id("aws:///us-west-2d/i-" + "0" * 100_000) == ""  # garbage: no label value
    assert metrics.instance_id("aws:///us-west-2d/i-0abc\nx") == ""
    nodes = {"n1": NodeView("n1", "True", provider_id="aws:///us-west-2d/i-0123456789abcdef0")}
    pods = [PodView("r-a2-0", 2, 0, "Running", "n1", False), PodView("r-a2-1", 2, 1, "Pending", None, False),
            PodView("r-a1-0", 1, 0, "Running", "n1", True), PodView("r-a1-2", 1, 2, "Running", "n9", False),
            PodView("r-spare-1", 0, -1, "Running", "n1", False, spare=True)]
    # a finished run's pods stay (Succeeded): they are on no node any more
    assert metrics.placed_pods(["r-a2-0"], [PodView("r-a2-0", 2, 0, "Succeeded", "n1", False)], nodes) == {}
    # an in-place restart keeps attempt 1's pod r-a1-2 in attempt 2's gang
    assert metrics.placed_pods(["r-a2-0", "r-a2-1", "r-a1-2"], pods, nodes) == {"r-a2-0": ("n1", "i-0123456789abcdef0"),
                                                                              "r-a1-2": ("n9", "")}
