"""Object-store errors: transient (retried) or the run's configuration (fatal), and the retry.

Every start-up read of the store (the tokenizer, data listings and manifests, ``init.from``'s
config and index) goes through :func:`retry`. Its verdict on an error comes from
:func:`classify`, one table for fsspec, s3fs, botocore, aiobotocore and the OS:

``transient``  throttling (SlowDown, Throttling, RequestLimitExceeded, TooManyRequests, 429, and a
               403 whose code is a throttle), any 5xx, InternalError, ServiceUnavailable,
               timeouts, connections reset, refused or aborted, RequestTimeTooSkewed, ExpiredToken
               and TokenRefreshRequired, credentials that could not be fetched (the instance
               metadata service or STS did not answer), and every error this table does not know
``missing``    NoSuchBucket, NoSuchKey, 404, a file or directory that is not there: the store
               answered, and what the run names is not in it
``denied``     AccessDenied, 403, InvalidAccessKeyId, SignatureDoesNotMatch: retried, and the
               run's configuration only once the same request has been refused ``denied_tries``
               times in a row (an identity's permissions and keys propagate in seconds, and an
               identity about to expire is refreshed by botocore before it is used, or answered
               ExpiredToken, which is transient)
``invalid``    a request the store can never answer: an invalid bucket name, an archived object
``bug``        TypeError, AttributeError and their kind: our code, not the store; raised at once
               (a crash, which the operator restarts: never a configuration verdict)

s3fs turns botocore's ClientError into Python's OSError subclasses (s3fs.errors
``translate_boto_error``: SlowDown -> OSError(EBUSY), but ExpiredToken and RequestTimeTooSkewed
-> PermissionError, NoSuchBucket -> FileNotFoundError) and keeps the ClientError as the new
error's ``__cause__`` (or ``__context__`` where it is raised with ``set_cause=False``). So the
code and HTTP status inside the chain decide first, the Python type only when none is there.

Retries back off exponentially with jitter (:class:`Backoff`, :data:`RETRY`), bounded in tries
and total time. A transient error that outlasts them ends the process with exit code 75
(:class:`StoreUnavailable`), which the operator retries; a missing object is re-raised as it
is, and a persistent denial or an invalid request becomes :class:`StoreConfigError`: the
callers name their field in a ``ConfigError`` (exit 78). This module imports no torch.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from trainium_api import exitcodes, storefaults

from ..contract import termination
from ..contract.podenv import PodEnv

log = logging.getLogger("trainer.store")
T = TypeVar("T")

TRANSIENT, MISSING, DENIED, INVALID, BUG = "transient", "missing", "denied", "invalid", "bug"

# botocore's throttling codes (botocore.retries.standard.ThrottlingErrorDetector), and the
# other codes S3 and STS answer while throttling
THROTTLE_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
    "TooManyRequestsException", "TooManyRequests", "ProvisionedThroughputExceededException",
    "TransactionInProgressException", "RequestLimitExceeded", "BandwidthLimitExceeded", "LimitExceededException",
    "RequestThrottled", "SlowDown", "PriorRequestNotComplete", "EC2ThrottledException"})
# answered by a store or an identity that will answer otherwise soon: a server error, a clock or
# a token that the next request (re-signed, with refreshed credentials) gets right
TRANSIENT_CODES = frozenset({
    "InternalError", "InternalFailure", "ServiceUnavailable", "ServiceFailure", "RequestTimeout",
    "RequestTimeoutException", "RequestTimeTooSkewed", "RequestExpired", "ExpiredToken", "ExpiredTokenException",
    "TokenRefreshRequired", "IDPCommunicationError", "OperationAborted"})
MISSING_CODES = frozenset({"NoSuchBucket", "NoSuchKey", "NotFound", "NoSuchVersion", "404"})
DENIED_CODES = frozenset({
    "AccessDenied", "AccessDeniedException", "Forbidden", "403", "AllAccessDisabled", "AccountProblem",
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidSecurity", "NotSignedUp", "UnrecognizedClientException"})
INVALID_CODES = frozenset({"InvalidBucketName", "InvalidObjectState", "InvalidURI", "KeyTooLongError"})
# botocore's own errors that say the client is set up wrong (by class name, so that this module
# needs no botocore: a run on local files has none of these)
INVALID_BOTOCORE = frozenset({
    "ParamValidationError", "PartialCredentialsError", "ProfileNotFound", "NoRegionError", "InvalidRegionError",
    "InvalidDNSNameError", "InvalidS3AddressingStyleError"})
BUG_TYPES = (TypeError, AttributeError, NameError, AssertionError, ImportError, NotImplementedError, RecursionError)


@dataclass(frozen=True)
class Backoff:
    """How a store read is retried: try ``n`` waits ``first_seconds x 2^n`` (at most
    ``max_seconds``), of which a random half (equal jitter: the nodes of a gang that failed
    together do not come back together), until ``tries`` tries or ``total_seconds`` have passed."""

    tries: int
    first_seconds: float
    max_seconds: float
    total_seconds: float
    denied_tries: int  # refusals in a row that make a denial the run's configuration ...
    denied_seconds: float = 0.0  # ... once they have lasted this long (a policy still propagating)

    def delay(self, attempt: int, rng: random.Random) -> float:
        ceiling = min(self.max_seconds, self.first_seconds * 2 ** attempt)
        return ceiling / 2 + rng.uniform(0, ceiling / 2)


# 10 tries over at most 5 minutes (the waits alone: 75 to 150 s): longer than S3 takes to scale a
# prefix up after SlowDown, short enough that a store that is down is handed to the operator
# A refusal is the run's configuration only once it has lasted 2 minutes: IAM takes seconds to
# minutes to propagate a policy attached just before the run started.
RETRY = Backoff(tries=10, first_seconds=1.0, max_seconds=30.0, total_seconds=300.0, denied_tries=4,
                denied_seconds=120.0)


class StoreUnavailable(SystemExit):
    """A transient store error outlasted the retries: the process exits RETRYABLE (75).

    A SystemExit, so that no ``except Exception`` between the read and the entry point takes it
    for something else, the entry point's clean-up (``finally``) still runs, and the process's
    exit code is 75 whichever entry point (``python -m trainer``, a warm worker, trainer.data.prepare)
    started it."""

    def __init__(self, message: str):
        super().__init__(exitcodes.RETRYABLE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class StoreConfigError(OSError):
    """A store error that names the run's configuration (a persistent denial, an invalid
    request): retrying cannot mend it. Callers turn it into a ConfigError naming their field."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


# --------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The error, then what caused it (``__cause__``) or was being handled (``__context__``),
    outermost first."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        link = todo.pop(0)
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        todo += [link.__cause__, link.__context__]


def error_code(exc: BaseException) -> tuple[str, int | None] | None:
    """(error code, HTTP status) of the first botocore response in the chain, or None."""
    for link in _chain(exc):
        response = getattr(link, "response", None)
        if isinstance(response, dict) and ("Error" in response or "ResponseMetadata" in response):
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            code = str((response.get("Error") or {}).get("Code") or status or "")
            return code, status if isinstance(status, int) else None
    return None


def _by_code(code: str, status: int | None) -> str:
    if code in THROTTLE_CODES or code in TRANSIENT_CODES:
        return TRANSIENT  # before the status: S3 has answered throttles with 403
    if code in MISSING_CODES:
        return MISSING
    if code in DENIED_CODES:
        return DENIED
    if code in INVALID_CODES:
        return INVALID
    if status == 404:
        return MISSING
    if status == 403:
        return DENIED
    return TRANSIENT  # 429, 5xx, and what we do not know


def classify(exc: BaseException) -> str:
    """transient, missing, denied, invalid or bug: see the module's docstring."""
    if isinstance(exc, BUG_TYPES):
        return BUG
    found = error_code(exc)
    if found is not None:
        return _by_code(*found)
    for link in _chain(exc):
        if {c.__name__ for c in type(link).__mro__} & INVALID_BOTOCORE:
            return INVALID
    if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return MISSING
    if isinstance(exc, PermissionError):
        return DENIED
    return TRANSIENT  # timeouts, connection errors, credentials not fetched, EIO, anything unknown


def describe(exc: BaseException) -> str:
    """One line for people: the store's code and status when there is one."""
    if isinstance(exc, StoreConfigError):
        return str(exc)  # already described, with the code of the refusal
    found = error_code(exc)
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    if found is not None:
        code, status = found
        name = code + (f" (HTTP {status})" if status and str(status) != code else "")
    else:
        name = type(exc).__name__
    return name + (f": {text}" if text else "")


# --------------------------------------------------------------------------------------------
# Retrying
# --------------------------------------------------------------------------------------------


def unavailable(what: str, exc: BaseException, tries: int, seconds: float) -> StoreUnavailable:
    """The error that ends the process retryable, logged (nobody else prints a SystemExit)."""
    message = (f"store: {what} failed {tries} times over {seconds:.0f} s (last: {describe(exc)}): transient "
               f"store errors (throttling, a server error, the network, a clock or credentials), not the run's "
               f"configuration; exiting {exitcodes.RETRYABLE} (retryable): the run is restarted and reads it again")
    log.error("%s", message)
    print(message, file=sys.stderr, flush=True)  # also where no logging is set up (trainer.data.prepare)
    _say_in_termination_message(f"{what} failed {tries} times over {seconds:.0f} s: {describe(exc)}")
    return StoreUnavailable(message)


def _say_in_termination_message(reason: str) -> None:
    """In a pod: the container's termination message says the store was unavailable
    (trainium_api.storefaults), so the operator restarts the run under its own cause ``store``
    rather than as a crash that counts toward the no-progress guard."""
    path = PodEnv.from_environ().termination_log  # deep in a read's give-up: read here
    termination.write(path, storefaults.format_message(reason), log.warning)


def retry(read: Callable[[], T], what: str, policy: Backoff | None = None, *,
          sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
          rng: random.Random | None = None) -> T:
    """``read()``, tried again after each transient error or refusal, with jittered backoff.

    Returns its value; raises a missing object's error as it is, StoreConfigError for a
    refusal that persisted or an invalid request, the error itself for our own bug, and
    StoreUnavailable (exit 75) when transient errors outlast ``policy``. ``what`` says what was
    read, for the log and the messages ("read s3://b/tokenizer.json")."""
    policy = policy or RETRY
    rng = rng or random.Random()
    started, denied, denied_since = clock(), 0, None
    for attempt in range(policy.tries):
        try:
            return read()
        except Exception as exc:  # noqa: BLE001 - sorted by classify, and raised again unless transient
            kind = classify(exc)
            if kind in (MISSING, BUG):
                raise
            if kind == INVALID:
                raise StoreConfigError(f"{what}: {describe(exc)}", kind) from exc
            denied = denied + 1 if kind == DENIED else 0
            denied_since = (denied_since if denied > 1 else clock()) if denied else None
            if denied >= policy.denied_tries and clock() - denied_since >= policy.denied_seconds:
                raise StoreConfigError(f"{what}: refused {denied} times in a row over {clock() - started:.0f} s "
                                       f"({describe(exc)})", kind) from exc
            wait = policy.delay(attempt, rng)
            elapsed = clock() - started
            if attempt + 1 >= policy.tries or elapsed + wait > policy.total_seconds:
                raise unavailable(what, exc, attempt + 1, elapsed) from exc
            log.warning("store: %s failed (%s, %s); try %d of %d in %.1f s", what, describe(exc), kind,
                        attempt + 2, policy.tries, wait)
            sleep(wait)
    raise AssertionError("unreachable: the last try returns or raises")
