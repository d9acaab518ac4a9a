"""Store errors: which are transient and which name the run's configuration (trainer.store.errors),
the retry, and one reader per node (trainer.store.node_reads).

The classification table uses botocore's real ClientError with S3's real codes, as botocore
raises it, as s3fs translates it (the ClientError in ``__cause__``) and as s3fs raises it inside
an ``except`` with ``set_cause=False`` (in ``__context__``). The tests marked ``s3`` run s3fs
against moto's S3 server behind the fault proxy (tests/standins/s3_faults.py)."""

from __future__ import annotations

import random
import threading
from dataclasses import replace

import botocore.exceptions as bx
import pytest
from s3fs.errors import translate_boto_error

from tests.standins.s3_faults import LoopbackS3
from trainer.store import node_reads, errors as store_errors
from trainer.store.errors import (BUG, DENIED, INVALID, MISSING, TRANSIENT, Backoff, StoreConfigError,
                                  StoreUnavailable, classify, retry)
from trainium_api import exitcodes


def client_error(code: str, status: int, op: str = "GetObject") -> bx.ClientError:
    return bx.ClientError({"Error": {"Code": code, "Message": f"{code} said the store"},
                           "ResponseMetadata": {"HTTPStatusCode": status}}, op)


def in_context(error: bx.ClientError) -> BaseException:
    """As s3fs raises it in ``_info``: translated without a cause, inside the except clause."""
    try:
        try:
            raise error
        except bx.ClientError as e:
            raise translate_boto_error(e, set_cause=False)
    except Exception as outer:  # noqa: BLE001 - the raised error is the value under test
        return outer


CODES = [  # (code, HTTP status, verdict)
    ("SlowDown", 503, TRANSIENT), ("Throttling", 400, TRANSIENT), ("ThrottlingException", 400, TRANSIENT),
    ("RequestLimitExceeded", 503, TRANSIENT), ("TooManyRequests", 429, TRANSIENT), ("503", 503, TRANSIENT),
    ("SlowDown", 403, TRANSIENT), ("Throttling", 403, TRANSIENT),  # a 403 whose code is a throttle
    ("InternalError", 500, TRANSIENT), ("ServiceUnavailable", 503, TRANSIENT), ("500", 500, TRANSIENT),
    ("502", 502, TRANSIENT), ("RequestTimeout", 400, TRANSIENT), ("RequestTimeTooSkewed", 403, TRANSIENT),
    ("ExpiredToken", 400, TRANSIENT), ("ExpiredTokenException", 403, TRANSIENT),
    ("TokenRefreshRequired", 400, TRANSIENT), ("SomethingNew", 400, TRANSIENT),  # unknown: transient
    ("NoSuchBucket", 404, MISSING), ("NoSuchKey", 404, MISSING), ("404", 404, MISSING),
    ("AccessDenied", 403, DENIED), ("403", 403, DENIED), ("InvalidAccessKeyId", 403, DENIED),
    ("SignatureDoesNotMatch", 403, DENIED), ("InvalidBucketName", 400, INVALID), ("InvalidObjectState", 403, INVALID),
]


@pytest.mark.parametrize("code, status, verdict", CODES, ids=[f"{c}-{s}" for c, s, _ in CODES])
def test_a_client_error_is_judged_by_its_code_however_s3fs_wraps_it(code, status, verdict):
    error = client_error(code, status)
    translated = translate_boto_error(client_error(code, status))
    assert classify(error) == verdict
    assert classify(translated) == verdict, (type(translated), translated)
    assert classify(in_context(client_error(code, status))) == verdict
    # s3fs's own translation is what looking inside corrects: throttles and clocks become PermissionError
    if code in ("RequestTimeTooSkewed", "ExpiredToken"):
        assert isinstance(translated, PermissionError)


BOTOCORE = [
    (bx.EndpointConnectionError(endpoint_url="http://s3"), TRANSIENT),
    (bx.ConnectTimeoutError(endpoint_url="http://s3"), TRANSIENT),
    (bx.ReadTimeoutError(endpoint_url="http://s3"), TRANSIENT),
    (bx.ConnectionClosedError(endpoint_url="http://s3"), TRANSIENT),
    (bx.NoCredentialsError(), TRANSIENT),  # the instance metadata service did not answer in time
    (bx.CredentialRetrievalError(provider="assume-role-with-web-identity", error_msg="STS timed out"), TRANSIENT),
    (bx.MetadataRetrievalError(error_msg="IMDS"), TRANSIENT),
    (bx.ParamValidationError(report="Invalid bucket name \"no_such!\""), INVALID),
    (bx.PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY"), INVALID),
]


@pytest.mark.parametrize("error, verdict", BOTOCORE, ids=[type(e).__name__ for e, _ in BOTOCORE])
def test_botocores_own_errors(error, verdict):
    assert classify(error) == verdict
    try:  # s3fs wraps a parameter error in a ValueError raised while handling it
        try:
            raise error
        except bx.BotoCoreError as e:
            raise ValueError(f"Failed to list path: {e}")
    except ValueError as wrapped:
        assert classify(wrapped) == verdict


def test_the_os_and_aiohttp_and_our_own_bugs():
    import aiohttp
    for error in (ConnectionResetError(104, "reset"), ConnectionRefusedError(111, "refused"),
                  ConnectionAbortedError(103, "aborted"), TimeoutError(), OSError(5, "EIO"),
                  aiohttp.ServerDisconnectedError(), RuntimeError("something nobody listed")):
        assert classify(error) == TRANSIENT, error
    assert classify(FileNotFoundError(2, "gone")) == classify(IsADirectoryError(21, "dir")) == MISSING
    assert classify(PermissionError(13, "denied")) == DENIED
    assert classify(TypeError("a bug")) == classify(AttributeError("a bug")) == BUG


# --------------------------------------------------------------------------------------------
# The retry
# --------------------------------------------------------------------------------------------

FAST = Backoff(tries=5, first_seconds=1.0, max_seconds=4.0, total_seconds=100.0, denied_tries=3)


class Clock:
    """Time that passes only when the retry sleeps (a boundary the test owns)."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def __call__(self) -> float:
        return self.now


def failing(*errors):
    """A read that raises these errors in turn, then returns b'ok'."""
    calls = []

    def read():
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return b"ok"
    return read, calls


def run(read, policy=FAST):
    clock = Clock()
    return retry(read, "read s3://b/k", policy, sleep=clock.sleep, clock=clock, rng=random.Random(0)), clock


def test_backoff_doubles_with_equal_jitter_up_to_its_cap():
    rng = random.Random(1)
    for attempt, ceiling in enumerate([1.0, 2.0, 4.0, 4.0, 4.0]):
        waits = [FAST.delay(attempt, rng) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits)
        assert max(waits) - min(waits) > ceiling / 4  # jittered: nodes that failed together spread out


def test_transient_errors_are_retried_until_the_read_succeeds():
    read, calls = failing(translate_boto_error(client_error("SlowDown", 503)),
                          translate_boto_error(client_error("InternalError", 500)),
                          translate_boto_error(client_error("ExpiredToken", 400)))
    value, clock = run(read)
    assert value == b"ok" and len(calls) == 4 and len(clock.sleeps) == 3


def test_a_store_that_stays_down_ends_the_process_retryable_after_bounded_tries(capsys):
    read, calls = failing(*[translate_boto_error(client_error("SlowDown", 503)) for _ in range(20)])
    with pytest.raises(StoreUnavailable) as err:
        run(read)
    assert err.value.code == exitcodes.RETRYABLE and len(calls) == FAST.tries
    assert "read s3://b/k failed 5 times" in str(err.value) and "last: SlowDown (HTTP 503)" in str(err.value)
    assert "exiting 75 (retryable)" in capsys.readouterr().err


def test_the_total_time_bounds_the_retries_too():
    slow = Backoff(tries=100, first_seconds=10.0, max_seconds=10.0, total_seconds=30.0, denied_tries=3)
    read, calls = failing(*[TimeoutError() for _ in range(100)])
    with pytest.raises(StoreUnavailable):
        run(read, slow)
    assert len(calls) <= 4  # waits of 5 to 10 s within 30 s


def test_a_one_off_refusal_is_retried_and_a_persistent_one_is_configuration():
    read, calls = failing(translate_boto_error(client_error("AccessDenied", 403)))
    assert run(read)[0] == b"ok" and len(calls) == 2
    read, calls = failing(*[translate_boto_error(client_error("AccessDenied", 403)) for _ in range(10)])
    with pytest.raises(StoreConfigError) as err:
        run(read)
    assert len(calls) == FAST.denied_tries and err.value.kind == DENIED
    assert "refused 3 times in a row" in str(err.value) and "AccessDenied (HTTP 403)" in str(err.value)
    # a throttle between refusals restarts the count: the refusals are not "the same" any more
    denied = [translate_boto_error(client_error("AccessDenied", 403)) for _ in range(2)]
    read, calls = failing(*denied, client_error("SlowDown", 503), *denied)
    assert run(read, replace(FAST, tries=8))[0] == b"ok" and len(calls) == 6
    # a refusal must also have lasted: a policy attached a moment before the run still propagates
    read, calls = failing(*[translate_boto_error(client_error("AccessDenied", 403)) for _ in range(10)])
    with pytest.raises(StoreConfigError) as err:
        run(read, replace(FAST, tries=10, denied_seconds=8.0))
    assert len(calls) > FAST.denied_tries


def test_missing_invalid_and_bugs_are_not_retried():
    read, calls = failing(translate_boto_error(client_error("NoSuchBucket", 404)))
    with pytest.raises(FileNotFoundError):
        run(read)
    read, calls2 = failing(translate_boto_error(client_error("InvalidBucketName", 400)))
    with pytest.raises(StoreConfigError):
        run(read)
    read, calls3 = failing(TypeError("a bug"))
    with pytest.raises(TypeError):
        run(read)
    assert len(calls) == len(calls2) == len(calls3) == 1


# --------------------------------------------------------------------------------------------
# One reader per node
# --------------------------------------------------------------------------------------------


def nodes(tmp_path, ranks: int = 4, launch: str = "launch-1") -> list[node_reads.Node]:
    return [node_reads.Node(r, ranks, launch, tmp_path) for r in range(ranks)]


def on_every_rank(ranks, fn) -> list:
    """fn(node) on each rank at once (threads: the ranks of a node meet only in its files)."""
    out: list = [None] * len(ranks)

    def one(i):
        try:
            out[i] = fn(ranks[i])
        except BaseException as exc:  # noqa: BLE001 - each rank's outcome is compared below
            out[i] = exc
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ranks))]
    for t in reversed(threads):  # the followers first: they must wait for the leader
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_local_rank_0_reads_once_and_the_other_ranks_take_its_copy(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return b"tokenizer bytes"
    got = on_every_rank(nodes(tmp_path), lambda n: node_reads.shared("object s3://b/tok.json", compute, n))
    assert got == [b"tokenizer bytes"] * 4 and len(calls) == 1
    # asked again in the same launch (a held-out set naming the same tokenizer): no read at all
    assert on_every_rank(nodes(tmp_path), lambda n: node_reads.shared("object s3://b/tok.json", compute, n)) == got
    assert len(calls) == 1
    # the next launch reads again
    on_every_rank(nodes(tmp_path, launch="launch-2"), lambda n: node_reads.shared("object s3://b/tok.json", compute, n))
    assert len(calls) == 2


@pytest.mark.parametrize("error", [FileNotFoundError("NoSuchBucket: the bucket does not exist"),
                                   StoreConfigError("read s3://b/k: refused 4 times in a row", DENIED),
                                   StoreUnavailable("store: read s3://b/k failed 10 times over 290 s")],
                         ids=["missing", "refused", "unavailable"])
def test_the_leaders_verdict_reaches_every_rank_as_the_same_error(tmp_path, error):
    def compute():
        raise error
    got = on_every_rank(nodes(tmp_path), lambda n: node_reads.shared("list s3://b/p", compute, n))
    assert all(type(e) is type(error) and str(e) == str(error) for e in got), got
    if isinstance(error, StoreUnavailable):
        assert all(e.code == exitcodes.RETRYABLE for e in got)


def test_a_follower_whose_leader_never_publishes_reads_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(node_reads, "WAIT_SECONDS", 0.3)
    follower = nodes(tmp_path)[1]
    assert node_reads.shared("object s3://b/k", lambda: b"read here", follower) == b"read here"


def test_local_paths_are_read_on_every_rank_without_the_cache(tmp_path, monkeypatch):
    (tmp_path / "tok.json").write_text("{}")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv(node_reads.CACHE_ENV, str(tmp_path / "cache"))
    assert node_reads.read_object(str(tmp_path / "tok.json")) == b"{}"
    assert node_reads.query(str(tmp_path), "list", lambda: ["a"]) == ["a"]
    assert not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------------------------
# Against moto's S3 server behind the fault proxy (real s3fs, aiobotocore, botocore)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def store(monkeypatch):
    s3 = LoopbackS3()
    try:
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries off: each fault reaches s3fs and ours
        s3.client.create_bucket(Bucket="bkt")
        s3.client.put_object(Bucket="bkt", Key="tok.json", Body=b'{"v": 1}')
        yield s3
    finally:
        s3.close()


def s3fs_of(store):
    import s3fs
    return s3fs.S3FileSystem(endpoint_url=store.proxy.endpoint, skip_instance_cache=True, use_listings_cache=False)


QUICK = Backoff(tries=4, first_seconds=0.05, max_seconds=0.2, total_seconds=20.0, denied_tries=3)


@pytest.mark.s3
def test_s3fs_errors_from_a_real_server(store):
    fs = s3fs_of(store)
    with pytest.raises(FileNotFoundError) as err:
        fs.cat_file("no-such-bucket/tok.json")
    assert classify(err.value) == MISSING and store_errors.error_code(err.value)[0] == "NoSuchBucket"
    store.proxy.fail("GET", r"^/bkt/tok\.json$", 1, 503, "SlowDown")
    store.proxy.fail("GET", r"^/bkt/tok\.json$", 1, 403, "SlowDown")  # a throttle answered as 403
    store.proxy.fail("GET", r"^/bkt/tok\.json$", 2, 500, "InternalError")
    store.proxy.fail("GET", r"^/bkt/tok\.json$", 1, 403, "AccessDenied")  # once: retried
    assert retry(lambda: fs.cat_file("bkt/tok.json"), "read s3://bkt/tok.json", QUICK) == b'{"v": 1}'
    assert store.proxy.injected[("GET", "/bkt/tok.json")] == 5 and store.proxy.gets("/bkt/tok.json") == 1


@pytest.mark.s3
def test_a_persistent_refusal_and_a_store_that_stays_down_from_a_real_server(store):
    fs = s3fs_of(store)
    store.proxy.fail("GET", r"^/bkt/tok\.json$", 50, 403, "AccessDenied")
    with pytest.raises(StoreConfigError) as err:
        retry(lambda: fs.cat_file("bkt/tok.json"), "read s3://bkt/tok.json", QUICK)
    assert "refused 3 times in a row" in str(err.value) and "AccessDenied" in str(err.value)
    store.proxy.faults.clear()
    store.proxy.fail("*", r"^/bkt", 500, 500, "InternalError")  # the listing is /bkt?list-type=2
    with pytest.raises(StoreUnavailable) as down:
        retry(lambda: fs.ls("bkt/"), "list s3://bkt/", QUICK)
    assert down.value.code == exitcodes.RETRYABLE and "InternalError (HTTP 500)" in str(down.value)


@pytest.mark.s3
def test_the_node_copy_is_keyed_by_the_objects_version(store, tmp_path, monkeypatch):
    """Launch 1's leader: HEAD and GET. Launch 2 on the same node: HEAD only (the copy). The
    object replaced on the store: a GET again."""
    monkeypatch.setenv(node_reads.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    import fsspec.config
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": store.proxy.endpoint})
    for launch, body in (("1", b'{"v": 1}'), ("2", b'{"v": 1}'), ("3", b'{"v": 22}')):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", launch)
        if launch == "3":
            store.client.put_object(Bucket="bkt", Key="tok.json", Body=body)
        assert node_reads.read_object("s3://bkt/tok.json") == body
    assert store.proxy.gets("/bkt/tok.json") == 2 and store.proxy.forwarded[("HEAD", "/bkt/tok.json")] == 3
    copies = sorted(p.name for p in (tmp_path / "cache" / "objects").iterdir())
    assert len(copies) == 2 and not any(p.startswith(".") for p in copies)
    assert len(list((tmp_path / "cache" / "launches").iterdir())) == 3


def test_a_store_that_stays_down_is_said_in_the_termination_message(tmp_path, monkeypatch):
    """So the operator restarts under the cause ``store`` (its own budget; never the no-progress guard)."""
    from trainium_api import storefaults
    from trainium_api.launch import TERMINATION_LOG_ENV
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(tmp_path / "termination-log"))
    read, _ = failing(*[client_error("SlowDown", 503) for _ in range(10)])
    with pytest.raises(StoreUnavailable):
        run(read)
    said = storefaults.parse_message((tmp_path / "termination-log").read_text())
    assert said.startswith("read s3://b/k failed 5 times") and "SlowDown" in said
