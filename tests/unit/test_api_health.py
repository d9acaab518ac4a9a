"""When the operator could not see the cluster (apihealth), and what reconcile does with it: a
quiet gang is not called hung while the API is away, nor until the API has been back for the
hang timeout."""

from __future__ import annotations

import logging
import time

from trainium_operator.apihealth import ApiHealth, ApiProbe
from trainium_operator.reconcile import reconcile_objects

from .test_operator_core import RUN, SPEC, _node, _pod


def test_an_outage_runs_from_the_first_failure_to_the_next_answer():
    told = []
    h = ApiHealth(stale_after=4.0, on_change=told.append)
    assert h.outage(10.0) is None
    h.answered(10.0)
    h.failed(12.0, "refused")
    h.failed(13.0, "refused")  # the same outage: it began at the first failure
    assert h.outage(20.0) == (12.0, 20.0)  # under way: it lasts until now
    h.answered(21.0)
    assert h.outage(22.0) == (12.0, 21.0)
    h.answered(23.0)  # answers after the end change nothing
    assert h.outage(24.0) == (12.0, 21.0)
    assert told == [True, False]  # once when it began, once when it ended (the metric)


def test_a_probe_overdue_counts_as_an_outage_from_its_last_answer():
    h = ApiHealth(stale_after=4.0)
    h.answered(100.0)
    assert h.outage(103.0) is None
    assert h.outage(105.0) == (100.0, 105.0)  # unconfirmed for 5 s: we may not have heard
    h.answered(106.0)  # the probe got through again: that stretch is recorded
    assert h.outage(107.0) == (100.0, 106.0)
    h.unwatched()  # the probe stopped (this replica stands by): no stretch runs until it answers again
    assert h.outage(200.0) == (100.0, 106.0)
    h.answered(201.0)
    assert h.outage(202.0) == (100.0, 106.0)


def test_an_outage_under_way_when_the_replica_stands_by_ends_there():
    """Found by review: the operator's memory outlives a leadership term, and an outage still
    open at the step-down was stretched over the whole standby by the next term's first answer,
    holding a node lost meanwhile (while another replica led) for the guard's maximum."""
    told = []
    h = ApiHealth(stale_after=4.0, on_change=told.append)
    h.answered(990.0)
    h.failed(1000.0, "partitioned")
    h.unwatched(1030.0)  # the lease is lost: the probe stops
    assert h.outage(4130.0) == (1000.0, 1030.0)  # not (1000.0, 4130.0): the standby is no outage
    h.answered(4131.0)  # the next term's first answer
    assert h.outage(4132.0) == (1000.0, 1030.0)
    assert told == [True, False]
    # the pass of the new term acts on a node lost at 4000, settled long ago
    run = {**RUN, "spec": {**SPEC, "nodes": 4}, "status": {
        "phase": "Running", "attempt": 1, "createdTime": 0.0, "conditions": [{"type": "Valid", "status": "True"}]}}
    nodes = {f"n{i}": _node(f"n{i}", ready="Unknown" if i == 0 else "True") for i in range(4)}
    r = reconcile_objects(run, [_pod(i, step=5) for i in range(4)], nodes, now=4200.0,
                          api_outage=h.outage(4200.0))
    assert r.status["phase"] == "Restarting", r.status


def test_the_probe_thread_reports_refusals_and_answers(caplog):
    """The probe's ready() here is a plain function: the first two calls fail as a refused
    connection does, the rest answer (the probe against a real API server is in the cluster tier)."""
    import threading
    calls, done = [], threading.Event()

    def ready(timeout: float) -> None:
        calls.append(timeout)
        if len(calls) <= 2:
            raise ConnectionRefusedError(111, "Connection refused")
        if len(calls) >= 4:
            done.set()

    h = ApiHealth()
    with caplog.at_level(logging.INFO, logger="trainium_operator"):
        probe = ApiProbe(ready, h, interval=0.01, timeout=1.5).start()
        assert done.wait(5)
        probe.stop()
    now = time.time()
    began, ended = h.outage(now)
    assert began < ended < now and calls[0] == 1.5
    assert "unreachable (ConnectionRefusedError" in caplog.text and "is back after" in caplog.text


def _quiet_run(hang_timeout: float) -> dict:
    spec = {**SPEC, "nodes": 4, "faultTolerance": {"hangTimeoutSeconds": hang_timeout}}
    return {**RUN, "spec": spec, "status": {
        "phase": "Running", "attempt": 1, "createdTime": 0.0, "current": {"gangRunningTime": 10.0, "lastStep": 5,
        "lastStepTime": 20.0}, "conditions": [{"type": "Valid", "status": "True"}]}}


def test_no_hang_is_called_while_the_api_is_away_or_until_it_was_back_for_the_timeout():
    run, pods = _quiet_run(8), [_pod(i, step=5) for i in range(4)]
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    # the last step was seen at 20; the API went away at 25 and is still away at 40
    assert reconcile_objects(run, pods, nodes, now=40.0, api_outage=(25.0, 40.0)).status.get("phase") is None
    # back at 41: the hang clock restarts there, not at 20
    assert reconcile_objects(run, pods, nodes, now=48.0, api_outage=(25.0, 41.0)).status.get("phase") is None
    r = reconcile_objects(run, pods, nodes, now=49.5, api_outage=(25.0, 41.0))
    assert r.status["phase"] == "Restarting" and r.status["failures"][-1]["cause"] == "hang"
    # without an outage the same silence is a hang at once
    assert reconcile_objects(run, pods, nodes, now=40.0).status["phase"] == "Restarting"


def test_a_blip_shorter_than_the_outage_minimum_does_not_restart_the_hang_clock():
    """A two-second blip while the gang is silent holds the judgement while it lasts, but the
    hang clock keeps its start: a blip every few minutes must not hide a real hang for ever."""
    run, pods = _quiet_run(8), [_pod(i, step=5) for i in range(4)]
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    assert reconcile_objects(run, pods, nodes, now=40.0, api_outage=(38.0, 40.0)).status.get("phase") is None  # under way
    r = reconcile_objects(run, pods, nodes, now=41.0, api_outage=(38.0, 40.0))  # over after 2 s (minimum 10 s)
    assert r.status["phase"] == "Restarting" and r.status["failures"][-1]["cause"] == "hang"
