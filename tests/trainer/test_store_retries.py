"""Transient store errors at start-up are retried, never fatal; a store that answered "no such
bucket" is. Two ranks under torchrun on CPU read their tokenizer and raw-text data from moto's S3
server on loopback through the fault proxy (tests/standins/s3_faults.py), which answers
SlowDown, 503 and 500 InternalError several times before it forwards. botocore and s3fs keep
their own retries (the defaults a pod has); the InternalErrors outlast them, so the trainer's
own retry (trainer.store.errors) is what carries the run through. The proxy's counts show
that the node fetched the tokenizer, and looked up each source, once, not once per rank."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, trainer_cmd, trainer_env
from tests.standins.s3_faults import LoopbackS3
from trainium_api import exitcodes

pytestmark = [pytest.mark.trainer, pytest.mark.s3]
TOKENIZER = "/data/tiny/tokenizer.json"


@pytest.fixture
def store(tiny_data):
    s3 = LoopbackS3()
    try:
        s3.client.create_bucket(Bucket="data")
        base = Path(tiny_data["tokenizer"]).parent
        for f in [base / "tokenizer.json", *(base / "stories").iterdir(), *(base / "facts").iterdir()]:
            s3.client.upload_file(str(f), "data", f"tiny/{f.relative_to(base)}")
        yield s3
    finally:
        s3.close()


def train(store: LoopbackS3, tmp: Path, sources: str) -> subprocess.CompletedProcess:
    overrides = [f"data.sources={sources}", "data.tokenizer=s3://data/tiny/tokenizer.json", "checkpoint.uri=",
                 "training.steps=3", "logging.interval=1", f"logging.lossesFile={tmp / 'losses.jsonl'}"]
    # a cache of this test's own: another test's copy of the same tokenizer would save the GET
    env = trainer_env(**store.env, TRAINER_STORE_CACHE=str(tmp / "store-cache"))
    return subprocess.run(trainer_cmd(2, overrides), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_throttled_and_failing_store_is_retried_and_the_run_trains_to_the_end(store, tmp_path):
    proxy = store.proxy
    proxy.fail("HEAD", rf"^{TOKENIZER}$", 2, 503, "SlowDown")  # the leader's version lookup
    proxy.fail("GET", rf"^{TOKENIZER}$", 6, 500, "InternalError")  # more than botocore's own tries
    proxy.fail("GET", r"^/data\?.*prefix=tiny%2Fstories", 3, 503, "ServiceUnavailable")  # the listing
    proxy.fail("GET", r"^/data/tiny/facts/part-00000", 2, 503, "SlowDown")  # a shard each rank reads
    res = train(store, tmp_path,
                "[{uri: 's3://data/tiny/stories', weight: 3}, {uri: 's3://data/tiny/facts', weight: 1}]")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "step 3/3" in res.stderr
    assert all(f.answered == f.count for f in proxy.faults), proxy.faults
    # our retry carried the tokenizer read past botocore's and s3fs's
    assert "store: read s3://data/tiny/tokenizer.json failed (InternalError (HTTP 500)" in res.stderr, \
        res.stderr[-4000:]
    # one reader per node: one GET (and one HEAD) of the tokenizer, one look-up per source, for two ranks
    assert proxy.gets(TOKENIZER) == 1 and proxy.forwarded[("HEAD", TOKENIZER)] == 1, proxy.forwarded
    assert proxy.forwarded[("HEAD", "/data/tiny/stories/prepared.json")] == 1, proxy.forwarded
    # each rank reads every raw-text shard itself (raw text is read whole by every rank)
    assert proxy.gets("/data/tiny/facts/part-00000.parquet") == 2, proxy.forwarded


def test_a_bucket_that_does_not_exist_is_fatal_and_names_the_field(store, tmp_path):
    res = train(store, tmp_path, "[{uri: 's3://no-such-bucket/stories'}]")
    assert res.returncode == exitcodes.FATAL, res.stderr[-4000:]
    assert "invalid configuration: data.sources[0].uri:" in res.stderr and "s3://no-such-bucket/stories" in res.stderr
    assert "store: " not in res.stderr, res.stderr[-4000:]  # nothing retried: the store answered
