"""A damaged newest checkpoint: the real trainer, two ranks under torchrun on CPU (data parallel,
ZeRO-1, so each rank reads an optimizer shard of its own). A run saves step_4 and step_8; step_8
is damaged (a shard cut short, or deleted); the restart finds it, every rank falls back to step_4
together, the bad tag stays in the store, and the losses after the resume are bitwise those of
the uninterrupted run. With every complete tag damaged the trainer exits retryable and trains
nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import data_overrides, read_losses, run_trainer
from trainer.checkpoint import ckpt_store
from trainium_api import checkpoints, exitcodes

pytestmark = pytest.mark.trainer

# decaySteps fixed: the restart trains to step 7, and its learning rates must be the first run's
COMMON = ["logging.interval=1", "checkpoint.intervalSteps=4", "training.warmupSteps=2", "training.decaySteps=20",
          "parallelism.zero1=true"]
RANK1_OPTIM = f"optim/{ckpt_store.shard_name(1, 0)}"  # read by rank 1 only
MODEL = f"model/{ckpt_store.shard_name(0, 0)}"  # read by both ranks


def _run(tiny, tmp: Path, name: str, ckpt: Path, steps: int):
    return run_trainer(2, [*data_overrides(tiny), *COMMON, f"training.steps={steps}", f"checkpoint.uri={ckpt}",
                           f"logging.lossesFile={tmp / (name + '.jsonl')}"])


@pytest.fixture(scope="module")
def first_run(tiny_data, tmp_path_factory) -> tuple[Path, dict]:
    """Eight steps, uninterrupted, saving step_4 and step_8: the store each case damages a copy
    of, and the losses every resume must reproduce."""
    tmp = tmp_path_factory.mktemp("damaged")
    res = _run(tiny_data, tmp, "first", tmp / "ckpt", 8)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [t.tag for t in checkpoints.list_tags(str(tmp / "ckpt")) if t.complete] == ["step_4", "step_8"]
    return tmp / "ckpt", read_losses(tmp / "first.jsonl")


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage, file, why", [
    (_truncate, RANK1_OPTIM, f"rank 1: {RANK1_OPTIM} is "),  # only rank 1 sees it: both fall back
    (Path.unlink, MODEL, f"rank 0: {MODEL} is missing"),
], ids=["truncated-shard", "deleted-shard"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(first_run, tiny_data, tmp_path, damage, file,
                                                                    why):
    src, first = first_run
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    damage(ckpt / "step_8" / file)

    res = _run(tiny_data, tmp_path, "again", ckpt, 7)  # resumes at 4, trains 5-7, saves step_7
    assert res.returncode == 0, res.stderr[-3000:]
    warning = next((ln for ln in res.stderr.splitlines() if "checkpoint step_8 is damaged" in ln), "")
    assert why in warning and "falling back to step_4" in warning, res.stderr[-3000:]
    resumed = next((ln for ln in res.stderr.splitlines() if "resumed from" in ln), "")
    assert resumed.endswith("step_4 at step 4 (8192 tokens)"), res.stderr[-3000:]
    again = read_losses(tmp_path / "again.jsonl")
    assert sorted(again) == [5, 6, 7]
    for s in again:
        assert again[s]["loss"] == first[s]["loss"], f"step {s} differs"  # bitwise on CPU
        assert again[s]["gradNorm"] == first[s]["gradNorm"]
    # the bad tag is left where it was, damage and all, marked damaged (why, in its `damaged`
    # file): not complete any more, neither kept nor deleted by retention (keep 2: step_4, step_7)
    assert (ckpt / "step_8" / checkpoints.DONE).exists()
    assert (ckpt / "step_8" / file).exists() == (damage is _truncate)
    tags = checkpoints.list_tags(str(ckpt))
    assert [t.tag for t in tags if t.complete] == ["step_4", "step_7"] and [t.tag for t in tags if t.damaged] == \
        ["step_8"]
    assert why in (ckpt / "step_8" / checkpoints.DAMAGED).read_text()


def test_every_complete_checkpoint_damaged_exits_retryable_and_trains_nothing(first_run, tiny_data, tmp_path):
    src, _ = first_run
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    for tag in ("step_4", "step_8"):
        (ckpt / tag / MODEL).unlink()
    res = _run(tiny_data, tmp_path, "none", ckpt, 8)
    assert res.returncode == exitcodes.RETRYABLE, res.stderr[-3000:]
    assert f"no complete checkpoint under {ckpt} loads: step_8 (rank 0: {MODEL} is missing); step_4 (" \
        in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "none.jsonl").exists() or not read_losses(tmp_path / "none.jsonl")
    tags = checkpoints.list_tags(str(ckpt))  # every tag left, each marked damaged
    assert [t.tag for t in tags if t.damaged] == ["step_4", "step_8"] and not [t for t in tags if t.complete]
    assert all((ckpt / t.tag / checkpoints.DONE).exists() for t in tags)
