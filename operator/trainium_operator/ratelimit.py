"""The operator's own API client pace: a token bucket in front of every request it sends.

The API server's priority and fairness (the chart's FlowSchema and PriorityLevelConfiguration,
charts/trainium-operator/templates/flowcontrol.yaml) bounds how many of the operator's requests
run at once; this bounds how fast it sends them, as client-go's QPS and burst do for the
controllers the field trusts, so that a mass restart (thousands of pod deletes and creates)
queues here, in order, rather than in the API server's queues, where it would crowd out the
leader lease and other tenants and be answered 429 once they fill.

Sizing (the defaults, DEFAULT_QPS and DEFAULT_BURST): an in-place restart writes two gang
orders whatever the gang's size (trainium_api.gangorder); a pass writes a status patch when it
changed; recreating a gang of N pods is N deletes then N creates. With a burst of 400 and 200
requests a second, a 128-node gang is recreated without waiting on the bucket, 1,024 pods take
about 8 s of pacing (2,048 writes), and the status patches of 100 live runs (one a second each at
most) use half the rate. Set ``--api-qps 0`` to send unpaced (a test cluster of your own).

Watches (kopf's, the agents') are not paced: a watch is one long request. The leader lease
has a client of its own and is never paced.
"""

from __future__ import annotations

import threading
import time

DEFAULT_QPS = 200.0
DEFAULT_BURST = 400


class TokenBucket:
    """``qps`` tokens a second, at most ``burst`` held; ``take`` waits for one. Thread-safe."""

    def __init__(self, qps: float, burst: int, clock=time.monotonic, sleep=time.sleep):
        if not 0 <= qps < float("inf"):  # (NaN too)
            raise ValueError(f"--api-qps must be a number >= 0 (0: no limit), got {qps}")
        if burst < 1:
            raise ValueError(f"--api-burst must be >= 1, got {burst}")
        self.qps, self.burst, self.clock, self.sleep = qps, burst, clock, sleep
        self._tokens, self._at = float(burst), clock()
        self._lock = threading.Lock()
        self.waited = 0.0  # seconds spent waiting for tokens, in all (the metric)

    def take(self) -> float:
        """Wait until a token is free and take it; the seconds waited. Unlimited with qps 0."""
        if not self.qps:
            return 0.0
        with self._lock:  # a reservation: the wait is computed once, under the lock, in order
            now = self.clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
            self._at = now
            self._tokens -= 1.0
            wait = -self._tokens / self.qps if self._tokens < 0 else 0.0
            self.waited += wait
        if wait > 0:
            self.sleep(wait)
        return wait


def paced(api_client, bucket: TokenBucket, on_wait=lambda seconds: None, after_wait=lambda: None):
    """``api_client`` (kubernetes.client.ApiClient) with every request but a watch taking a
    token of ``bucket`` first (its call_api: every generated API method sends through it);
    ``on_wait(seconds)`` after each request that waited, then ``after_wait()``, which may raise
    to drop the request (the lease checked again: a write that waited here may no longer be
    this replica's to send)."""
    send = api_client.call_api

    def call_api(method, url, *args, **kwargs):
        if not _is_watch(url) and (waited := bucket.take()):
            on_wait(waited)
            after_wait()
        return send(method, url, *args, **kwargs)

    api_client.call_api = call_api
    return api_client


def _is_watch(url: str) -> bool:
    query = url.partition("?")[2].lower()
    return any(part in ("watch=true", "watch=1") for part in query.split("&"))
