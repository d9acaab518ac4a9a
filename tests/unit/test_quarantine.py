"""quarantine: the nodes a run leaves out and its memory of machines (tables)."""

from __future__ import annotations

import pytest

from tests.unit.passes import NOW, events, make_pass, node, pod, spec_with, taints
from trainium_api import keys
from trainium_api.runtimefaults import Finding
from trainium_operator.quarantine import (QUARANTINE_REMEMBER_SECONDS, QUARANTINE_RETRY_SECONDS,
                                          QUARANTINE_SETTLE_SECONDS, excluded, kept_off, late_culprits, quarantine,
                                          still_avoided, still_quarantined)
from trainium_operator.reasons import Reason

T = keys.QUARANTINE_TAINT


def machine(since: float = NOW - 10, uid: str = "uid-n1", provider: str = "aws:///z/i-1", **kw) -> dict:
    return {"node": "n1", "uid": uid, "providerId": provider, "since": since, **kw}


STILL = [
    # name, pending, machine, the node now (None: no Node object) -> kept, pending, taint ordered, events
    ("seen tainted: stays, no longer pending", True, machine(), node("n1", taints=(T,)), ["n1"], [], [], []),
    ("not tainted yet: ordered again", True, machine(), node("n1"), ["n1"], ["n1"], ["n1"], []),
    ("past the retry time: only the affinity keeps it out", True, machine(NOW - QUARANTINE_RETRY_SECONDS),
     node("n1"), ["n1"], ["n1"], [], []),
    ("an admin removed the taint: returned", False, machine(), node("n1"), [], [], [], []),
    ("pending and unseen past the settle time: gone", True, machine(NOW - QUARANTINE_SETTLE_SECONDS), None,
     [], [], [], []),
    ("pending and unseen within it: kept", True, machine(NOW - 5), None, ["n1"], ["n1"], ["n1"], []),
    ("registered again, the same machine: quarantined again", False, machine(uid="old"),
     node("n1", uid="new", provider_id="aws:///z/i-1"), ["n1"], ["n1"], ["n1"], [Reason.NODE_QUARANTINED]),
    ("registered again, another machine: ended", False, machine(uid="old"),
     node("n1", uid="new", provider_id="aws:///z/i-2"), [], [], [], [Reason.QUARANTINE_ENDED]),
    ("registered again, no providerID known: ended", False, machine(uid="old", provider=""),
     node("n1", uid="new", provider_id="aws:///z/i-1"), [], [], [], [Reason.QUARANTINE_ENDED]),
]


@pytest.mark.parametrize("name,pending,machine_,now_node,kept,still_pending,ordered,said", STILL,
                         ids=[c[0] for c in STILL])
def test_still_quarantined(name, pending, machine_, now_node, kept, still_pending, ordered, said):
    p = make_pass({"quarantinedNodes": ["n1"], "quarantinePending": ["n1"] if pending else [],
                   "quarantinedMachines": [machine_]},
                  node_views={"n0": node("n0"), **({"n1": now_node} if now_node else {})})
    still_quarantined(p)
    assert (p.new.quarantined_nodes, p.new.quarantine_pending, taints(p), events(p)) == \
        (kept, still_pending, ordered, said)


REMEMBERED = [
    # name, gone for, the node now, nodes left out already, limit -> quarantined again, events
    ("remembered while gone", 10, None, [], 2, [], []),
    ("the same machine back: quarantined again", 10, node("n1", uid="new", provider_id="aws:///z/i-1"), [], 2,
     ["n1"], [Reason.NODE_QUARANTINED]),
    ("...unless that passes the node limit", 10, node("n1", uid="new", provider_id="aws:///z/i-1"), ["a", "b"], 2,
     [], [Reason.NODE_QUARANTINE_SKIPPED]),
    ("forgotten after a day", QUARANTINE_REMEMBER_SECONDS + 1, node("n1", uid="new", provider_id="aws:///z/i-1"), [],
     2, [], []),
]


@pytest.mark.parametrize("name,gone_for,now_node,out,limit,again,said", REMEMBERED, ids=[c[0] for c in REMEMBERED])
def test_a_machine_whose_node_went_is_remembered(name, gone_for, now_node, out, limit, again, said):
    p = make_pass({"quarantinedNodes": out, "quarantinePending": [],
                   "quarantinedMachines": [machine(goneTime=NOW - gone_for)]},
                  node_views={x: node(x, taints=(T,)) for x in out} | ({"n1": now_node} if now_node else {}),
                  spec=spec_with(maxQuarantinedNodes=limit))
    still_quarantined(p)
    assert [n for n in p.new.quarantined_nodes if n not in out] == again
    assert events(p) == said


AVOIDED = [
    # name, avoided since -> still avoided
    ("within the window", NOW - 3599, True),
    ("the window over: tried again", NOW - 3600, False),
]


@pytest.mark.parametrize("name,since,kept", AVOIDED, ids=[c[0] for c in AVOIDED])
def test_an_avoided_node_is_tried_again_after_the_window(name, since, kept):
    p = make_pass({"avoidedNodes": [{"node": "n1", "time": since, "reason": "x"}]},
                  spec=spec_with(budgetWindowMinutes=60))
    still_avoided(p)
    assert [a.node for a in p.new.avoided_nodes] == (["n1"] if kept else [])


def test_left_out_and_kept_off():
    p = make_pass({"quarantinedNodes": ["a"], "avoidedNodes": [{"node": "a", "time": NOW}, {"node": "b", "time": NOW}],
                   "quarantinedMachines": [{"node": "c", "providerId": "x", "goneTime": NOW}]})
    assert excluded(p.new) == ["a", "b"]  # a node both quarantined and avoided counts once
    assert kept_off(p.new) == ["a", "b", "c"]  # and a remembered machine's name is kept off too


FAULT = "Neuron runtime: NRT_EXEC_HW_ERR device fault on nd0"
LATE = [
    # name, quarantine on, nodes left out, limit -> avoided, events
    ("a late culprit is avoided", True, [], 2, ["n1"], [Reason.NODE_AVOIDED]),
    ("...within the node limit", True, ["a", "b"], 2, [], [Reason.LATE_CULPRIT_KEPT]),
    ("not with quarantine off", False, [], 2, [], []),
]


@pytest.mark.parametrize("name,on,out,limit,avoided,said", LATE, ids=[c[0] for c in LATE])
def test_a_culprit_named_in_teardown_is_left_out_within_the_limit(name, on, out, limit, avoided, said):
    fault = Finding("device", "NRT_EXEC_HW_ERR_NC_UE", 0, FAULT)
    p = make_pass({"attempt": 1, "phase": "Restarting", "quarantinedNodes": out},
                  [pod(0), pod(1, phase="Failed", runtime_fault=fault, message=FAULT)],
                  spec=spec_with(quarantine=on, maxQuarantinedNodes=limit))
    late_culprits(p)
    assert ([a.node for a in p.new.avoided_nodes], events(p)) == (avoided, said)


QUARANTINE = [
    # name, the node's object there -> tainted, events
    ("tainted on its Node object", True, ["n1"], [Reason.NODE_QUARANTINED]),
    ("its Node object gone: nothing to taint", False, [], [Reason.NODE_GONE]),
]


@pytest.mark.parametrize("name,there,tainted,said", QUARANTINE, ids=[c[0] for c in QUARANTINE])
def test_quarantine_for_a_failure(name, there, tainted, said):
    p = make_pass(node_views={"n1": node("n1", provider_id="aws:///z/i-1")} if there else {})
    quarantine(p, "n1", "bad")
    assert (taints(p), events(p), p.new.quarantined_nodes) == (tainted, said, tainted)
    assert [m.provider_id for m in p.new.quarantined_machines] == (["aws:///z/i-1"] if there else [])
