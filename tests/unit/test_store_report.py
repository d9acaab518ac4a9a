"""The checkpoint store as the pods see it (the operator never reads it): the report's store
fields checked like every field a pod writes, the pod's incremental listing (StoreView), the
watch resuming a command trainer from what its pod lists, and the operator's status,
conditions and events from the pods' reports."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.test_operator_core import RUN, SPEC, _node
from trainium_api import keys
from trainium_api import checkpoints, progress
from trainium_api.progress import CheckpointSeen, ProgressReport, SaveFailure, SkippedCheckpoint, StoreReport
from trainium_operator.observe import pod_view
from trainium_operator.reconcile import reconcile_objects
from trainer.pod import store_watch, watch

ROOT = Path(__file__).resolve().parents[2]


# -- the report's store fields -------------------------------------------------------------------

def test_store_fields_round_trip_and_a_store_report_needs_no_step():
    store = StoreReport(CheckpointSeen("step_20", 20, 1700000000.5), None, SaveFailure("step_30", "No space left", 2),
                        SkippedCheckpoint("step_25", "model/x.pt: 10 bytes, 20 recorded"))
    report, errors = ProgressReport.parse(ProgressReport(step=31, time=time.time(), tokens_per_second=1.0, loss=2.0,
                                                         last_checkpoint_step=20, store=store).to_annotation())
    assert errors == [] and report.store_said() == store
    # before its first step a pod says only what it sees of its store: no progress, no complaint
    denied = ProgressReport(time=time.time(), store=StoreReport(error="denied")).to_annotation()
    alone, errors = ProgressReport.parse(denied)
    assert errors == [] and alone.store_said() == StoreReport(error="denied")
    assert progress.parse(denied) is None
    assert ProgressReport.parse("{}")[1] == ["step: missing"]  # neither progress nor a word on the store


def test_a_long_error_is_cut_by_the_writer_to_one_line():
    text = ProgressReport(step=1, time=time.time(), store=StoreReport(error="x\n" * 1000)).to_annotation()
    error = json.loads(text)["storeError"]
    assert len(error) == progress.ERROR_CHARS and "\n" not in error and error.endswith("...")
    assert len(text) < progress.MAX_LENGTH


@pytest.mark.parametrize("field, value, words", [
    ("checkpoint", {"tag": "../../other-team/step_9", "step": 9}, "not one name"),
    ("checkpoint", {"tag": "..", "step": 9}, "not one name"),
    ("checkpoint", {"tag": "a\x00b"}, "not one name"),
    ("checkpoint", {"step": 9}, "tag: missing"),
    ("checkpoint", {"tag": "step_9", "step": -1}, "out of range"),
    ("checkpoint", {"tag": "step_9", "step": "9"}, "must be an integer"),
    ("checkpoint", "step_9", "must be an object"),
    ("saveFailure", {"tag": "step_9", "error": "e", "count": 0}, "out of range"),
    ("saveFailure", {"tag": "step_9", "error": "e" * 700, "count": 1}, "must be a string"),
    ("skippedCheckpoint", {"tag": "step_9"}, "error: missing"),
    ("storeError", 12, "must be a string"),
])
def test_a_bad_store_field_written_by_user_code_is_dropped_and_named(field, value, words):
    report, errors = ProgressReport.parse(json.dumps({"step": 3, field: value}))
    assert report.store == StoreReport() and report.step == 3  # the only store field it had, dropped
    assert len(errors) == 1 and errors[0].startswith(f"{field}: ") and words in errors[0], errors


# -- the pod's listing ---------------------------------------------------------------------------

def _tag(root: Path, name: str, done: bool = True, meta: dict | None = None) -> Path:
    d = root / name
    (d / "model").mkdir(parents=True, exist_ok=True)
    (d / checkpoints.BEGIN).write_text("{}")
    if meta is not None:
        (d / checkpoints.META).write_text(json.dumps(meta))
    if done:
        (d / checkpoints.DONE).write_text("")
    return d


def test_the_pods_listing_reads_each_complete_tag_once_and_follows_the_store(tmp_path):
    for step in (10, 20, 30):
        _tag(tmp_path, f"step_{step}", meta={"step": step})
    _tag(tmp_path, "step_40", done=False)  # a save under way
    view = checkpoints.StoreView(str(tmp_path))
    assert view.newest().tag == "step_30" == checkpoints.newest_complete(str(tmp_path)).tag
    first = view.requests
    assert first == 1 + 4 + 3  # the root, each tag, each complete tag's meta.json
    assert view.newest().tag == "step_30"
    assert view.requests - first == 1 + 2  # the root, the newest complete one again, the tag still open
    (tmp_path / "step_40" / checkpoints.DONE).write_text("")
    (tmp_path / "step_40" / checkpoints.META).write_text(json.dumps({"step": 40}))
    assert view.newest().tag == "step_40"
    (tmp_path / "step_40" / checkpoints.DONE).unlink()  # a rewrite removes `done` first
    assert view.newest().tag == "step_30"
    for name in ("step_30", "step_40"):  # deleted by hand
        for f in sorted((tmp_path / name).rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() else f.unlink()
        (tmp_path / name).rmdir()
    assert view.newest().tag == "step_20" == checkpoints.newest_complete(str(tmp_path)).tag


def test_the_pods_listing_at_thousands_of_tags_costs_the_root_and_what_changed(tmp_path):
    for step in range(1, 2001):
        _tag(tmp_path, f"hf--step={step}-consumed_samples={step * 8}.0.ckpt")
    view = checkpoints.StoreView(str(tmp_path), "nxdt")
    assert view.newest().step == 2000
    before = view.requests
    _tag(tmp_path, "hf--step=2001-consumed_samples=16008.0.ckpt")
    assert view.newest().step == 2001 and view.requests - before == 1 + 2


@pytest.mark.parametrize("layout", ["nxd", "nxdt"])
def test_the_pods_listing_agrees_with_the_resume_rule(tmp_path, layout):
    names = ["step_10", "step_20", "zz-no-step"] if layout == "nxd" else \
        [f"m--step={s}-consumed_samples={s}.0.ckpt" for s in (10, 20, 30)]
    for name in names:
        _tag(tmp_path, name)
    _tag(tmp_path, names[-1] + "-torn" if layout == "nxd" else "m--step=40-consumed_samples=40.0.ckpt", done=False)
    assert checkpoints.StoreView(str(tmp_path), layout).newest().tag == \
        checkpoints.newest_complete(str(tmp_path), layout).tag


# -- the watch around a command trainer ----------------------------------------------------------

def test_a_listing_that_keeps_failing_at_start_is_retried_said_then_retryable_or_fatal():
    from botocore.exceptions import ClientError
    from trainer.store import errors as store_errors
    policy = store_errors.Backoff(tries=3, first_seconds=1.0, max_seconds=4.0, total_seconds=60.0, denied_tries=3)

    def answer(code: str, status: int):
        def listing():
            raise ClientError({"Error": {"Code": code, "Message": code},
                               "ResponseMetadata": {"HTTPStatusCode": status}}, "ListObjectsV2")
        return listing
    reports, pauses = [], []
    w = store_watch.StoreWatch("/nonexistent-store", "nxdt", reports.append, sleep=pauses.append)
    w.view.newest = answer("SlowDown", 503)  # the store's answer (a boundary); the retries are under test
    with pytest.raises(store_errors.StoreUnavailable):
        w.at_start(policy)
    assert len(pauses) == 2 and "SlowDown" in reports[-1].error  # said while retrying
    w.view.newest = answer("AccessDenied", 403)
    with pytest.raises(store_errors.StoreConfigError, match="refused 3 times"):
        w.at_start(policy)


def test_the_tracker_reports_a_new_checkpoint_at_once_and_keeps_it_in_later_reports():
    from tests.unit.test_watch import Recorder
    rec = Recorder()
    tracker = watch.Tracker(watch.parser_for("nxd"), rec)
    seen = StoreReport(CheckpointSeen("step_10", 10, 5.0))
    tracker.store_changed(seen)
    assert rec.reports[-1]["step"] is None and rec.reports[-1]["store"] == seen  # before any step
    tracker.segment("LOG Mon Jan 01 00:00:00 2026 - (0, 12) step_loss : 2.5 learning_rate : 1e-4 throughput : 3.0")
    assert rec.reports[-1]["step"] == 12 and rec.reports[-1]["store"] == seen
    assert rec.reports[-1]["checkpointStep"] == 10


def _run_watch(tmp_path: Path, store: Path, layout: str) -> list[str]:
    """The watch as a real process around a command that prints the arguments it was given."""
    out = subprocess.run([sys.executable, "-m", "trainer.pod.watch", "--format", "nxdt", "--checkpoint-uri", str(store),
                          "--checkpoint-layout", layout, "--", sys.executable, "-c",
                          "import json, sys; print(json.dumps(sys.argv[1:]))", "script.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}/api:{ROOT}"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_nxdt_script_resumes_from_the_newest_complete_tag_its_pod_lists(tmp_path):
    store = tmp_path / "ckpt"
    store.mkdir()
    assert _run_watch(tmp_path, store, "nxdt") == ["script.py", "exp_manager.resume_if_exists=false"]
    done = _tag(store, "hf--step=20-consumed_samples=160.0.ckpt")
    _tag(store, "hf--step=30-consumed_samples=240.0.ckpt", done=False)  # torn: NxDT alone would take it
    assert _run_watch(tmp_path, store, "nxdt") == ["script.py", f'exp_manager.resume_from_checkpoint="{done}"']
    assert _run_watch(tmp_path, store, "nxd") == ["script.py"]  # NxD's loader takes only tags with `done`


# -- the operator: what the pods report ----------------------------------------------------------

def _pod(i: int, store: StoreReport | None, step: int | None = 50, attempt: int = 1):
    body = json.loads(ProgressReport(step=step, time=100.0 + i, tokens_per_second=10.0, loss=2.0, attempt=attempt,
                                     store=store or StoreReport()).to_annotation())
    return pod_view({"metadata": {"name": f"r-a1-{i}", "creationTimestamp": "2026-01-01T00:00:00Z",
                                  "labels": {"trainium.dev/attempt": "1", "trainium.dev/index": str(i)},
                                  "annotations": {keys.PROGRESS: json.dumps(body)}},
                     "spec": {"nodeName": f"n{i}"}, "status": {"phase": "Running"}})


NODES = {f"n{i}": _node(f"n{i}") for i in range(SPEC["nodes"])}


def _running(status: dict | None = None) -> dict:
    return {**RUN, "spec": SPEC, "status": {"phase": "Running", "attempt": 1, "createdTime": 0.0,
                                            "current": {"startTime": 1.0, "gangRunningTime": 2.0},
                                            "conditions": [{"type": "Valid", "status": "True"}], **(status or {})}}


def _events(r) -> dict[str, str]:
    return {e.reason: e.message for e in r.effects if e.kind == "event"}


def test_last_checkpoint_is_the_newest_the_pods_report_joined_to_the_runs_store():
    r = reconcile_objects(_running(), [_pod(0, StoreReport(CheckpointSeen("step_40", 40, 90.0))),
                                       _pod(1, StoreReport(CheckpointSeen("step_30", 30, 80.0)))], NODES, now=120.0)
    ck = r.after.last_checkpoint
    assert (ck.tag, ck.step, ck.time) == ("step_40", 40, 90.0)
    assert ck.uri == f"{SPEC['checkpoint']['uri'].rstrip('/')}/step_40"
    # no pod reports (a gang between attempts): the status keeps what it had
    kept = reconcile_objects({**_running(), "status": {**_running()["status"], **r.status}}, [], NODES, now=121.0)
    assert "lastCheckpoint" not in kept.status and kept.after.last_checkpoint == ck


def test_failing_saves_show_in_a_condition_and_events_until_one_completes():
    failing = StoreReport(CheckpointSeen("step_40", 40, 90.0), None, SaveFailure("step_50", "[Errno 28] No space left", 1))
    run = _running()
    r = reconcile_objects(run, [_pod(0, failing), _pod(1, None)], NODES, now=120.0)
    cond = next(c for c in r.after.conditions if c.type == "CheckpointsSaving")
    assert (cond.status, cond.reason) == ("False", "SavesFailing") and "No space left" in cond.message
    assert "step_40" in cond.message and r.after.checkpoint_save_failures == 1
    assert "CheckpointSavesFailing" in _events(r)
    run = {**run, "status": {**run["status"], **r.status}}
    more = StoreReport(failing.checkpoint, None, SaveFailure("step_60", "[Errno 28] No space left", 2))
    r = reconcile_objects(run, [_pod(0, more)], NODES, now=140.0)
    assert r.after.checkpoint_save_failures == 2 and not _events(r)  # said when they start failing, not each time
    run = {**run, "status": {**run["status"], **r.status}}
    # the failing pod gone (a restart), no save completed yet: still failing as far as anyone knows
    r = reconcile_objects(run, [_pod(1, StoreReport(failing.checkpoint))], NODES, now=150.0)
    assert next(c for c in r.after.conditions if c.type == "CheckpointsSaving").status == "False"
    r = reconcile_objects(run, [_pod(0, StoreReport(CheckpointSeen("step_70", 70, 149.0)))], NODES, now=150.0)
    cond = next(c for c in r.after.conditions if c.type == "CheckpointsSaving")
    assert cond.status == "True" and r.after.checkpoint_save_failures == 0
    assert "step_70" in _events(r)["CheckpointSavesRecovered"] and r.after.last_checkpoint.tag == "step_70"


def test_a_store_the_pods_cannot_list_is_named_in_a_condition():
    r = reconcile_objects(_running(), [_pod(0, StoreReport(error="cannot list s3://b/r: AccessDenied"), step=None)], {},
                          now=120.0)
    cond = next(c for c in r.after.conditions if c.type == "CheckpointStoreReadable")
    assert cond.status == "False" and "AccessDenied" in cond.message and "CheckpointStoreUnreadable" in _events(r)
    run = {**_running(), "status": {**_running()["status"], **r.status}}
    r = reconcile_objects(run, [_pod(0, StoreReport(CheckpointSeen("step_40", 40, 90.0)))], NODES, now=130.0)
    assert next(c for c in r.after.conditions if c.type == "CheckpointStoreReadable").status == "True"
    assert "CheckpointStoreReadable" in _events(r)


def test_a_damaged_checkpoint_the_attempt_skipped_is_named_once():
    skipped = StoreReport(CheckpointSeen("step_30", 30, 80.0), skipped=SkippedCheckpoint("step_40", "model shard cut short"))
    run = _running()
    r = reconcile_objects(run, [_pod(0, skipped)], NODES, now=120.0)
    assert r.after.current.skipped_checkpoint == "step_40: model shard cut short"
    assert "step_40" in _events(r)["CheckpointSkipped"]
    run = {**run, "status": {**run["status"], **r.status}}
    assert "CheckpointSkipped" not in _events(reconcile_objects(run, [_pod(0, skipped)], NODES, now=121.0))
    # after an in-place restart the pod keeps the last attempt's report until its new workers write
    stale = reconcile_objects({**run, "status": {**run["status"], "attempt": 2, "current": {"startTime": 130.0}}},
                              [_pod(0, skipped, attempt=1)], NODES, now=131.0)
    assert "CheckpointSkipped" not in _events(stale)


def test_an_unreadable_store_clears_once_a_pod_trains_on_an_empty_one():
    """A pod trains only once it has listed its store: an empty store says no checkpoint, yet it was read."""
    r = reconcile_objects(_running(), [_pod(0, StoreReport(error="cannot list /fsx/r: timed out"), step=None)], {},
                          now=120.0)
    run = {**_running(), "status": {**_running()["status"], **r.status}}
    r = reconcile_objects(run, [_pod(0, None, step=3)], NODES, now=130.0)
    assert next(c for c in r.after.conditions if c.type == "CheckpointStoreReadable").status == "True"


def test_the_resume_point_is_what_the_attempts_pods_say_they_resumed_from():
    """A save completed after the pods' last report and before the restart: the new attempt's
    pods list the store and take it; their first report corrects status.current.resumeCheckpoint."""
    starting = {**_running(), "status": {**_running()["status"], "phase": "Starting", "attempt": 2,
                                         "current": {"startTime": 100.0, "gangRunningTime": 101.0,
                                                     "resumeCheckpoint": {"tag": "step_10", "step": 10}}}}

    def first_report(start_step: int, seen: StoreReport | None):
        body = ProgressReport(step=start_step + 1, time=110.0, tokens_per_second=10.0, loss=2.0, attempt=2,
                              start_step=start_step, store=seen or StoreReport()).to_annotation()
        return [pod_view({"metadata": {"name": f"r-a2-{i}", "creationTimestamp": "2026-01-01T00:00:00Z",
                                       "labels": {"trainium.dev/attempt": "2", "trainium.dev/index": str(i)},
                                       "annotations": {keys.PROGRESS: body}},
                          "spec": {"nodeName": f"n{i}"}, "status": {"phase": "Running"}}) for i in range(SPEC["nodes"])]
    r = reconcile_objects(starting, first_report(15, StoreReport(CheckpointSeen("step_15", 15, 99.0))), NODES, now=111.0)
    assert r.after.phase == "Running" and (r.after.current.resume_checkpoint.tag,
                                           r.after.current.resume_checkpoint.step) == ("step_15", 15)
    r = reconcile_objects(starting, first_report(10, StoreReport(CheckpointSeen("step_10", 10, 90.0))), NODES, now=111.0)
    assert (r.after.current.resume_checkpoint.tag, r.after.current.resume_checkpoint.step) == ("step_10", 10)


def test_nxdt_tags_are_looked_into_from_the_highest_step_down(tmp_path):
    for step in range(1, 2001):
        _tag(tmp_path, f"hf--step={step}-consumed_samples={step * 8}.0.ckpt")
    _tag(tmp_path, "hf--step=2001-consumed_samples=16008.0.ckpt", done=False)  # a save under way
    view = checkpoints.StoreView(str(tmp_path), "nxdt")
    assert view.newest().step == 2000 and view.requests == 1 + 2  # the root, the open tag, the newest
    (tmp_path / "hf--step=2000-consumed_samples=16000.0.ckpt" / checkpoints.DONE).unlink()  # rewritten
    assert view.newest().step == 1999


def test_a_folder_the_pod_may_not_read_is_skipped_not_fatal(tmp_path):
    _tag(tmp_path, "step_10")
    (tmp_path / "lost+found").mkdir()
    view = checkpoints.StoreView(str(tmp_path), "nxd")
    view.fs.ls = _refusing(view.fs.ls, "lost+found")  # root reads everything: the refusal is staged
    assert view.newest().tag == "step_10"


def _refusing(ls, name: str):
    def listing(path, *a, **kw):
        if path.rstrip("/").endswith(name):
            raise PermissionError(13, "Permission denied", path)
        return ls(path, *a, **kw)
    return listing


def test_the_other_pods_take_node_rank_0s_choice_of_this_attempt():
    class ApiServer:  # stand-in for the API server's pod read (the cluster tiers use a real one)
        def __init__(self, annotation):
            self.annotation, self.reads = annotation, 0

        def read_namespaced_pod(self, name, namespace, **_):
            self.reads += 1
            if self.reads < 3:
                raise RuntimeError("not found yet")
            return type("Pod", (), {"metadata": type("M", (), {"annotations": {keys.PROGRESS: self.annotation}})})
    assert store_watch.leader_pod("run-a3-7") == "run-a3-0" and store_watch.leader_pod("run-spare-1") is None
    chosen = CheckpointSeen("m--step=20-consumed_samples=20.0.ckpt", 20, 5.0)
    word = ProgressReport(time=time.time(), attempt=3, start_step=20, store=StoreReport(chosen)).to_annotation()
    clock = iter(range(1000)).__next__
    assert store_watch.await_leader(ApiServer(word), "ns", "run-a3-0", 3, timeout=10, clock=clock,
                                    sleep=lambda s: None) == (True, chosen)
    nothing = ProgressReport(time=time.time(), attempt=3, start_step=0, store=StoreReport()).to_annotation()
    assert store_watch.await_leader(ApiServer(nothing), "ns", "run-a3-0", 3, timeout=10, clock=clock,
                                    sleep=lambda s: None) == (True, None)
    older = ProgressReport(time=time.time(), attempt=2, start_step=20, store=StoreReport(chosen)).to_annotation()
    assert store_watch.await_leader(ApiServer(older), "ns", "run-a3-0", 3, timeout=10, clock=iter(range(1000)).__next__,
                                    sleep=lambda s: None) == (False, None)
