"""The Watcher's retry backoff after a pass that raised (watcher.Backoff): expected refusals
retry at the plain backoff, an unexpected error's backoff doubles while the run keeps failing,
up to its cap, and a pass that succeeds resets it."""

from __future__ import annotations

from kubernetes.client.exceptions import ApiException

from trainium_operator.applier import ChildError, NotLeading
from trainium_operator.watcher import ERROR_BACKOFF, MAX_ERROR_BACKOFF, Backoff


def test_expected_refusals_retry_at_the_plain_backoff_and_unexpected_errors_back_off_more():
    backoff = Backoff(("ns", "r"))
    for expected in (NotLeading("lease lost"), ChildError("cannot create Service r"), ApiException(status=503),
                     ConnectionRefusedError()):
        assert backoff.delay(expected) == ERROR_BACKOFF
    assert [backoff.delay(ValueError("bug")) for _ in range(6)] == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff.delay(NotLeading("lease lost")) == ERROR_BACKOFF  # not counted as a failure in a row
    assert backoff.delay(ValueError("bug")) == MAX_ERROR_BACKOFF
    backoff.passed()
    assert backoff.delay(ValueError("bug")) == ERROR_BACKOFF


def throttled(retry_after: str | None) -> ApiException:
    exc = ApiException(status=429, reason="Too Many Requests")
    exc.headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return exc


def test_throttling_waits_as_asked_and_is_no_failure_in_a_row():
    """Found by review: a 429 backed off like a bug (doubling to 30 s, logged with a traceback)
    while a 503 of the same server retried in 2 s."""
    backoff = Backoff(("ns", "r"))
    assert [backoff.delay(throttled(None)) for _ in range(4)] == [ERROR_BACKOFF] * 4
    assert backoff.delay(throttled("5")) == 5.0
    assert backoff.delay(throttled("600")) == MAX_ERROR_BACKOFF  # within the longest backoff
    assert backoff.delay(throttled("soon")) == ERROR_BACKOFF
    assert backoff.delay(ValueError("bug")) == ERROR_BACKOFF  # the 429s were not failures in a row


def test_a_reread_reuses_the_last_value_when_a_read_fails_and_raises_with_none():
    """watcher.Reread (a Workload or flavor kopf's index misses): at most one read per period; a
    failed read reuses the last value (None would hold the run), and with none it raises."""
    import pytest

    from trainium_operator.watcher import Reread
    reads = []

    def ok():
        reads.append(1)
        return "v1"

    def fails():
        raise ApiException(status=503)
    r = Reread(every=0.0)
    with pytest.raises(ApiException):
        r.get("k", fails, "Workload ns/x")
    assert r.get("k", ok, "Workload ns/x") == "v1" and r.had("k")
    assert r.get("k", fails, "Workload ns/x") == "v1"  # the last one read
    assert r.get("k", ok, "Workload ns/x", keep=lambda v: v != "v1") == "v1" and len(reads) == 2  # not kept: read again
    slow = Reread(every=60.0)
    slow.get("k", ok, "x")
    assert slow.get("k", fails, "x") == "v1" and len(reads) == 3  # within the period: no read at all
    slow.drop("k")
    assert not slow.had("k")
    assert r.get("new", fails, "x", fallback=None) is None  # never read: the caller's fallback
    r.get("gone", lambda: None, "x")
    assert r.get("gone", fails, "x") is None  # read before, none there: that, not an error
