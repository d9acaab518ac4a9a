"""Pipeline parallelism on the PyTorch backend (trainer.model.pipeline): real ranks under torchrun
on CPU, each layout against one process training the same global batch, step by step."""

from __future__ import annotations

import pytest

from tests.conftest import eval_losses, held_out, read_losses, run_trainer
from tests.trainer.test_training import overrides
from trainium_api import exitcodes

pytestmark = pytest.mark.trainer

COMMON = ["training.steps=6", "training.warmupSteps=2", "checkpoint.uri=", "data.evalIntervalSteps=3"]


@pytest.fixture(scope="module")
def single_process(tiny_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp-single")
    res = run_trainer(1, overrides(tiny_data, tmp, "single", *COMMON, held_out(tiny_data)))
    assert res.returncode == 0, res.stderr[-3000:]
    return read_losses(tmp / "single.jsonl"), eval_losses(tmp / "single.jsonl")


@pytest.mark.parametrize("layout", [
    ["parallelism.pipeline=2", "parallelism.tensor=2", "parallelism.sequenceParallel=true"],
    ["parallelism.pipeline=2", "parallelism.zero1=true"],
    ["parallelism.tensor=4", "parallelism.sequenceParallel=true"],
], ids=["pp2-tp2-sp", "pp2-dp2-zero1", "tp4-kv-replicated"])
def test_layout_matches_single_process(layout, single_process, tiny_data, tmp_path):
    """4 ranks against one process. Pipeline: two stages of two layers each, 1F1B over the
    accumulation micro-batches (4 with tp2, 2 with dp2). tp4: the tiny model's 2 key/value
    heads are each held by 2 ranks (Llama 2 70B's 8 heads at TP 32 the same way). Losses,
    global gradient norms and held-out losses equal the single process's within float
    tolerance at every step."""
    res = run_trainer(4, overrides(tiny_data, tmp_path, "pp", *COMMON, held_out(tiny_data), *layout))
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("pp=2" in res.stderr) == ("parallelism.pipeline=2" in layout)
    ref, ref_eval = single_process
    got, got_eval = read_losses(tmp_path / "pp.jsonl"), eval_losses(tmp_path / "pp.jsonl")
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5, 6]
    for s in ref:
        print(f"step {s}: single {ref[s]['loss']:.7f} {layout[1]} {got[s]['loss']:.7f}  "
              f"grad norm {ref[s]['gradNorm']:.6f} / {got[s]['gradNorm']:.6f}")
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-4)
        assert got[s]["gradNorm"] == pytest.approx(ref[s]["gradNorm"], rel=1e-3)
    assert sorted(got_eval) == sorted(ref_eval) == [3, 6]
    for s in ref_eval:
        assert got_eval[s] == pytest.approx(ref_eval[s], rel=1e-4)


@pytest.mark.parametrize("extra, field", [
    (["parallelism.pipeline=3"], "parallelism.tensor"),  # 3 does not divide the 2 ranks
    (["parallelism.pipeline=2", "model.numLayers=3"], "parallelism.pipeline"),
    (["parallelism.pipeline=2", "training.globalBatchSize=4", "training.microBatchSize=4"],
     "training.globalBatchSize"),  # one micro-batch: too few for a 2-stage 1F1B
])
def test_bad_pipeline_settings_exit_fatal_naming_the_field(extra, field, tiny_data):
    from tests.conftest import data_overrides
    res = run_trainer(2, [*data_overrides(tiny_data), "checkpoint.uri=", *extra])
    assert res.returncode == exitcodes.FATAL, res.stderr[-3000:]
    assert f"invalid configuration: {field}:" in res.stderr


def test_pipeline_checkpoint_merges_into_hugging_face_weights(tiny_data, tmp_path):
    """A PP 2 x TP 2 checkpoint (four model shard files) read back whole (convert.read_tag,
    which trainer.checkpoint.convert and trainer.loop.evaluate use) equals one process's, tensor for tensor.
    A learning rate of 1e-30 (below float32 resolution of the weights) keeps them at their
    identical initial values, so the comparison is exact: it checks the shard layout, not float agreement (the loss tests do that)."""
    import torch

    from trainer.checkpoint import convert
    from trainer.model import hf
    steps = ["training.steps=3", "training.warmupSteps=1", "checkpoint.intervalSteps=3", "training.lr=1.0e-30",
             "training.minLr=1.0e-30"]
    single = run_trainer(1, overrides(tiny_data, tmp_path, "one", *steps))
    assert single.returncode == 0, single.stderr[-3000:]
    staged = run_trainer(4, overrides(tiny_data, tmp_path, "pp", *steps, "parallelism.pipeline=2",
                                      "parallelism.tensor=2"))
    assert staged.returncode == 0, staged.stderr[-3000:]
    meta, cfg, shards = convert.read_tag(str(tmp_path / "pp-ckpt" / "step_3"))
    assert meta["layout"]["pipeline"] == 2 and len(meta["files"]) == 2 * 4 + 3
    got = hf.merge_to_hf(shards, cfg)
    _, _, one = convert.read_tag(str(tmp_path / "one-ckpt" / "step_3"))
    want = hf.merge_to_hf(one, cfg)
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_bubble_benchmark_runs(tmp_path):
    """bench.pipeline_bubble end to end on its smallest configuration (figures in bench/README.md;
    nothing about speed is asserted here)."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    res = subprocess.run([sys.executable, "-m", "bench.pipeline_bubble", "--configs", "2x2", "--forward-ms", "5",
                          "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    row = next(line for line in res.stdout.splitlines() if line.startswith("|      2 |"))
    bubble, bound = (float(row.split("|")[i]) for i in (5, 6))
    assert bound == pytest.approx(1 / 3, abs=1e-3) and 0 < bubble < 1
