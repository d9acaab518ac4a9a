"""Leader election on a coordination.k8s.io Lease: one active operator, the others on standby.

Kubernetes' own controllers do it this way (client-go's leaderelection: a Lease with a holder,
a duration and a renew time), and so do operators built on controller-runtime. kopf's peering
was the alternative; it pauses every operator of equal priority, which two replicas of one
Deployment are, and it needs extra CRDs. The Python client's own ``kubernetes.leaderelection``
never gives the Lease up (a rolling upgrade would wait a whole lease duration) and runs its
loop in the calling thread with the work in another, where kopf needs the main thread for its
signal handling. The operator keeps all state in each run's status, so whoever leads
continues where the last leader stopped.

- A candidate takes the Lease when it is free, expired, or already its own (a restarted
  container of the same pod leads again at once). Expired is judged as client-go does, on the
  candidate's own clock: the holder's record has not changed for the lease duration since this
  candidate first saw it, so clocks that disagree between machines cannot hand it over early.
- The leader renews every ``renew_seconds``; if it cannot renew within ``duration_seconds`` it
  stops leading (the process exits and is restarted), so two leaders never act at once for
  longer than the clock skew between them.
- On a clean shutdown the leader gives the Lease up, so a standby takes over at once (helm
  upgrade, node drain); after a crash it takes over when the Lease expires.
Every write carries the Lease's resourceVersion, so two candidates never both win.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone

log = logging.getLogger("trainium_operator.leader")


@dataclass(frozen=True)
class LeaderConfig:
    namespace: str
    name: str = "trainium-operator"
    identity: str = ""
    duration_seconds: float = 15.0
    """A Lease not renewed for this long is free for another candidate (client-go's default)."""
    renew_seconds: float = 5.0
    retry_seconds: float = 2.0
    """How often a standby tries to take the Lease."""
    request_timeout_seconds: float = 4.0
    """Each Lease call gives up after this long: a call the API server holds (etcd away) must
    not outlast the lease, or the replica would go on leading after another one took over."""


def _now() -> datetime:
    return datetime.now(timezone.utc)


class Elector:
    def __init__(self, coordination, cfg: LeaderConfig, clock=time.monotonic):
        self.api, self.cfg, self.clock = coordination, cfg, clock
        self._seen: tuple | None = None  # (holder, renewTime) of the record last read
        self._seen_at = 0.0  # our clock when that record was first read
        self._renewed_at: float | None = None  # our clock before the last successful acquire/renew

    def holds(self, margin: float | None = None) -> bool:
        """Whether this replica may still act as the leader: its last successful renewal began
        less than the lease duration minus ``margin`` ago (default: the retry interval). A
        caller whose writes may take up to T seconds passes T, so a write started now lands
        before a standby could take the lease."""
        at = self._renewed_at
        margin = self.cfg.retry_seconds if margin is None else margin
        return at is not None and self.clock() - at < self.cfg.duration_seconds - margin

    def _body(self, version: str | None, transitions: int, acquired: datetime | None) -> dict:
        now = _now()
        body = {"metadata": {"name": self.cfg.name, "namespace": self.cfg.namespace},
                "spec": {"holderIdentity": self.cfg.identity, "leaseDurationSeconds": int(self.cfg.duration_seconds),
                         "acquireTime": (acquired or now).isoformat(), "renewTime": now.isoformat(),
                         "leaseTransitions": transitions}}
        if version:
            body["metadata"]["resourceVersion"] = version
        return body

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when we hold the Lease afterwards."""
        started = self.clock()  # the lease counts from before the call: it may have been slow
        if self._try(self.cfg.request_timeout_seconds):
            self._renewed_at = started
            return True
        self._renewed_at = None
        return False

    def _try(self, timeout: float) -> bool:
        from kubernetes.client.exceptions import ApiException
        try:
            lease = self.api.read_namespaced_lease(self.cfg.name, self.cfg.namespace, _request_timeout=timeout)
        except ApiException as exc:
            if exc.status != 404:
                raise
            try:
                self.api.create_namespaced_lease(self.cfg.namespace, self._body(None, 0, None),
                                                 _request_timeout=timeout)
                return True
            except ApiException as exc2:
                if exc2.status == 409:
                    return False  # another candidate created it first
                raise
        spec = lease.spec
        mine = spec.holder_identity == self.cfg.identity
        record = (spec.holder_identity, spec.renew_time)
        if record != self._seen:
            self._seen, self._seen_at = record, self.clock()
        duration = spec.lease_duration_seconds or self.cfg.duration_seconds
        expired = not spec.holder_identity or self.clock() - self._seen_at > duration
        if not (mine or expired):
            return False
        transitions = (spec.lease_transitions or 0) + (0 if mine else 1)
        body = self._body(lease.metadata.resource_version, transitions, spec.acquire_time if mine else None)
        try:
            self.api.replace_namespaced_lease(self.cfg.name, self.cfg.namespace, body, _request_timeout=timeout)
        except ApiException as exc:
            if exc.status == 409:
                return False  # someone else wrote it meanwhile
            raise
        if not mine:
            log.info("took the lease %s/%s (previous holder %r)", self.cfg.namespace, self.cfg.name,
                     spec.holder_identity)
        return True

    def release(self) -> None:
        """Give the Lease up (clean shutdown): a standby leads at its next try."""
        self._renewed_at = None
        timeout = self.cfg.request_timeout_seconds
        try:
            lease = self.api.read_namespaced_lease(self.cfg.name, self.cfg.namespace, _request_timeout=timeout)
            if lease.spec.holder_identity != self.cfg.identity:
                return
            body = self._body(lease.metadata.resource_version, lease.spec.lease_transitions or 0, None)
            body["spec"].update(holderIdentity="", leaseDurationSeconds=1)
            self.api.replace_namespaced_lease(self.cfg.name, self.cfg.namespace, body, _request_timeout=timeout)
            log.info("gave up the lease %s/%s", self.cfg.namespace, self.cfg.name)
        except Exception as exc:  # best effort: it expires anyway
            log.warning("could not give up the lease: %s", exc)

    def wait_until_leader(self, stopping=lambda: False) -> bool:
        """Block until we lead (True), or until ``stopping()`` (False)."""
        announced = False
        while not stopping():
            try:
                if self.try_acquire_or_renew():
                    return True
            except Exception as exc:  # the API may be away: keep trying
                log.warning("leader election: %s", exc)
            if not announced:
                log.info("standing by: another operator holds the lease %s/%s", self.cfg.namespace, self.cfg.name)
                announced = True
            time.sleep(self.cfg.retry_seconds)
        return False

    def keep_leading(self, stopping=lambda: False) -> None:
        """Renew until we cannot within the lease duration (returns: stop leading) or ``stopping()``."""
        last_ok = time.monotonic()
        while not stopping():
            time.sleep(self.cfg.renew_seconds)
            try:
                if self.try_acquire_or_renew():
                    last_ok = time.monotonic()
                    continue
                log.error("lost the lease %s/%s to another operator", self.cfg.namespace, self.cfg.name)
                return
            except Exception as exc:
                log.warning("could not renew the lease: %s", exc)
            if time.monotonic() - last_ok > self.cfg.duration_seconds - self.cfg.retry_seconds:
                log.error("could not renew the lease for %.0fs: stepping down", time.monotonic() - last_ok)
                return
