"""When the operator could not see the cluster: the API server (or its etcd) away or too slow.

While the API is away, trainers cannot write their progress annotations and kubelets cannot
renew their leases, so a reconcile pass that judged the silence afterwards would restart a
healthy gang for a hang, or quarantine a healthy node. Reconcile holds both judgements across
an outage (judge: the hang clock and the outage hold); this module says when one was.

One signal marks an outage:
- a probe of ``/readyz`` every PROBE_INTERVAL_SECONDS, failed or unanswered within
  PROBE_TIMEOUT_SECONDS. It is what notices an outage while the operator has nothing to write
  (a gang training quietly between reports: found by the control-plane e2e test, where etcd
  restarted while no pass wrote and the gang was restarted for a hang once it was back);
  ``/readyz`` includes the API server's etcd check, and every identity may read it
  (system:public-info-viewer).
A write of the operator's own that failed is not one: it is that run's to retry (a 5xx on one
request, a webhook's refusal), and must not restart every run's hang clock. An outage shorter
than DisruptionGuard.outage_min_seconds holds the hang clock only while it lasts.
The outage ends when the probe is next answered in time (a write may succeed while etcd is
still settling; readiness is the server's own word that it is back).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("trainium_operator")

PROBE_INTERVAL_SECONDS = 1.0
PROBE_TIMEOUT_SECONDS = 2.0  # an API server slower than this cannot deliver progress in time either


class ApiHealth:
    """The newest outage, as (began, ended); thread-safe (the probe, the passes).

    Once the probe has answered, a probe overdue by more than ``stale_after`` seconds counts as
    an outage from its last answer too: silence is judged only while the operator can confirm
    it would have heard (a probe thread starved of CPU, a probe that hangs)."""

    def __init__(self, stale_after: float = PROBE_INTERVAL_SECONDS + PROBE_TIMEOUT_SECONDS + 1.0,
                 on_change: Callable[[bool], None] | None = None) -> None:
        """``on_change(away)``: told when an outage begins (True) and ends (False)."""
        self.stale_after = stale_after
        self.on_change = on_change or (lambda away: None)
        self._lock = threading.Lock()
        self._began: float | None = None
        self._ended: float | None = None
        self._ready_at: float | None = None  # the newest answer in time

    def failed(self, at: float, why: object) -> None:
        """A call sent at ``at`` got no answer (or an error of the server's): an outage began
        then, unless one is already under way."""
        with self._lock:
            if self._began is not None and self._ended is None:
                return
            self._began, self._ended = at, None
        self.on_change(True)
        log.warning("the API server is unreachable (%s); holding hang and lost-node detection until it is back", why)

    def answered(self, at: float) -> None:
        """The probe was answered in time at ``at``: an outage under way ends, and so does an
        unconfirmed stretch since the previous answer."""
        with self._lock:
            ongoing = self._began is not None and self._ended is None
            silent = self._ready_at is not None and at - self._ready_at > self.stale_after
            if ongoing:
                self._ended = max(at, self._began)
            elif silent:
                self._began, self._ended = self._ready_at, at
            self._ready_at = at
            took = (self._ended - self._began) if ongoing else None
        if took is not None:
            self.on_change(False)
            log.info("the API server is back after %.1fs; every run's hang clock restarts now", took)

    def unwatched(self, at: float | None = None) -> None:
        """The probe stopped at ``at`` (this replica stopped leading): the time until it runs
        again is not an outage of the API, and must not hold a node lost meanwhile. So an outage
        under way ends there too: the replica kept its memory across the standby, and the first
        answer of its next term would otherwise stretch that outage over the whole standby."""
        at = time.time() if at is None else at
        with self._lock:
            self._ready_at = None
            ongoing = self._began is not None and self._ended is None
            if ongoing:
                self._ended = max(at, self._began)
        if ongoing:
            self.on_change(False)

    def outage(self, now: float) -> tuple[float, float] | None:
        """(began, ended) of the newest outage; ended is ``now`` while it lasts; None if none."""
        with self._lock:
            if self._began is not None and self._ended is None:
                return self._began, now
            if self._ready_at is not None and now - self._ready_at > self.stale_after:
                return self._ready_at, now
            return (self._began, self._ended) if self._began is not None else None


class ApiProbe:
    """A daemon thread that asks ``ready()`` (raises when the API is not ready) every interval
    and tells ``health``. ``stop()`` ends it within one interval plus one timeout."""

    def __init__(self, ready: Callable[[float], None], health: ApiHealth,
                 interval: float = PROBE_INTERVAL_SECONDS, timeout: float = PROBE_TIMEOUT_SECONDS):
        self.ready, self.health, self.interval, self.timeout = ready, health, interval, timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="api-probe", daemon=True)

    def start(self) -> ApiProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.health.unwatched(time.time())

    def _loop(self) -> None:
        while not self._stop.is_set():
            sent = time.time()
            try:
                self.ready(self.timeout)
            except Exception as exc:  # any failure, refused connection to HTTP 500, is "not ready"
                if not self._stop.is_set():
                    self.health.failed(sent, _short(exc))
            else:
                if self._stop.is_set():  # stopped while asking: the answer belongs to no term
                    break
                done = time.time()
                if done - sent > self.timeout:  # answered, but later than a probe may take
                    self.health.failed(sent, f"/readyz took {done - sent:.1f}s")
                else:
                    self.health.answered(done)
            self._stop.wait(self.interval)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
