"""One order per gang (trainium_api.gangorder): the protocol, which pods an order addresses, and
the operator's passes writing it once per step of an in-place restart, whatever the gang's size,
with orders on the pods only for agents that do not read it."""

from __future__ import annotations

import json

from trainium_api import agent, gangorder
from trainium_api.gangorder import GangOrder
from trainium_operator import plan
from trainium_operator.observe import gang_order_view
from trainium_operator.reconcile import reconcile_objects

from tests.unit.passes import SPEC
from tests.unit.test_in_place import NODES, events, node, pod, run_with, spare, step_report

STOP = agent.Order(2, start=False, grace_seconds=30.0)


def gang_reads(attempt: int, state: str = "running", **kw) -> dict:
    """An agent's report that says it reads the gang order."""
    return {"attempt": attempt, "state": state, "gangOrders": True, **kw}


def seen(run: dict, effect) -> object:
    """The gang order object as the operator's index would hold it once ``effect`` landed."""
    return gang_order_view(plan.gang_order_map(run, effect.order))


def test_a_gang_order_addresses_exactly_the_gangs_pods():
    names = ["r-a1-0", "r-spare-2", "r-a1-2", "r-a3-3"]
    gang = GangOrder.of(agent.Order(3, start=True, master="r-s2.r.ns.svc"), "r", 1, names)
    assert gang.pods == ((1, "r-spare-2"), (3, "r-a3-3")) and gang.names("r") == names
    for i, name in enumerate(names):
        assert gang.for_pod("r", name) == agent.Order(3, start=True, index=i, master="r-s2.r.ns.svc")
    # not addressed: a pod replaced at its index, a spare without an index, another gang's pod, an
    # index beyond the gang, another run whose name starts alike, a name with a leading zero
    for other in ("r-a1-1", "r-a1-3", "r-spare-1", "r-a2-0", "r-a1-4", "r-x-a1-0", "rr-a1-0", "r-a1-00", "r-a01-0"):
        assert gang.for_pod("r", other) is None, other
    # the payload round-trips, and stays small for a large gang (only replaced indexes are listed)
    assert gangorder.parse(gangorder.payload(gang)) == gang
    big = GangOrder.of(STOP, "r", 1, [plan.pod_name("r", 1, i) for i in range(4096)])
    assert len(gangorder.payload(big)) < 200


def test_a_malformed_gang_order_is_no_order():
    good = json.loads(gangorder.payload(GangOrder.of(STOP, "r", 1, ["r-a1-0", "r-a2-1"])))
    for bad in ({**good, "gangAttempt": 0}, {**good, "gangAttempt": True}, {**good, "nodes": 0},
                {**good, "nodes": "2"}, {**good, "pods": []}, {**good, "pods": {"2": "x"}},
                {**good, "pods": {"01": "x"}}, {**good, "pods": {"0": "x", "1": "x"}}, {**good, "pods": {"0": ""}},
                {**good, "attempt": -1}, {**good, "start": "yes"}, [good]):
        assert gangorder.parse(json.dumps(bad)) is None, bad
    for junk in (None, "", "{", "null", "x" * (gangorder.MAX_LENGTH + 1), 7):
        assert gangorder.parse(junk) is None
    assert gangorder.parse(json.dumps(good)) is not None
    # a report without the capability is an agent ordered on its pod; a forged one only loses its orders
    assert agent.parse_report(json.dumps({"attempt": 1, "state": "ready"})).gang_orders is False
    assert agent.parse_report(json.dumps(gang_reads(1, "ready"))).gang_orders is True
    assert agent.parse_report(json.dumps({**gang_reads(1, "ready"), "gangOrders": "yes"})).gang_orders is False


def test_an_in_place_restart_is_two_writes_for_agents_that_read_the_gang_order():
    run = run_with({})
    r = reconcile_objects(run, [], NODES, now=0.0)
    status = {**r.status, "conditions": [{"type": "Valid", "status": "True"}]}
    pods = [pod(i, report=gang_reads(1), progress=step_report(12, 1)) for i in range(2)]
    status.update(reconcile_objects(run_with(status), pods, NODES, now=5.0).status)

    crashed = gang_reads(1, "exited", exitCode=1, message="", time=55.0)
    r = reconcile_objects(run_with(status), [pod(0, report=crashed), pod(1, report=gang_reads(1))], NODES, now=60.0)
    status.update(r.status)
    assert status["phase"] == "Restarting" and status["failures"][-1]["restart"] == "inPlace"
    (stop,) = [e for e in r.effects if e.kind == "order_gang"]
    assert not [e for e in r.effects if e.kind == "order_pod"]
    assert stop.order == GangOrder(STOP, 1, 2, run_uid="u-1") and [stop.order.for_pod("r", f"r-a1-{i}").index for i in (0, 1)] == [0, 1]
    # not written again once seen; written again while it is not (a lost write, a deleted object)
    r = reconcile_objects(run_with(status), [pod(0, report=gang_reads(2, "ready")), pod(1, report=gang_reads(1))],
                          NODES, now=61.0, gang_order=seen(run, stop))
    assert not [e for e in r.effects if e.kind in ("order_gang", "order_pod")]
    r = reconcile_objects(run_with(status), [pod(0, report=gang_reads(2, "ready")), pod(1, report=gang_reads(1))],
                          NODES, now=61.0)
    assert [e.order for e in r.effects if e.kind == "order_gang"] == [stop.order]
    # an earlier run's object of the same name is not this run's order
    other = {**run, "metadata": {**run["metadata"], "uid": "u-0"}}
    r = reconcile_objects(run_with(status), [pod(0, report=gang_reads(2, "ready")), pod(1, report=gang_reads(1))],
                          NODES, now=61.0, gang_order=seen(other, stop))
    assert [e.order for e in r.effects if e.kind == "order_gang"] == [stop.order]

    # the barrier: one start for the whole gang, with the rendezvous address
    ready = [pod(i, report=gang_reads(2, "ready"), progress=step_report(14, 1)) for i in range(2)]
    r = reconcile_objects(run_with(status), ready, NODES, now=62.0, gang_order=seen(run, stop))
    status.update(r.status)
    assert status["attempt"] == 2 and status["phase"] == "Starting"
    (start,) = [e for e in r.effects if e.kind == "order_gang"]
    assert not [e for e in r.effects if e.kind == "order_pod"]
    assert start.order.for_pod("r", "r-a1-1") == agent.Order(2, start=True, grace_seconds=30.0, index=1,
                                                             master="r-0.r.ns.svc")
    # a pass that read the status from before the start, but sees the start: decides nothing
    stale = {**status, "attempt": 1, "phase": "Restarting", "current": {"restart": "inPlace"}}
    r = reconcile_objects(run_with(stale), ready, NODES, now=63.0, gang_order=seen(run, start))
    assert r.status == {} and r.effects == []
    # an order that did not land is written again; once seen, nothing
    running = [pod(i, report=gang_reads(2)) for i in range(2)]
    assert [e.order for e in reconcile_objects(run_with(status), ready, NODES, now=63.0).effects
            if e.kind == "order_gang"] == [start.order]
    r = reconcile_objects(run_with(status), running, NODES, now=64.0, gang_order=seen(run, start))
    assert not [e for e in r.effects if e.kind in ("order_gang", "order_pod")]
    assert r.status["current"]["gangRunningTime"] == 64.0


def test_an_agent_that_does_not_read_the_gang_order_is_ordered_on_its_pod():
    """A gang of a newer and an older trainer image (an upgrade mid-run): the gang order for
    all, and the older agent's order on its pod, until it carries it."""
    run = run_with({})
    status = {**reconcile_objects(run, [], NODES, now=0.0).status, "conditions": [{"type": "Valid", "status": "True"}]}
    pods = [pod(0, report=gang_reads(1)), pod(1, report={"attempt": 1, "state": "running"})]
    status.update(reconcile_objects(run_with(status), pods, NODES, now=5.0).status)
    crashed = gang_reads(1, "exited", exitCode=1, message="", time=55.0)
    r = reconcile_objects(run_with(status), [pod(0, report=crashed), pods[1]], NODES, now=60.0)
    assert [e.kind for e in r.effects if e.kind.startswith("order")] == ["order_gang", "order_pod"]
    assert [(e.name, e.order) for e in r.effects if e.kind == "order_pod"] == [("r-a1-1", STOP)]


def test_a_replacement_and_a_spare_are_named_in_the_gang_order():
    # a lost node: its index goes to the new pod, the failed pod is not addressed
    run = run_with({})
    status = {**reconcile_objects(run, [], NODES, now=0.0).status, "conditions": [{"type": "Valid", "status": "True"}]}
    status.update(reconcile_objects(run_with(status), [pod(i, report=gang_reads(1)) for i in range(2)], NODES,
                                    now=5.0).status)
    nodes = {"n0": node("n0"), "n1": node("n1", "False"), "n2": node("n2")}
    r = reconcile_objects(run_with(status), [pod(i, report=gang_reads(1)) for i in range(2)], nodes, now=60.0)
    (stop,) = [e.order for e in r.effects if e.kind == "order_gang"]
    assert stop.names("r") == ["r-a1-0", "r-a2-1"] and stop.for_pod("r", "r-a1-1") is None

    # a spare that reads the gang order takes the index: labelled, nothing written on it but that
    spec = {**SPEC, "faultTolerance": {"spares": 1}}
    nodes = {n: node(n) for n in ("n0", "n1", "n2")}
    status = {**reconcile_objects(run_with({}, spec), [], nodes, now=0.0).status,
              "conditions": [{"type": "Valid", "status": "True"}]}
    gang = [pod(i, report=gang_reads(1)) for i in range(2)]
    waiting = spare(1, "n2", report=gang_reads(1, "ready"))
    status.update(reconcile_objects(run_with(status, spec), gang, nodes, now=5.0).status)
    status.update(reconcile_objects(run_with(status, spec), gang + [waiting], nodes, now=6.0).status)
    assert status["spares"] == ["r-spare-1"]
    nodes["n0"] = node("n0", "False")
    r = reconcile_objects(run_with(status, spec), gang + [waiting], nodes, now=10.0)
    assert "by spare r-spare-1" in events(r, "Restarting")[0]
    (taken,) = [e for e in r.effects if e.kind == "order_pod"]
    assert taken.name == "r-spare-1" and taken.order is None and dict(taken.labels)["trainium.dev/index"] == "0"
    (stop,) = [e.order for e in r.effects if e.kind == "order_gang"]
    assert stop.for_pod("r", "r-spare-1") == agent.Order(2, grace_seconds=30.0, index=0)
    assert stop.for_pod("r", "r-a1-0") is None and stop.for_pod("r", "r-a1-1").index == 1


def test_writes_per_in_place_restart_do_not_grow_with_the_gang():
    """1,024 pods: the stop and the start are one write each (2 in all), against 2,048 orders
    written on the pods of agents that do not read the gang order."""
    n = 1024
    spec = {**SPEC, "nodes": n, "training": {**SPEC["training"], "globalBatchSize": 2 * n}}
    nodes = {f"n{i}": node(f"n{i}") for i in range(n)}
    for reads in (True, False):
        report = gang_reads if reads else (lambda a, s="running", **kw: {"attempt": a, "state": s, **kw})
        status = {**reconcile_objects(run_with({}, spec), [], nodes, now=0.0).status,
                  "conditions": [{"type": "Valid", "status": "True"}]}
        status.update(reconcile_objects(run_with(status, spec), [pod(i, report=report(1), progress=step_report(12, 1))
                                                                 for i in range(n)], nodes, now=5.0).status)
        assert status["phase"] == "Running", status.get("message")
        crashed = [pod(0, report=report(1, "exited", exitCode=1, message="", time=55.0))]
        r = reconcile_objects(run_with(status, spec), crashed + [pod(i, report=report(1)) for i in range(1, n)], nodes,
                              now=60.0)
        status.update(r.status)
        writes = [e for e in r.effects if e.kind in ("order_gang", "order_pod")]
        r = reconcile_objects(run_with(status, spec), [pod(i, report=report(2, "ready")) for i in range(n)], nodes,
                              now=61.0, gang_order=seen(run_with(status, spec), writes[0]))
        assert r.status["attempt"] == 2
        writes += [e for e in r.effects if e.kind in ("order_gang", "order_pod")]
        assert len([e for e in writes if e.kind == "order_pod"]) == (0 if reads else 2 * n)
        assert len([e for e in writes if e.kind == "order_gang"]) == 2


def test_the_agent_follows_its_own_runs_gang_order_and_the_newest_of_its_two_sources():
    """trainer.pod.agent.Orders, fed what its watches would see: the gang order counts once the
    pod's run is known (its controller), and only its own run's; an order on the pod (from an
    operator that writes them) and the gang order: the newer wins, an older never undoes it."""
    from types import SimpleNamespace as NS
    from trainer.pod.agent import Orders

    def cm(gang: GangOrder, owner: str | None = "u-1", labelled: bool = True) -> NS:
        return NS(data={gangorder.DATA_KEY: gangorder.payload(gang)},
                  metadata=NS(labels={"trainium.dev/gang-order": "true"} if labelled else {},
                              owner_references=[NS(uid=owner, controller=True)] if owner else []))

    def pod_obj(order: agent.Order | None = None, uid: str = "u-1") -> NS:
        ann = {"trainium.dev/order": agent.order_payload(order)} if order else {}
        return NS(metadata=NS(annotations=ann, owner_references=[NS(uid=uid, controller=True)]))

    names = ["r-a1-0", "r-a1-1"]
    orders = Orders(None, "r-a1-1", "ns", "r")  # (not started: no API server here)
    orders._seen_gang(cm(GangOrder.of(STOP, "r", 1, names, "u-1")))
    assert orders.latest is None  # the pod's run not known yet
    orders._seen(pod_obj())
    assert orders.latest == agent.Order(2, grace_seconds=30.0, index=1)
    # another run of the same name (created again): its order is not this pod's
    orders._seen_gang(cm(GangOrder.of(agent.Order(5, start=True), "r", 1, names, "u-0")))
    assert orders.latest.attempt == 2
    # an object of that name someone else made (no label: no trainer may write one; another
    # controller, or none) is not an order, whatever uid its data names
    forged = GangOrder.of(agent.Order(7, start=True), "r", 1, names, "u-1")
    for other in (cm(forged, labelled=False), cm(forged, owner="u-x"), cm(forged, owner=None)):
        orders._seen_gang(other)
        assert orders.latest.attempt == 2
    # an older order on the pod does not undo the gang's; a newer one wins
    orders._seen(pod_obj(agent.Order(1, start=True)))
    assert orders.latest.attempt == 2
    orders._seen_gang(cm(GangOrder.of(agent.Order(2, start=True, master="r-0.r.ns.svc"), "r", 1, names, "u-1")))
    assert orders.latest == agent.Order(2, start=True, index=1, master="r-0.r.ns.svc")
    # a spare without an index is not addressed
    spare_orders = Orders(None, "r-spare-1", "ns", "r")
    spare_orders._seen(pod_obj())
    spare_orders._seen_gang(cm(GangOrder.of(agent.Order(2, start=True), "r", 1, names, "u-1")))
    assert spare_orders.latest is None


def test_a_pass_on_a_stale_status_never_takes_the_gang_order_back_and_a_late_one_goes_on_the_pods():
    from trainium_operator import inplace
    names = ["r-a1-0", "r-a1-1"]
    pods = [pod(i, report=gang_reads(2, "ready")) for i in range(2)]
    started = GangOrder.of(agent.Order(2, start=True), "r", 1, names, "u-1")
    # the index shows the start of attempt 2: a stop of attempt 2 computed from an older status is not written
    assert inplace.orders("r", 1, names, pods, STOP, started, "u-1") == []
    # (another run's object of the same name does not hold it back)
    assert [e.kind for e in inplace.orders("r", 1, names, pods, STOP, GangOrder.of(
        agent.Order(2, start=True), "r", 1, names, "u-0"), "u-1")] == ["order_gang"]
    # not shown GANG_ORDER_GRACE_SECONDS after it was first given (an object not the run's, writes
    # refused): every pod is ordered on its pod too, until it carries the order
    late = inplace.orders("r", 1, names, pods, STOP, None, "u-1", late=True)
    assert [e.kind for e in late] == ["order_gang", "order_pod", "order_pod"]
    carried = [pod(i, report=gang_reads(2, "ready"), order={"attempt": 2, "start": False}) for i in range(2)]
    assert [e.kind for e in inplace.orders("r", 1, names, carried, STOP, None, "u-1", late=True)] == ["order_gang"]
    # shown: nothing, late or not
    assert inplace.orders("r", 1, names, pods, STOP, GangOrder.of(STOP, "r", 1, names, "u-1"), "u-1", late=True) == []
