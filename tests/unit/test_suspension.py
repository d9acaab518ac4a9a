"""suspension: spec.suspend stops the gang, clearing it starts a new attempt (tables)."""

from __future__ import annotations

import pytest

from tests.unit.passes import NOW, deletes, events, make_pass, pod, spec_with
from trainium_operator.reasons import Reason
from trainium_operator.suspension import resume, suspend

SUSPENDED = {"phase": "Suspended", "attempt": 1, "suspension": {"since": NOW - 100}, "createdTime": NOW - 500,
             "firstProgressTime": NOW - 400}
SUSPEND = [
    # name, status as read, pods -> deleted (name, grace), events, suspended since
    ("a running gang is stopped gracefully, the clock stops", {"phase": "Running", "attempt": 1},
     [pod(0), pod(1)], [("r-a1-0", 30), ("r-a1-1", 30)], [Reason.SUSPENDED], NOW),
    ("pods past their grace are forced", SUSPENDED,
     [pod(0, deleting=True, gone_by=NOW - 1), pod(1, deleting=True, gone_by=NOW + 1)], [("r-a1-0", 0)], [],
     NOW - 100),
    ("a run created suspended has no clock yet", {"phase": "", "attempt": 0}, [], [], [Reason.SUSPENDED], None),
]


@pytest.mark.parametrize("name,status,pods,deleted,said,since", SUSPEND, ids=[c[0] for c in SUSPEND])
def test_suspend(name, status, pods, deleted, said, since):
    p = make_pass(status, pods, spec=spec_with(teardownGraceSeconds=30))
    suspend(p)
    assert (p.new.phase, deletes(p), events(p)) == ("Suspended", deleted, said)
    assert (p.new.suspension.since if p.new.suspension else None) == since


def test_a_restart_the_suspension_interrupts_ends_there():
    p = make_pass({"phase": "Restarting", "attempt": 1, "failures": [{"id": 1, "time": NOW - 50, "cause": "hang",
                                                                     "action": "restart", "attempt": 1}]})
    suspend(p)
    last = p.new.failures[-1]
    assert (last.teardown_done_time, last.resumed_time, last.resumed_steps) == (NOW, NOW, 0)


RESUME = [
    # name, status as read, pods -> attempt, events, deleted, created time
    ("the suspended gang still there is stopped first", SUSPENDED, [pod(0, deleting=True, gone_by=NOW - 1)], 1, [],
     [("r-a1-0", 0)], NOW - 500),
    ("gone: a new attempt, the time suspended counted", SUSPENDED, [], 2, [Reason.RESUMED], [], NOW - 500),
    ("suspended before it trained: its clock starts later", {**SUSPENDED, "firstProgressTime": None}, [], 2,
     [Reason.RESUMED], [], NOW - 400),
    ("a run created suspended starts its first attempt", {"phase": "Suspended", "attempt": 0}, [], 1,
     [Reason.STARTING], [], NOW),
]


@pytest.mark.parametrize("name,status,pods,attempt,said,deleted,created", RESUME, ids=[c[0] for c in RESUME])
def test_resume(name, status, pods, attempt, said, deleted, created):
    p = make_pass(status, pods)
    resume(p)
    assert (p.new.attempt, events(p), deletes(p), p.new.created_time) == (attempt, said, deleted, created)
    if said == [Reason.RESUMED] and status.get("firstProgressTime"):
        assert (p.new.suspension.seconds, p.new.suspension.resumed_time) == (100.0, NOW)
