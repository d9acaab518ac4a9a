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
