"""Leader election decisions (operator/trainium_operator/leader.py) against an in-memory Lease
API: a STAND-IN for coordination.k8s.io that keeps one object and its resourceVersion (the
real API server is used by tests/cluster/test_operator_ha.py). Expiry is judged on the
candidate's own clock, so a skewed clock cannot take a live leader's lease."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

from kubernetes.client.exceptions import ApiException

from trainium_operator.leader import Elector, LeaderConfig


class LeaseStore:
    def __init__(self):
        self.obj, self.version = None, 0

    def _view(self):
        spec = self.obj["spec"]
        parse = lambda v: datetime.fromisoformat(v) if isinstance(v, str) else v  # noqa: E731
        return SimpleNamespace(metadata=SimpleNamespace(resource_version=str(self.version)), spec=SimpleNamespace(
            holder_identity=spec["holderIdentity"], lease_duration_seconds=spec["leaseDurationSeconds"],
            acquire_time=parse(spec["acquireTime"]), renew_time=parse(spec["renewTime"]),
            lease_transitions=spec["leaseTransitions"]))

    def read_namespaced_lease(self, name, namespace, **_):
        if self.obj is None:
            raise ApiException(status=404)
        return self._view()

    def create_namespaced_lease(self, namespace, body, **_):
        if self.obj is not None:
            raise ApiException(status=409)
        self.obj, self.version = body, self.version + 1

    def replace_namespaced_lease(self, name, namespace, body, **_):
        if body["metadata"].get("resourceVersion") != str(self.version):
            raise ApiException(status=409)
        self.obj, self.version = body, self.version + 1


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_one_leader_takeover_after_the_lease_goes_stale_and_at_once_after_release():
    store, ca, cb = LeaseStore(), Clock(), Clock()
    a = Elector(store, LeaderConfig("ns", identity="a", duration_seconds=15), clock=ca)
    b = Elector(store, LeaderConfig("ns", identity="b", duration_seconds=15), clock=cb)
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    # a keeps renewing: b never takes it, however long
    for _ in range(10):
        ca.t += 5
        cb.t += 5
        assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    # a dies: b takes over once the record has not changed for the duration on b's own clock
    cb.t += 14
    assert not b.try_acquire_or_renew()
    cb.t += 2
    assert b.try_acquire_or_renew() and store.obj["spec"]["holderIdentity"] == "b"
    assert store.obj["spec"]["leaseTransitions"] == 1
    # a comes back: b holds a fresh record, so a stands by
    ca.t += 1
    assert not a.try_acquire_or_renew()
    # b releases on a clean shutdown: a leads at its next try
    b.release()
    assert a.try_acquire_or_renew() and store.obj["spec"]["holderIdentity"] == "a"


def test_a_renew_time_far_in_the_past_does_not_hand_over_a_live_lease():
    """The holder's clock runs an hour behind: its renewTime looks stale by wall clock, but it
    changes every renewal, so the other candidate waits."""
    store, ca, cb = LeaseStore(), Clock(), Clock()
    a = Elector(store, LeaderConfig("ns", identity="a", duration_seconds=15), clock=ca)
    b = Elector(store, LeaderConfig("ns", identity="b", duration_seconds=15), clock=cb)
    assert a.try_acquire_or_renew()
    for i in range(6):
        store.obj["spec"]["renewTime"] = (datetime.now(timezone.utc) - timedelta(hours=1, seconds=-i)).isoformat()
        cb.t += 10
        assert not b.try_acquire_or_renew()


def test_the_same_identity_leads_again_at_once():
    store = LeaseStore()
    assert Elector(store, LeaderConfig("ns", identity="pod-1"), clock=Clock()).try_acquire_or_renew()
    restarted = Elector(store, LeaderConfig("ns", identity="pod-1"), clock=Clock())
    assert restarted.try_acquire_or_renew()


def test_a_replica_stops_writing_before_its_lease_could_pass_to_another():
    """holds() is what every reconcile pass asks before it applies anything: true after a
    renewal, false once the lease duration minus the retry interval has passed without one, and
    false at once after losing the lease or releasing it."""
    store, ca, cb = LeaseStore(), Clock(), Clock()
    a = Elector(store, LeaderConfig("ns", identity="a", duration_seconds=15, retry_seconds=2), clock=ca)
    b = Elector(store, LeaderConfig("ns", identity="b", duration_seconds=15, retry_seconds=2), clock=cb)
    assert not a.holds() and a.try_acquire_or_renew() and a.holds()
    ca.t += 12.9
    assert a.holds()
    ca.t += 0.2  # 13.1 s since the renewal began: a standby may take it 15 s after it last saw it
    assert not a.holds()
    cb.t += 1
    assert not b.try_acquire_or_renew()  # b first sees the record now ...
    cb.t += 16
    assert b.try_acquire_or_renew() and b.holds()  # ... and takes it 16 s later
    assert not a.try_acquire_or_renew() and not a.holds()
    b.release()
    assert not b.holds()


def test_a_caller_with_slow_writes_stops_earlier():
    store, clock = LeaseStore(), Clock()
    a = Elector(store, LeaderConfig("ns", identity="a", duration_seconds=15, retry_seconds=2), clock=clock)
    assert a.try_acquire_or_renew()
    clock.t += 9.9
    assert a.holds(margin=5) and a.holds()
    clock.t += 0.2
    assert not a.holds(margin=5) and a.holds()  # a 5 s write started now could land after 15 s
