"""logging.tensorboard's writer (trainer.loop.tensorboard), read back by TensorBoard's own reader
(its EventAccumulator, the code behind `tensorboard --logdir`)."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import fsspec
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.loop import tensorboard as tb
from trainer.loop.tensorboard import ScalarLog


def read(logdir) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.fixture(autouse=True)
def own_staging(tmp_path, monkeypatch):
    """Each test's staging folders (named after the URL, under the temporary directory) its own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fsspec.filesystem("memory").store.clear()


def uploaded(log: ScalarLog) -> None:
    """Wait until the uploader has done every job queued so far."""
    import threading
    done = threading.Event()
    log._jobs.put(([], done))
    assert done.wait(10)


def test_scalars_written_locally_read_back_by_tensorboard(tmp_path):
    log = ScalarLog(str(tmp_path / "tb"), first_step=1)
    for step in range(1, 6):
        log.scalars(step, {tb.LOSS: 10.0 - step, tb.MFU: None, tb.LEARNING_RATE: step * 1e-4}, walltime=1e9 + step)
    log.scalars(5, {tb.EVAL_PERPLEXITY: 42.5})
    log.close()
    got = read(tmp_path / "tb")
    assert got[tb.LOSS] == {s: 10.0 - s for s in range(1, 6)}
    assert got[tb.LEARNING_RATE] == pytest.approx({s: s * 1e-4 for s in range(1, 6)})
    assert got[tb.EVAL_PERPLEXITY] == {5: 42.5}
    assert tb.MFU not in got  # a value the device could not give is left out, not written as 0


def test_a_resumed_process_replaces_the_steps_it_trains_again(tmp_path):
    """Attempt 1 logs steps 1-8 and dies; attempt 2 resumed from the checkpoint at step 5 logs
    6-9 again (other values): TensorBoard shows 1-5 from the first and 6-9 from the second, once."""
    first = ScalarLog(str(tmp_path), first_step=1)
    for step in range(1, 9):
        first.scalars(step, {tb.LOSS: float(step)})
    first.close()
    second = ScalarLog(str(tmp_path), first_step=6)
    for step in range(6, 10):
        second.scalars(step, {tb.LOSS: 100.0 + step})
    second.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    shown = [(e.step, e.value) for e in acc.Scalars(tb.LOSS)]  # in order, duplicates kept
    assert shown == [(s, float(s)) for s in range(1, 6)] + [(s, 100.0 + s) for s in range(6, 10)]


def test_a_remote_store_gets_closed_files_and_a_failing_upload_is_kept_and_retried(tmp_path, monkeypatch):
    """A non-local URL (fsspec's in-memory filesystem, standing in for S3: the trainer's S3 path is
    the same fsspec call, run against a real S3 server in tests/trainer/test_s3.py) is written
    through a staging folder; uploads fail for a while and nothing is lost."""
    remote = "memory://tb-run"
    fs = fsspec.filesystem("memory")
    log = ScalarLog(remote, first_step=1, roll_seconds=0)  # roll at every call
    real_put = type(log.fs).put_file
    failing = {"on": True}
    order = []

    def put_file(self, lpath, rpath, **kw):
        if failing["on"]:
            raise OSError("injected: store unreachable")
        order.append(os.path.basename(rpath))
        return real_put(self, lpath, rpath, **kw)

    monkeypatch.setattr(type(log.fs), "put_file", put_file)
    for step in range(1, 4):
        log.scalars(step, {tb.LOSS: float(step)})
    uploaded(log)  # the uploads so far have run (and failed)
    assert not fs.exists("/tb-run") or fs.ls("/tb-run", detail=False) == []
    failing["on"] = False
    for step in range(4, 6):
        log.scalars(step, {tb.LOSS: float(step)})
    staging = log.staging
    log.close()
    local = tmp_path / "downloaded"
    local.mkdir()
    names = fs.ls("/tb-run", detail=False)
    assert len(names) >= 2
    for name in names:
        (local / name.rsplit("/", 1)[1]).write_bytes(fs.cat_file(name))
    assert read(local)[tb.LOSS] == {s: float(s) for s in range(1, 6)}
    assert os.listdir(staging) == []  # every staged file uploaded
    assert order == sorted(order)  # oldest first: a file never reaches the store before an older one


def test_bad_uris_are_refused_with_the_field_named():
    from trainium_api.fields import ConfigError
    from trainium_api.spec import LoggingConfig
    # as checkpoint.uri: the pods write it, so no other protocol (http://169.254.169.254/...)
    for uri in ("runs/tb", "nosuch://b/p", "s3://", "http://169.254.169.254/latest", "memory://x"):
        with pytest.raises(ConfigError, match="must be s3://BUCKET") as err:
            LoggingConfig(tensorboard=uri).validate()
        assert err.value.field == "logging.tensorboard"
    for uri in ("", "/mnt/tb/run", "s3://bucket/tb/run"):
        LoggingConfig(tensorboard=uri).validate()


def test_a_write_that_fails_turns_logging_off_and_training_goes_on(tmp_path, caplog):
    log = ScalarLog(str(tmp_path / "tb"), first_step=1)
    log.scalars(1, {tb.LOSS: 1.0})

    def full(*a, **kw):
        raise OSError(28, "No space left on device")
    log.writer.add_scalar = full
    log.scalars(2, {tb.LOSS: 2.0})  # no exception: the step goes on
    assert log.broken and "stopped" in caplog.text and "No space left" in caplog.text
    log.scalars(3, {tb.LOSS: 3.0})
    log.persist()
    log.close()


def test_the_end_waits_for_a_store_that_does_not_answer_at_most_close_seconds(monkeypatch):
    monkeypatch.setattr(tb, "CLOSE_SECONDS", 0.5)
    log = ScalarLog("memory://tb-hung", first_step=1)
    hung = threading.Event()
    monkeypatch.setattr(type(log.fs), "put_file", lambda self, *a, **kw: hung.wait(60))
    log.scalars(1, {tb.LOSS: 1.0})
    started = time.monotonic()
    log.close()
    assert time.monotonic() - started < 5
    assert os.listdir(log.staging)  # kept for a later process in this container
    hung.set()


def test_a_process_started_after_a_crash_uploads_what_the_last_one_left(tmp_path):
    fs = fsspec.filesystem("memory")
    first = ScalarLog("memory://tb-crash", first_step=1)
    real_put = type(first.fs).put_file
    type(first.fs).put_file = lambda self, *a, **kw: (_ for _ in ()).throw(OSError("down"))
    try:
        for step in range(1, 4):
            first.scalars(step, {tb.LOSS: float(step)})
        first.rolled_at -= tb.PERSIST_SECONDS
        first.persist()  # a checkpoint: the file closed, its upload fails
        uploaded(first)
    finally:
        type(first.fs).put_file = real_put
    # (the first process dies here, never closed); the next one, in the same container, resumes at 2
    second = ScalarLog("memory://tb-crash", first_step=3)
    second.scalars(3, {tb.LOSS: 30.0})
    second.close()
    names = fs.ls("/tb-crash", detail=False)
    assert len(names) == 2 and os.listdir(second.staging) == []
    local = tmp_path / "downloaded"
    local.mkdir()
    for name in names:
        (local / name.rsplit("/", 1)[1]).write_bytes(fs.cat_file(name))
    assert read(local)[tb.LOSS] == {1: 1.0, 2: 2.0, 3: 30.0}  # step 3 as trained again
