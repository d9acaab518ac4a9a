"""The operator's checkpoint listing runs off the reconcile pass (handlers.CheckpointLister): a
slow or hung store never holds a pass, failures keep the last answer, a listing that does not
answer is given up. The store is a STAND-IN function (the lister's own logic is the thing under
test; listing a real store is tested in tests/unit/test_ckpt_store.py and the s3 tier)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from trainium_operator.handlers import CheckpointLister

RUN = {"metadata": {"namespace": "ns", "name": "r"}, "spec": {"checkpoint": {"uri": "s3://b/r"}}}


def _tag(step):
    return SimpleNamespace(tag=f"step_{step}", step=step, done_mtime=1.0, uri=f"s3://b/r/step_{step}")


def test_a_hung_store_never_holds_a_pass_and_is_given_up():
    release, calls = threading.Event(), []

    def hung(uri, layout):
        calls.append(uri)
        release.wait(10)
        return _tag(5)
    lister = CheckpointLister(hung)
    lister.LIST_TIMEOUT_SECONDS = 0.3
    t0 = time.monotonic()
    assert lister.newest(RUN, "Running", []) is None  # the answer so far, at once
    assert lister.newest(RUN, "Running", []) is None and len(calls) == 1  # one listing at a time
    assert time.monotonic() - t0 < 0.2
    time.sleep(0.4)
    lister.newest(RUN, "Running", [SimpleNamespace(progress={"lastCheckpointStep": 9})])  # due: a newer step
    time.sleep(0.1)
    assert len(calls) == 2  # the hung one was given up and another started
    release.set()
    time.sleep(0.2)
    assert lister.newest(RUN, "Running", []).step == 5


def test_a_failing_store_keeps_the_last_answer():
    answers = [_tag(10), RuntimeError("503 Slow Down")]

    def flaky(uri, layout):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer
    lister = CheckpointLister(flaky)
    assert lister.newest(RUN, "Restarting", []).step == 10  # a starting gang waits briefly for it
    lister.newest(RUN, "Restarting", [SimpleNamespace(progress={"lastCheckpointStep": 20})])
    time.sleep(0.1)
    assert lister.newest(RUN, "Running", []).step == 10 and not answers
    assert lister.newest({**RUN, "spec": {}}, "Running", []) is None  # no store: nothing to list
