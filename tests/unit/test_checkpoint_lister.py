"""The operator's checkpoint listing runs off the reconcile pass (checkpoints.CheckpointLister): a
slow or hung store never holds a pass, failures keep the last answer, a listing that does not
answer is given up. The store is a STAND-IN function (the lister's own logic is the thing under
test; listing a real store is tested in tests/unit/test_ckpt_store.py and the s3 tier)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from trainium_operator.checkpoints import CheckpointLister

RUN = {"metadata": {"namespace": "ns", "name": "r"}, "spec": {"checkpoint": {"uri": "s3://b/r"}}}


def _tag(step):
    return SimpleNamespace(tag=f"step_{step}", step=step, done_mtime=1.0, uri=f"s3://b/r/step_{step}")


def _until(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_hung_store_never_holds_a_pass_and_is_given_up():
    release, calls = threading.Event(), []

    def hung(uri, layout):
        calls.append(uri)
        release.wait(10)
        return _tag(5)
    lister = CheckpointLister(hung)
    lister.LIST_TIMEOUT_SECONDS = 1.0
    lister.REPORTED_REFRESH_SECONDS = 0.0
    newer = [SimpleNamespace(progress={"lastCheckpointStep": 9})]  # makes a listing due at every pass
    t0 = time.monotonic()
    assert lister.newest(RUN, "Running", newer) is None  # the answer so far, at once
    assert time.monotonic() - t0 < lister.LIST_TIMEOUT_SECONDS  # (not waiting for the hung listing)
    _until(lambda: len(calls) == 1)
    t1 = time.monotonic()
    assert lister.newest(RUN, "Running", newer) is None  # one listing at a time
    assert time.monotonic() - t1 < lister.LIST_TIMEOUT_SECONDS
    time.sleep(1.1)
    assert lister.newest(RUN, "Running", newer) is None  # given up now ...
    time.sleep(0.1)
    assert lister.newest(RUN, "Running", newer) is None and len(calls) == 1  # ... not asked again while it hangs
    release.set()
    time.sleep(0.1)
    assert lister.newest(RUN, "Running", newer) is None  # its late answer was dropped; a new listing starts
    _until(lambda: lister.newest(RUN, "Running", []) is not None)
    assert len(calls) == 2 and lister.newest(RUN, "Running", []).step == 5


def _answering(*answers):
    """A store listing that gives these answers in turn (an exception is raised); ``.left``:
    the answers not given yet."""
    queue = list(answers)

    def listing(uri, layout):
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer
    listing.left = queue
    return listing


def test_a_failing_store_keeps_the_last_answer():
    flaky = _answering(_tag(10), RuntimeError("503 Slow Down"))
    lister = CheckpointLister(flaky)
    lister.REPORTED_REFRESH_SECONDS = 0.0
    assert lister.newest(RUN, "Restarting", []).step == 10  # a starting gang waits briefly for it
    lister.newest(RUN, "Restarting", [SimpleNamespace(progress={"lastCheckpointStep": 20})])
    _until(lambda: not flaky.left)
    time.sleep(0.05)
    assert lister.newest(RUN, "Running", []).step == 10
    assert lister.newest({**RUN, "spec": {}}, "Running", []) is None  # no store: nothing to list


def test_a_reported_step_the_store_never_shows_lists_at_a_bounded_rate():
    """A trainer that reports a checkpoint step the store does not have (or whose `done` lags)
    makes a listing due sooner, not at every pass; a run held suspended is not listed as one
    about to start."""
    calls = []

    def store(uri, layout):
        calls.append(uri)
        return _tag(5)
    lister = CheckpointLister(store)
    lying = [SimpleNamespace(progress={"lastCheckpointStep": 99})]
    for _ in range(50):
        lister.newest(RUN, "Running", lying)
        time.sleep(0.002)
    _until(lambda: lister.newest(RUN, "Running", []) is not None)
    assert len(calls) == 1
    held = {**RUN, "metadata": {"namespace": "ns", "name": "held"}, "spec": {**RUN["spec"], "suspend": True}}
    for _ in range(3):
        lister.newest(held, "Suspended", [])
        time.sleep(0.4)  # past the 1 s refresh of a gang about to start
    assert len(calls) == 2  # the first listing only


def test_a_run_that_ends_reports_the_save_its_gang_made_just_before_it_exited():
    """When a pod is first seen to succeed, a listing begun after that moment must answer before
    the run stops being listed: not one begun earlier (still under way, blind to the final save),
    and not cut short by the run turning Succeeded meanwhile. Then the finished run is not listed
    again, and a success seen again (the same pod) lists nothing more."""
    tags, calls, release = [_tag(50)], [], threading.Event()
    release.set()

    def store(uri, layout):
        answer = tags[-1]  # what the store holds when the listing begins
        calls.append(answer.step)
        release.wait(10)
        return answer
    lister = CheckpointLister(store)
    lister.REPORTED_REFRESH_SECONDS = 0.0
    assert lister.newest(RUN, "Restarting", []).step == 50
    # a listing that begins before the final save and answers after the pod has exited
    release.clear()
    lister.newest(RUN, "Running", [SimpleNamespace(name="r-a1-0", created=1.0, phase="Running",
                                                    progress={"lastCheckpointStep": 60})])
    _until(lambda: len(calls) == 2)
    tags.append(_tag(100))  # the final save; then the pod exits 0
    done = [SimpleNamespace(name="r-a1-0", created=1.0, phase="Succeeded", progress=None)]
    assert lister.newest(RUN, "Running", done).step == 50  # waited briefly; the stale listing is still out
    release.set()
    _until(lambda: lister.newest(RUN, "Succeeded", done).step == 100)  # the run ended; still listed once more
    assert calls == [50, 50, 100]
    for phase in ("Succeeded", "Succeeded", "Running"):
        lister.newest(RUN, phase, done)
    time.sleep(0.05)
    assert calls == [50, 50, 100]  # its final listing answered: no more for the same success
    assert lister.newest(RUN, "Succeeded", done) is None  # a finished run is not listed again


def test_a_finished_run_whose_final_listing_fails_is_tried_a_few_times_not_forever():
    """A 5xx must not lose the final checkpoint (it is asked again at the next pass), and a
    store that keeps failing is not asked forever; a run forgotten meanwhile is not brought back."""
    calls = []

    def failing(uri, layout):
        calls.append(uri)
        raise RuntimeError("503 Slow Down")
    lister = CheckpointLister(failing)
    done = [SimpleNamespace(name="r-a1-0", created=1.0, phase="Succeeded", progress=None)]
    assert lister.newest(RUN, "Running", done) is None  # the pass that sees the pod succeed
    for _ in range(10):
        lister.newest(RUN, "Succeeded", done)
        time.sleep(0.05)
    assert len(calls) == CheckpointLister.FINAL_TRIES
    lister.forget("ns", "r")
    assert lister.newest(RUN, "Succeeded", done) is None
    time.sleep(0.05)
    assert len(calls) == CheckpointLister.FINAL_TRIES and not lister._entries


def test_a_final_listing_that_fails_once_still_reports_the_final_save():
    flaky = _answering(RuntimeError("503 Slow Down"), _tag(100))
    lister = CheckpointLister(flaky)
    done = [SimpleNamespace(name="r-a1-0", created=1.0, phase="Succeeded", progress=None)]
    lister.newest(RUN, "Running", done)
    _until(lambda: (v := lister.newest(RUN, "Succeeded", done)) is not None and v.step == 100)
