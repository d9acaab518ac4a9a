"""logging.tensorboard's writer (trainer.loop.tensorboard), read back by TensorBoard's own reader
(its EventAccumulator, the code behind `tensorboard --logdir`)."""

from __future__ import annotations

import os

import fsspec
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.loop import tensorboard as tb
from trainer.loop.tensorboard import ScalarLog


def read(logdir) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


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

    def put_file(self, lpath, rpath, **kw):
        if failing["on"]:
            raise OSError("injected: store unreachable")
        return real_put(self, lpath, rpath, **kw)

    monkeypatch.setattr(type(log.fs), "put_file", put_file)
    for step in range(1, 4):
        log.scalars(step, {tb.LOSS: float(step)})
    log.uploads.submit(lambda: None).result()  # the uploads so far have run (and failed)
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
    assert not os.path.exists(staging)  # every staged file uploaded, the staging folder gone
