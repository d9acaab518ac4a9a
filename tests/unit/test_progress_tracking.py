"""progress_tracking: the gang's reports into the status, and the conditions on how its pods
start and what they report (tables). Reports are written as the pods write them (the annotation)."""

from __future__ import annotations

import json

import pytest

from tests.unit.passes import NOW, events, make_pass, spec_with
from trainium_api import keys
from trainium_operator.observe import gang_state, pod_view
from trainium_operator.progress_tracking import report_bad_progress, report_startup, track_progress
from trainium_operator.reasons import Cond, Reason


def reporting(i: int, progress: dict | None = None, phase: str = "Running", waiting: str = "", raw: str = ""):
    ann = {"trainium.dev/progress": raw or json.dumps({"attempt": 1, **(progress or {})})} if progress or raw else {}
    status = {"phase": phase}
    if phase == "Pending":
        reason, _, message = waiting.partition(": ")
        status.update(conditions=[{"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
                      containerStatuses=[{"name": "trainer", "state": {"waiting": {"reason": reason, "message": message}}}])
    return pod_view({"metadata": {"name": f"r-a1-{i}", "annotations": ann,
                                  "labels": {keys.ATTEMPT: "1", keys.INDEX: str(i)}},
                     "spec": {"nodeName": f"n{i}"}, "status": status})


TRACK = [
    # name, status as read, reports (step, time, extra) -> the status fields written
    ("no report: nothing", {}, [None, None], {"step": None, "step_seconds": None}),
    ("a first report: step, loss", {}, [(12, 110.0, {"loss": 2.5}), (12, 110.0, {"loss": 2.5})],
     {"step": 12, "loss": 2.5}),
    ("the step moves: the step time from the trainer's clock", {"stepSeconds": None, "lastProgressTime": 100.0,
                                                                  "current": {"lastStep": 10, "lastStepTime": NOW - 9}},
     [(12, 110.0, {}), (12, 110.0, {})], {"step_seconds": 5.0}),
    ("...smoothed", {"stepSeconds": 4.0, "lastProgressTime": 100.0, "current": {"lastStep": 10, "lastStepTime": NOW - 9}},
     [(12, 110.0, {}), (12, 110.0, {})], {"step_seconds": 4.3}),
    ("the restore time rises to the slowest pod's, the total by the difference",
     {"restoreSeconds": 10.0, "current": {"restoreSeconds": 3.0}},
     [(12, 110.0, {"restoreSeconds": 3.0}), (12, 110.0, {"restoreSeconds": 5.0})], {"restore_seconds": 12.0}),
]


@pytest.mark.parametrize("name,status,reports,expect", TRACK, ids=[c[0] for c in TRACK])
def test_track_progress(name, status, reports, expect):
    pods = [reporting(i, None if r is None else {"step": r[0], "time": r[1], **r[2]}) for i, r in enumerate(reports)]
    p = make_pass({"phase": "Running", "attempt": 1, **status}, pods)
    track_progress(p, gang_state(p.current))
    assert {k: getattr(p.new, k) for k in expect} == expect


STARTUP = [
    # name, PodsStarted as read, the pods -> condition status, event
    ("a pull error: False and an event", None, [reporting(0, phase="Pending", waiting="ErrImagePull: no such image")],
     "False", [Reason.POD_NOT_STARTING]),
    ("still False: no second event", "False", [reporting(0, phase="Pending", waiting="ImagePullBackOff: back-off")],
     "False", []),
    ("being created is starting", None, [reporting(0, phase="Pending", waiting="ContainerCreating: ")], None, []),
    ("started: True again, no event", "False", [reporting(0), reporting(1)], "True", []),
]


@pytest.mark.parametrize("name,was,pods,state,said", STARTUP, ids=[c[0] for c in STARTUP])
def test_pods_started(name, was, pods, state, said):
    conditions = [] if was is None else [{"type": Cond.PODS_STARTED, "status": was, "reason": "ErrImagePull"}]
    p = make_pass({"phase": "Starting", "attempt": 1, "conditions": conditions}, pods,
                  spec=spec_with(startupTimeoutSeconds=600))
    report_startup(p)
    got = next((c.status for c in p.new.conditions if c.type == Cond.PODS_STARTED), None)
    assert (got, events(p)) == (state, said)


PROGRESS = [
    # name, ProgressValid as read (status, message), a report -> condition status, event
    ("a malformed field: False and an event", None, '{"step": "x", "time": 1}', "False", [Reason.MALFORMED_PROGRESS]),
    ("the same field again: no second event", ("False", "pod r-a1-0: malformed step in trainium.dev/progress; ignored"),
     '{"step": "y", "time": 1}', "False", []),
    ("another field: an event", ("False", "pod r-a1-0: malformed step in trainium.dev/progress; ignored"),
     '{"step": 1, "time": "t"}', "False", [Reason.MALFORMED_PROGRESS]),
    ("parsed again: True", ("False", "m"), '{"step": 1, "time": 1}', "True", []),
]


@pytest.mark.parametrize("name,was,raw,state,said", PROGRESS, ids=[c[0] for c in PROGRESS])
def test_progress_valid(name, was, raw, state, said):
    conditions = [] if was is None else [{"type": Cond.PROGRESS_VALID, "status": was[0], "message": was[1]}]
    p = make_pass({"phase": "Running", "attempt": 1, "conditions": conditions}, [reporting(0, raw=raw)])
    report_bad_progress(p)
    got = next((c.status for c in p.new.conditions if c.type == Cond.PROGRESS_VALID), None)
    assert (got, events(p)) == (state, said)
