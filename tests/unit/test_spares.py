"""spares: warm standby pods kept beside the gang (table)."""

from __future__ import annotations

import pytest

from tests.unit.passes import NOW, deletes, events, make_pass, node, pod, spec_with
from trainium_api.agent import Report
from trainium_operator.observe import PodView
from trainium_operator.reasons import Reason
from trainium_operator.spares import keep_spares, ready_spare

NODES = {n: node(n) for n in ("n0", "n1", "n2")} | {"n3": node("n3", ready="Unknown")}


def spare(serial: int = 1, node_name: str = "n2", phase: str = "Running", ready: bool = True, **kw) -> PodView:
    return PodView(f"r-spare-{serial}", 0, -1, phase, node_name, kw.pop("deleting", False), spare=True, owner="u-1",
                   agent=Report(1, "ready") if ready else None, created=NOW - 100, scheduled=NOW - 100, **kw)


GANG = [pod(0), pod(1)]
CASES = [
    # name, phase, spares asked, gang, spares, status extra -> created, ready listed, deleted, events
    ("none yet: one is created", "Running", 1, GANG, [], {}, ["r-spare-1"], [], [], []),
    ("one ready: kept and listed", "Running", 1, GANG, [spare()], {"sparesCreated": 1}, [], ["r-spare-1"], [], []),
    ("one that ended: replaced", "Running", 1, GANG, [spare(phase="Failed")], {"sparesCreated": 1}, ["r-spare-2"],
     [], [("r-spare-1", 30)], [Reason.SPARE_REPLACED]),
    ("one on a lost node, going: forced", "Running", 1, GANG, [spare(node_name="n3", deleting=True)],
     {"sparesCreated": 1}, ["r-spare-2"], [], [("r-spare-1", 0)], []),
    ("the gang not placed: spares yield", "Starting", 1, [pod(0), pod(1, node_name="")], [spare()],
     {"sparesCreated": 1}, [], [], [("r-spare-1", 30)], []),
    ("none asked: it goes", "Running", 0, GANG, [spare()], {"sparesCreated": 1}, [], [],
     [("r-spare-1", 30)], []),
    ("suspended: none", "Suspended", 1, GANG, [spare()], {"sparesCreated": 1}, [], [], [("r-spare-1", 30)], []),
    ("one created and not seen yet: no other", "Running", 1, GANG, [], {"sparesCreated": 1,
                                                                        "sparesRequestedTime": NOW - 5},
     [], [], [], []),
]


@pytest.mark.parametrize("name,phase,asked,gang,spares,extra,created,listed,deleted,said", CASES,
                         ids=[c[0] for c in CASES])
def test_keep_spares(name, phase, asked, gang, spares, extra, created, listed, deleted, said):
    status = {"phase": phase, "attempt": 1, "spares": [s.name for s in spares if s.agent], **extra}
    p = make_pass(status, gang, NODES, spec=spec_with(inPlaceRestarts=2, spares=asked, teardownGraceSeconds=30),
                  spares=spares)
    assert keep_spares(p) == created
    assert (p.new.spares, deletes(p), events(p)) == (listed, deleted, said)


READY = [
    # name, spares -> the one taken
    ("the oldest ready one", [spare(2), spare(1)], "r-spare-1"),
    ("not one whose agent does not wait", [spare(1, ready=False)], None),
    ("not one on a lost node", [spare(1, node_name="n3")], None),
]


@pytest.mark.parametrize("name,spares,taken", READY, ids=[c[0] for c in READY])
def test_the_spare_that_takes_an_index(name, spares, taken):
    p = make_pass({"phase": "Running", "attempt": 1, "spares": [s.name for s in spares]}, GANG, NODES,
                  spec=spec_with(inPlaceRestarts=2, spares=2), spares=spares)
    found = ready_spare(p)
    assert (found.name if found else None) == taken


QUOTA = 'cannot create Pod r-spare-1: pods "r-spare-1" is forbidden: exceeded quota: trn, requested: aws.amazon.com/neuron=16'


def test_a_spare_the_api_server_refuses_backs_off_and_says_so_once():
    """A quota (or a webhook) refuses the spare: the gang trains on without it; the next spare
    waits 10 s, then 20, 40, ... up to 300 s, and the refusal is an event the first time only."""
    spec = spec_with(inPlaceRestarts=2, spares=1, teardownGraceSeconds=30)
    status = {"phase": "Running", "attempt": 1, "sparesCreated": 1, "sparesRequestedTime": NOW - 15}
    now, said, delays = NOW, [], []
    for refusal in range(1, 7):
        p = make_pass(status, GANG, NODES, now=now, spec=spec, children_error=QUOTA.replace("spare-1", f"spare-{refusal}"))
        assert keep_spares(p) == [], refusal  # counted, backing off
        said += events(p)
        assert p.new.spares_refused == refusal
        delays.append(p.new.spares_retry_time - now)
        status = {**status, "sparesRefused": p.new.spares_refused, "sparesRetryTime": p.new.spares_retry_time}
        # within the backoff: nothing, however often the pass runs
        p = make_pass(status, GANG, NODES, now=now + delays[-1] - 1, spec=spec, children_error=QUOTA)
        assert keep_spares(p) == [] and not events(p)
        # after it: the next spare is asked for
        now += delays[-1] + 1
        p = make_pass(status, GANG, NODES, now=now, spec=spec, children_error=QUOTA)
        assert keep_spares(p) == [f"r-spare-{refusal + 1}"]
        status = {**status, "sparesCreated": refusal + 1, "sparesRequestedTime": now}
        now += 15  # the create refused again: the next pass sees the applier's words
    assert said == [Reason.SPARES_REFUSED] and delays == [10.0, 20.0, 40.0, 80.0, 160.0, 300.0]
    # a spare that is created resets the count
    p = make_pass(status, GANG, NODES, now=now, spec=spec, spares=[spare(7)])
    keep_spares(p)
    assert p.new.spares_refused == 0 and p.new.spares_retry_time is None
