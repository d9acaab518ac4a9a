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
    lister.LIST_TIMEOUT_SECONDS = 0.3
    lister.REPORTED_REFRESH_SECONDS = 0.0
    newer = [SimpleNamespace(progress={"lastCheckpointStep": 9})]  # makes a listing due at every pass
    t0 = time.monotonic()
    assert lister.newest(RUN, "Running", newer) is None  # the answer so far, at once
    _until(lambda: len(calls) == 1)
    assert lister.newest(RUN, "Running", newer) is None  # one listing at a time
    assert time.monotonic() - t0 < 0.5
    time.sleep(0.4)
    assert lister.newest(RUN, "Running", newer) is None  # given up now ...
    time.sleep(0.1)
    assert lister.newest(RUN, "Running", newer) is None and len(calls) == 1  # ... not asked again while it hangs
    release.set()
    time.sleep(0.1)
    assert lister.newest(RUN, "Running", newer) is None  # its late answer was dropped; a new listing starts
    _until(lambda: lister.newest(RUN, "Running", []) is not None)
    assert len(calls) == 2 and lister.newest(RUN, "Running", []).step == 5


def test_a_failing_store_keeps_the_last_answer():
    answers = [_tag(10), RuntimeError("503 Slow Down")]

    def flaky(uri, layout):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer
    lister = CheckpointLister(flaky)
    lister.REPORTED_REFRESH_SECONDS = 0.0
    assert lister.newest(RUN, "Restarting", []).step == 10  # a starting gang waits briefly for it
    lister.newest(RUN, "Restarting", [SimpleNamespace(progress={"lastCheckpointStep": 20})])
    _until(lambda: not answers)
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


def test_a_gang_that_finished_is_listed_once_more_so_the_run_ends_with_its_final_checkpoint():
    """The pass that sees a pod succeed waits for a listing begun after it (the run is about to
    end, and a finished run is not listed again); later passes do not list again for it."""
    tags, calls = [_tag(50)], []

    def store(uri, layout):
        calls.append(uri)
        return tags[-1]
    lister = CheckpointLister(store)
    assert lister.newest(RUN, "Restarting", []).step == 50
    tags.append(_tag(100))  # the final save, then the pod exits
    running = [SimpleNamespace(phase="Running", finished=None, progress=None)]
    assert lister.newest(RUN, "Running", running).step == 50  # not due: the 15 s refresh
    done = [SimpleNamespace(phase="Succeeded", finished=float(int(time.time())), progress=None)]
    assert lister.newest(RUN, "Running", done).step == 100  # listed at once, and waited for
    time.sleep(1.1)
    # that listing began within the second after the kubelet's whole-second finish time: once more
    assert lister.newest(RUN, "Running", done).step == 100 and len(calls) == 3
    for _ in range(3):
        assert lister.newest(RUN, "Running", done).step == 100
    assert len(calls) == 3  # and no more
