"""The applier (applier.apply): what a reconcile pass's effects become, and what the next pass
learns when the API server refuses some. The Kube client is a STAND-IN recording calls and
answering as configured (a webhook's 500, a quota's 403, a refused connection): the applier's
own decisions are the thing under test; the real API server's answers are exercised by
tests/cluster/test_operator.py (a ResourceQuota refusing the Service)."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import NewConnectionError

from tests.unit.test_operator_core import RUN, SPEC
from trainium_operator.applier import ChildCache, ChildError, NotLeading, apply
from trainium_operator.reconcile import reconcile_objects


class FakeKube:
    def __init__(self, refuse: dict[str, BaseException] | None = None):
        self.refuse, self.calls = refuse or {}, []

    def _maybe(self, kind: str, what: str):
        self.calls.append((kind, what))
        if kind in self.refuse:
            raise self.refuse[kind]

    def patch_status(self, ns, name, status, resource_version=None):
        self._maybe("status", resource_version)

    def ensure(self, obj):
        self._maybe(obj["kind"], obj["metadata"]["name"])

    def ensure_cluster_policy(self, obj):
        self._maybe(obj["kind"], obj["metadata"]["name"])

    def delete_pod(self, ns, name, grace=None):
        self._maybe("delete", name)

    def quarantine(self, node, run, reason, attempts=5, uid=""):
        self._maybe("quarantine", node)

    def event(self, run, reason, message, warning=False):
        self._maybe("event", reason)


def _first_pass():
    run = {**RUN, "metadata": {**RUN["metadata"], "resourceVersion": "41"}}
    return run, reconcile_objects(run, [], {}, now=1.0)


def _api(status: int, message: str) -> ApiException:
    """An error as the client raises it for the API server's Status answer."""
    exc = ApiException(status=status, reason="refused")
    exc.body = json.dumps({"kind": "Status", "message": message})
    return exc


def test_the_status_write_carries_the_version_it_was_computed_from_then_children_then_pods():
    run, result = _first_pass()
    kube = FakeKube()
    apply(kube, run, result, ChildCache())
    kinds = [k for k, _ in kube.calls]
    assert kube.calls[0] == ("status", "41")
    assert kinds.index("Service") < kinds.index("Pod") and kinds.count("Pod") == SPEC["nodes"]


@pytest.mark.parametrize("refusal", [_api(500, 'Internal error occurred: failed calling webhook "x"'),
                                     _api(403, 'services "r" is forbidden: exceeded quota: no-services')])
def test_a_refused_child_means_no_pod_and_its_words_reach_the_next_pass(refusal):
    run, result = _first_pass()
    kube, children = FakeKube({"Service": refusal}), ChildCache()
    with pytest.raises(ChildError):
        apply(kube, run, result, children)
    assert "Pod" not in [k for k, _ in kube.calls] and "ConfigMap" in [k for k, _ in kube.calls]
    error = children.error("ns", "r")
    assert error.startswith("cannot create Service r: ") and ("webhook" in error or "quota" in error)
    assert "event" in [k for k, _ in kube.calls]  # the rest of the pass was applied
    nxt = reconcile_objects({**run, "status": result.status}, [], {}, now=2.0, children_error=error)
    assert next(c for c in nxt.after.conditions if c.type == "ChildrenCreated").status == "False"
    kube.refuse.clear()
    apply(kube, run, nxt, children)  # the Service is created by the next pass, then nothing is due
    assert children.error("ns", "r") == "" and ("Service", "r") in kube.calls[-12:]


def test_a_refused_pod_is_shown_too():
    run, result = _first_pass()
    children = ChildCache()
    with pytest.raises(ChildError):
        apply(FakeKube({"Pod": _api(403, 'pods "r-a1-0" is forbidden: violates PodSecurity "restricted"')}),
              run, result, children)
    error = children.error("ns", "r")
    assert error.startswith("cannot create Pod r-a1-0: ") and "PodSecurity" in error and "(and 3 more pods)" in error


def test_no_answer_at_all_is_the_api_servers_outage_not_the_runs():
    run, result = _first_pass()
    children = ChildCache()
    with pytest.raises(NewConnectionError):
        apply(FakeKube({"Service": NewConnectionError(None, "refused")}), run, result, children)
    assert children.error("ns", "r") == ""


def test_a_replica_that_stopped_leading_writes_nothing_more():
    run, result = _first_pass()
    kube, answers = FakeKube(), iter([False])
    with pytest.raises(NotLeading):
        apply(kube, run, result, ChildCache(), may_write=lambda: next(answers, False))
    assert [k for k, _ in kube.calls] == ["status"]  # the lease lapsed during the status write



def test_a_pod_call_waiting_in_the_pool_asks_the_lease_again():
    """Pod calls wait their turn in a pool every run shares: one that runs after the lease
    lapsed is not sent, and the pass ends NotLeading (not a refused pod in the status)."""
    run, result = _first_pass()
    kube, answers = FakeKube(), iter([True, True])  # after the status, after the children
    with pytest.raises(NotLeading):
        apply(kube, run, result, ChildCache(), may_write=lambda: next(answers, False))
    assert not [k for k, _ in kube.calls if k == "Pod"]


def test_children_are_asked_for_at_most_every_recheck_interval_and_shared_ones_once():
    run, result = _first_pass()
    kube, children = FakeKube(), ChildCache()
    apply(kube, run, result, children)
    other = {**run, "metadata": {**run["metadata"], "name": "s", "uid": "u-2"}}
    kube.calls.clear()
    apply(kube, other, reconcile_objects(other, [], {}, now=1.0), children)
    asked = {k for k, _ in kube.calls} - {"status", "Pod", "event"}
    # each run's own children, its trainer identity included; the cluster's policy once for both runs
    assert asked == {"Service", "ConfigMap", "ServiceAccount", "RoleBinding", "Role", "PodDisruptionBudget"}
    # a new attempt's trainer Role (it names other pods) is due at once; the same one is not
    role = next(e.obj for e in result.effects if e.kind == "ensure" and e.obj["kind"] == "Role")
    newer = {**role, "rules": [{**role["rules"][0], "resourceNames": ["r-a2-0"]}]}
    target = {**role, "metadata": {**role["metadata"], "namespace": "ns"}}
    assert not children.due(("ns", "r"), target)
    assert children.due(("ns", "r"), {**newer, "metadata": target["metadata"]})


def test_a_pass_creating_no_pod_rechecks_children_in_the_background():
    """Periodic re-checks of a running run's children do not hold its pass; what they find
    (a Service someone's quota now refuses) is in the cache for the next pass's status."""
    import threading
    from dataclasses import replace

    from trainium_operator.effects import Ensure
    run, first = _first_pass()
    children = ChildCache()
    gate = threading.Event()

    class SlowKube(FakeKube):
        def ensure(self, obj):
            gate.wait(10)  # an API server that takes its time
            super().ensure(obj)
    kube = SlowKube({"Service": _api(403, "exceeded quota: services")})
    steady = replace(first, effects=[e for e in first.effects if not (isinstance(e, Ensure) and e.obj["kind"] == "Pod")])
    apply(kube, run, steady, children)  # returns at once: no pod waits for the children
    assert not [k for k, _ in kube.calls if k == "Service"] and children.error("ns", "r") == ""
    apply(kube, run, steady, children)  # one re-check per run at a time
    gate.set()
    for _ in range(100):
        if children.error("ns", "r"):
            break
        threading.Event().wait(0.05)
    assert "exceeded quota: services" in children.error("ns", "r")
    assert [k for k, _ in kube.calls].count("Service") == 1


def test_the_refusal_clock_restarts_when_a_quota_refusal_turns_into_a_policys_denial():
    """judge fails a run whose pods an admission policy denied for 20 s in a row: a quota's
    refusal before it must not count toward those 20 s (found by the SRE review)."""
    import time as _time
    c, r = ChildCache(), ("ns", "r")
    c.set_error(r, 'cannot create Pod r-a1-0: pods "r-a1-0" is forbidden: exceeded quota: q')
    quota_since = c.error_since(*r)
    _time.sleep(0.01)
    c.set_error(r, 'cannot create Pod r-a1-0: admission webhook "w" denied the request: no')
    denied_since = c.error_since(*r)
    assert denied_since > quota_since
    c.set_error(r, 'cannot create Pod r-a1-1: admission webhook "w" denied the request: no')
    assert c.error_since(*r) == denied_since  # the same denial, again: the clock runs on
    c.set_error(r, "")
    assert c.error_since(*r) is None
