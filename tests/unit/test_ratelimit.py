"""The operator's client pace (ratelimit.py): a token bucket in front of every request but a
watch, on a fake clock (the bucket's arithmetic), and around a real ApiClient's call_api."""

from __future__ import annotations

import pytest

from trainium_operator import ratelimit


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_burst_goes_at_once_then_requests_are_paced():
    clock = Clock()
    bucket = ratelimit.TokenBucket(100.0, 10, clock=clock, sleep=clock.sleep)
    assert [bucket.take() for _ in range(10)] == [0.0] * 10 and clock.now == 0.0
    waits = [bucket.take() for _ in range(100)]
    assert all(w == pytest.approx(0.01) for w in waits) and clock.now == pytest.approx(1.0)
    clock.now += 60  # idle: the bucket refills to its burst, never beyond
    assert [bucket.take() for _ in range(10)] == [0.0] * 10 and bucket.take() == pytest.approx(0.01)
    assert bucket.waited == pytest.approx(1.01)


def test_no_pace_and_bad_settings():
    assert ratelimit.TokenBucket(0, 1).take() == 0.0
    for qps, burst, field in ((-1, 1, "--api-qps"), (float("nan"), 1, "--api-qps"), (float("inf"), 1, "--api-qps"),
                              (1, 0, "--api-burst")):
        with pytest.raises(ValueError, match=field):
            ratelimit.TokenBucket(qps, burst)


def test_every_request_but_a_watch_takes_a_token():
    from kubernetes import client
    sent = []
    api = client.ApiClient(client.Configuration(host="http://127.0.0.1:1"))
    api.call_api = lambda method, url, *a, **kw: sent.append((method, url))

    class Counting(ratelimit.TokenBucket):
        taken = 0

        def take(self):
            Counting.taken += 1
            return 0.25
    waited = []
    ratelimit.paced(api, Counting(1, 1), waited.append)
    api.call_api("PATCH", "http://h/api/v1/namespaces/a/pods/p")
    api.call_api("GET", "http://h/api/v1/pods?labelSelector=x&watch=true")
    api.call_api("GET", "http://h/api/v1/pods?watch=True&timeoutSeconds=60")
    api.call_api("GET", "http://h/api/v1/pods?labelSelector=watch%3Dtrue")
    assert Counting.taken == 2 and waited == [0.25, 0.25] and len(sent) == 4
