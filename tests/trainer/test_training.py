"""The real trainer, as processes under torchrun on CPU (tier `trainer` in docs/architecture.md 6)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, data_overrides, kill_tree, read_losses, run_trainer, trainer_cmd, trainer_env
from trainium_api import checkpoints, exitcodes

pytestmark = pytest.mark.trainer


def overrides(tiny, tmp: Path, name: str, *extra: str, prepared: bool = False) -> list[str]:
    return [*data_overrides(tiny, prepared), f"logging.lossesFile={tmp / (name + '.jsonl')}", "logging.interval=1",
            f"checkpoint.uri={tmp / (name + '-ckpt')}", *extra]


def test_tiny_preset_loss_falls(tiny_data, tmp_path):
    res = run_trainer(1, overrides(tiny_data, tmp_path, "fall", "training.steps=100", "checkpoint.intervalSteps=50"))
    assert res.returncode == 0, res.stderr[-3000:]
    losses = read_losses(tmp_path / "fall.jsonl")
    first = losses[1]["loss"]
    last = sum(losses[s]["loss"] for s in range(91, 101)) / 10
    print(f"\nloss: step 1 {first:.3f}, mean of steps 91-100 {last:.3f}")
    assert first > 6.0 and last < 0.25 * first  # ln(512) = 6.24 at the start
    assert checkpoints.newest_complete(str(tmp_path / "fall-ckpt")).step == 100


@pytest.mark.parametrize("step_model", ["eager", "lazy"])
def test_tp2_dp2_zero1_sequence_parallel_matches_single_process(step_model, tiny_data, tmp_path):
    """Four real ranks against one eager process. ``lazy`` runs the Neuron backend's step model
    (update decided on the device, observations one step late, parameters and gradients as
    separate tensors, ZeRO-1 over flat vectors) over gloo with TRAINER_LAZY_STEPS=1: the
    multi-process logic that XLA on CPU cannot run."""
    common = ["training.steps=5", "training.warmupSteps=2", "checkpoint.uri="]
    single = run_trainer(1, overrides(tiny_data, tmp_path, "single", *common))
    assert single.returncode == 0, single.stderr[-3000:]
    par = run_trainer(4, overrides(tiny_data, tmp_path, "par", *common, "parallelism.tensor=2",
                                   "parallelism.sequenceParallel=true", "parallelism.zero1=true"),
                      env=trainer_env(TRAINER_LAZY_STEPS="1" if step_model == "lazy" else "0"))
    assert par.returncode == 0, par.stderr[-3000:]
    a, b = read_losses(tmp_path / "single.jsonl"), read_losses(tmp_path / "par.jsonl")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    for s in a:
        print(f"step {s}: single {a[s]['loss']:.7f} tp2xdp2 ({step_model}) {b[s]['loss']:.7f}; grad norm "
              f"{a[s]['gradNorm']:.7f} {b[s]['gradNorm']:.7f} ({b[s]['gradNorm'] / a[s]['gradNorm'] - 1:+.1e})")
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-4)
        assert b[s]["gradNorm"] == pytest.approx(a[s]["gradNorm"], rel=1e-3)
    # from the same weights only the order of sums differs: the norm holds to fp32 (optim.sum_sq)
    assert b[1]["gradNorm"] == pytest.approx(a[1]["gradNorm"], rel=1e-6)


def _wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited {proc.returncode} before {what}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("layout, prepared", [
    (["parallelism.tensor=2", "parallelism.zero1=true", "parallelism.sequenceParallel=true"], False),
    (["parallelism.pipeline=2", "parallelism.zero1=true"], True),
], ids=["tp2-dp2-zero1-sp", "pp2-dp2-zero1-prepared-data"])
def test_sigkill_during_async_save_then_exact_resume(layout, prepared, tiny_data, tmp_path):
    """Kill every rank after step_6 is complete and while step_9 is being written; the
    restart skips the torn tag, resumes from step_6 and reproduces every later loss bitwise.
    With pipeline stages every stage's shard files (pp_rank_00, pp_rank_01) must be there.
    The pipeline case reads pre-tokenized shards (trainer.data.prepare): each data rank reads only
    its rows, and the position it resumes from is the prepared sources' row counts."""
    common = ["training.steps=12", "checkpoint.intervalSteps=3", *layout]
    ref = run_trainer(4, overrides(tiny_data, tmp_path, "ref", *common, prepared=prepared))
    assert ref.returncode == 0, ref.stderr[-3000:]

    run = overrides(tiny_data, tmp_path, "crash", *common, prepared=prepared)
    ckpt = tmp_path / "crash-ckpt"
    proc = subprocess.Popen(trainer_cmd(4, run), cwd=ROOT, env=trainer_env(TRAINER_FAULT_CKPT_WRITE_DELAY="1.5"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(lambda: (ckpt / "step_6" / "done").exists() and (ckpt / "step_9" / "checkpoint").exists(),
                  240, proc, "step_6 complete and step_9 begun")
        assert not (ckpt / "step_9" / "done").exists()
        kill_tree(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        kill_tree(proc.pid, signal.SIGKILL)
    assert checkpoints.newest_complete(str(ckpt)).tag == "step_6"
    torn = [t for t in checkpoints.list_tags(str(ckpt)) if not t.complete]
    assert [t.tag for t in torn] == ["step_9"]

    losses_file = tmp_path / "crash.jsonl"
    losses_file.unlink()
    again = run_trainer(4, run)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed_line = next((ln for ln in again.stderr.splitlines() if "resumed from" in ln), "")
    assert resumed_line.endswith("step_6 at step 6 (12288 tokens)"), again.stderr[-3000:]
    ref_losses, resumed = read_losses(tmp_path / "ref.jsonl"), read_losses(losses_file)
    assert sorted(resumed) == list(range(7, 13))
    for s in resumed:
        assert resumed[s]["loss"] == ref_losses[s]["loss"], f"step {s} differs"  # bitwise on CPU
        assert resumed[s]["gradNorm"] == ref_losses[s]["gradNorm"]
    assert checkpoints.newest_complete(str(ckpt)).step == 12
    meta = json.loads((ckpt / "step_12" / checkpoints.META).read_text())
    assert all((ckpt / "step_12" / f).exists() for f in meta["files"])
    if prepared:
        assert [set(src) for src in meta["data"]["sources"]] == [{"tokens"}, {"tokens"}]
        assert meta["dataSourceKinds"] == ["prepared", "prepared"]
    if "parallelism.pipeline=2" in layout:
        assert "model/dp_rank_00_tp_rank_00_pp_rank_01.pt" in meta["files"]
        assert "optim/dp_rank_01_tp_rank_00_pp_rank_01.pt" in meta["files"]  # ZeRO-1: per data rank


def test_sigterm_finalizes_the_in_flight_checkpoint(tiny_data, tmp_path):
    run = overrides(tiny_data, tmp_path, "term", "training.steps=400", "checkpoint.intervalSteps=4")
    ckpt = tmp_path / "term-ckpt"
    proc = subprocess.Popen(trainer_cmd(2, run), cwd=ROOT, env=trainer_env(TRAINER_FAULT_CKPT_WRITE_DELAY="2"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(lambda: (ckpt / "step_4" / "checkpoint").exists(), 120, proc, "a save in flight")
        assert not (ckpt / "step_4" / "done").exists()
        kill_tree(proc.pid, signal.SIGTERM)  # what the kubelet does to every process of the pod
        _, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid, signal.SIGKILL)
    assert proc.returncode == exitcodes.TERMINATED, err[-3000:]
    assert (ckpt / "step_4" / "done").exists(), "the in-flight save must be finalized, not abandoned"
    # checkpoint.saveOnStop (the default): the step reached at SIGTERM is saved too, so a
    # restart recomputes nothing
    stopped = int(re.search(r"SIGTERM: stopping after step (\d+), saving it", err).group(1))
    assert checkpoints.newest_complete(str(ckpt)).step == stopped >= 4


@pytest.mark.parametrize("nproc, extra, field", [
    (2, ["parallelism.tensor=2", "model.numHeads=3", "model.hiddenSize=96", "model.numKvHeads=3"], "parallelism.tensor"),
    (2, ["training.globalBatchSize=6", "training.microBatchSize=4"], "training.globalBatchSize"),
    (1, ["data.sources=[{uri: /nonexistent/corpus}]"], "data.sources[0].uri"),
    (1, ["model.preset=llama9-1t"], "model.preset"),
    (1, ["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer"),
])
def test_bad_input_exits_fatal_naming_the_field(tiny_data, tmp_path, nproc, extra, field):
    res = run_trainer(nproc, [*data_overrides(tiny_data), "checkpoint.uri=", *extra])
    assert res.returncode == exitcodes.FATAL, res.stderr[-3000:]
    assert f"invalid configuration: {field}:" in res.stderr


@pytest.mark.parametrize("extra", [
    ["training.precision=bf16-sr"],
    ["training.precision=mixed"],
    ["model.family=neox", "model.rotaryPct=0.25", "model.numKvHeads=4"],
    ["parallelism.activationCheckpointing=selective", "training.precision=bf16-sr"],
], ids=["bf16-sr", "mixed", "neox", "selective-ckpt"])
def test_precisions_and_families_train(tiny_data, tmp_path, extra):
    # one micro-batch a step (the default is four): bf16 on a CPU without bf16 instructions is
    # emulated and several times slower, and what is tested is that the loss falls, not how fast
    res = run_trainer(1, overrides(tiny_data, tmp_path, "v", "training.steps=40", "training.globalBatchSize=4",
                                   "checkpoint.uri=", *extra))
    assert res.returncode == 0, res.stderr[-3000:]
    losses = read_losses(tmp_path / "v.jsonl")
    print(f"\n{extra}: loss {losses[1]['loss']:.3f} -> {losses[40]['loss']:.3f}")
    assert losses[40]["loss"] < losses[1]["loss"] - 1.5


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_guard(tiny_data, tmp_path, policy):
    """An absurd learning rate without clipping drives the loss to inf/NaN within a few steps."""
    res = run_trainer(1, overrides(tiny_data, tmp_path, "nan", "training.steps=12", "checkpoint.uri=",
                                   "training.lr=1.0e+6", "training.minLr=0", "training.warmupSteps=0",
                                   "training.gradClip=0", f"health.nanPolicy={policy}"))
    if policy == "stop":
        assert res.returncode == exitcodes.FATAL and "health.nanPolicy=stop" in res.stderr, res.stderr[-2000:]
    else:
        assert res.returncode == 0 and "update skipped" in res.stderr, res.stderr[-2000:]


def test_tensorboard_that_cannot_be_written_never_stops_training(tiny_data, tmp_path):
    """A TensorBoard folder the trainer cannot create (here under /proc; on a cluster a read-only
    or missing volume) is reported once and left off: the run trains to its end. A relative path
    is refused at load, naming the field."""
    res = run_trainer(1, overrides(tiny_data, tmp_path, "tb", "training.steps=3", "checkpoint.uri=",
                                   "logging.tensorboard=/proc/no-such-folder/tb"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "TensorBoard logging to /proc/no-such-folder/tb is off" in res.stderr
    res = run_trainer(1, overrides(tiny_data, tmp_path, "tb", "training.steps=3", "logging.tensorboard=runs/tb"))
    assert res.returncode == exitcodes.FATAL and "logging.tensorboard" in res.stderr, res.stderr[-2000:]


def test_changed_data_sources_are_refused_at_resume_unless_allowed(tiny_data, tmp_path):
    """A checkpoint's data positions belong to the sources it was written with: resuming with
    another source list (a weight, a URI or a prefix changed) or another tokenizer is refused,
    naming the field, unless data.allowChangedSources says to read the new data from its start."""
    base = overrides(tiny_data, tmp_path, "d", "training.steps=2", "checkpoint.intervalSteps=2")
    assert run_trainer(1, base).returncode == 0
    # a weight is not the source list: the positions stay valid, the resume goes on
    reweighted = [f"data.sources=[{{uri: {tiny_data['stories']}/, weight: 1}}, {{uri: {tiny_data['facts']}, weight: 1}}]"]
    res = run_trainer(1, [*base, "training.steps=3", "checkpoint.intervalSteps=3", *reweighted])
    assert res.returncode == 0 and "resumed from" in res.stderr, res.stderr[-3000:]
    # one source swapped for another (the same count): refused, naming the field
    swapped = [f"data.sources=[{{uri: {tiny_data['stories']}, weight: 3}}, {{uri: {tiny_data['stories']}, weight: 1}}]"]
    res = run_trainer(1, [*base, "training.steps=4", *swapped])
    assert res.returncode == exitcodes.FATAL, res.stderr[-3000:]
    assert "data.sources: checkpoint step_3 was written with" in res.stderr and "allowChangedSources" in res.stderr
    res = run_trainer(1, [*base, "training.steps=4", "data.packing=false"])
    assert res.returncode == exitcodes.FATAL and "data.packing: checkpoint step_3" in res.stderr, res.stderr[-3000:]
    res = run_trainer(1, [*base, "training.steps=4", *swapped, "data.allowChangedSources=true"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stderr and "the new data is read from its beginning" in res.stderr
    assert sorted(read_losses(tmp_path / "d.jsonl")) == [1, 2, 3, 4]


def test_tied_embeddings_train_with_zero1_and_resume_exactly(tiny_data, tmp_path):
    """model.tieEmbeddings (Llama 3.2 1B/3B): one parameter for the embedding and the head, sharded
    by ZeRO-1 over 2 data-parallel ranks, saved and resumed: the resumed losses equal the
    uninterrupted run's bitwise."""
    tied = ['model={"preset": "tiny", "tieEmbeddings": true}', "parallelism.zero1=true", "training.microBatchSize=2",
            "checkpoint.intervalSteps=3"]
    full = run_trainer(2, overrides(tiny_data, tmp_path, "full", *tied, "training.steps=6"))
    assert full.returncode == 0, full.stderr[-3000:]
    for steps in (3, 6):
        part = run_trainer(2, overrides(tiny_data, tmp_path, "part", *tied, f"training.steps={steps}"))
        assert part.returncode == 0, part.stderr[-3000:]
    a, b = read_losses(tmp_path / "full.jsonl"), read_losses(tmp_path / "part.jsonl")
    assert [a[s]["loss"] for s in (4, 5, 6)] == [b[s]["loss"] for s in (4, 5, 6)]


@pytest.mark.parametrize("model", ["qwen3-like", "qwen2-like"])
def test_newer_family_features_at_tp2_match_one_process(model, tiny_data, tmp_path):
    """Llama 3.1's scaled RoPE, Qwen2's q/k/v biases, Qwen3's q/k norms and head size, and a tied
    head, at TP 2 against one process, step by step: each rank normalises only its own heads, so
    the q/k norms' gradients are summed over the TP group (without it the copies drift apart by
    step 3, relative 1e-4 in the gradient norm and growing)."""
    from tests.nxd.test_nxd_cpu_mode import MODERN
    steps = ["training.steps=4", "training.warmupSteps=2", "checkpoint.uri="]
    one = run_trainer(1, overrides(tiny_data, tmp_path, "one", *MODERN[model], *steps))
    two = run_trainer(2, overrides(tiny_data, tmp_path, "two", *MODERN[model], *steps, "parallelism.tensor=2"))
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    a, b = read_losses(tmp_path / "one.jsonl"), read_losses(tmp_path / "two.jsonl")
    for s in (1, 2, 3, 4):
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-6)
        assert b[s]["gradNorm"] == pytest.approx(a[s]["gradNorm"], rel=1e-4)


@pytest.mark.parametrize("before, after", [((2, True), (1, False)), ((1, False), (2, True))],
                         ids=["dp2-zero1-to-dp1", "dp1-to-dp2-zero1"])
def test_resume_at_another_data_parallel_degree(before, after, tiny_data, tmp_path):
    """A run checkpointed at one data-parallel degree resumes at another (a node pool shrank or
    grew): the model files are per (tensor, pipeline) rank and the optimizer's ZeRO-1 slices
    are re-cut with the same moments (tests/unit/test_optim_reshard.py). From the checkpoint on,
    the losses are an uninterrupted run's at the new degree, to the tolerance of a degree change
    (the order of the gradient sums)."""
    def run(name: str, dp_zero1, steps: int, uri: Path):
        dp, zero1 = dp_zero1
        res = run_trainer(dp, overrides(tiny_data, tmp_path, name, f"training.steps={steps}", "training.warmupSteps=2",
                                        f"parallelism.zero1={str(zero1).lower()}", f"checkpoint.uri={uri}",
                                        "checkpoint.intervalSteps=3"))
        assert res.returncode == 0, res.stderr[-3000:]
        return res
    run("moved", before, 3, tmp_path / "moved-ckpt")
    resumed = run("moved", after, 6, tmp_path / "moved-ckpt")
    assert "at step 3" in resumed.stderr and "resharded from" in resumed.stderr
    run("still", after, 6, tmp_path / "still-ckpt")
    a, b = read_losses(tmp_path / "moved.jsonl"), read_losses(tmp_path / "still.jsonl")
    for s in (4, 5, 6):
        print(f"step {s}: resumed at the new degree {a[s]['loss']:.7f}, uninterrupted there {b[s]['loss']:.7f}")
        assert a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-4)


@pytest.fixture(scope="module")
def tp2_dp2_checkpoint(tiny_data, tmp_path_factory):
    """A run at TP 2 x DP 2 with ZeRO-1, checkpointed at step 3."""
    tmp = tmp_path_factory.mktemp("tp2dp2")
    res = run_trainer(4, overrides(tiny_data, tmp, "source", "training.steps=3", "training.warmupSteps=2",
                                   "parallelism.tensor=2", "parallelism.zero1=true", f"checkpoint.uri={tmp / 'ckpt'}",
                                   "checkpoint.intervalSteps=3"))
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp / "ckpt"


@pytest.mark.parametrize("target, layout, reshard", [
    ("tp1-dp2", ["parallelism.tensor=1"], ["--tensor", "1"]),
    ("tp2-dp1", ["parallelism.tensor=2"], None),  # a data-parallel change alone: resharded on load
    ("tp1-pp2", ["parallelism.pipeline=2"], ["--tensor", "1", "--pipeline", "2"]),
])
def test_a_tp2_dp2_checkpoint_resumes_at_other_degrees(target, layout, reshard, tp2_dp2_checkpoint, tiny_data,
                                                         tmp_path):
    """issue 47: TP 2 x DP 2 -> TP 1 x DP 2, TP 2 x DP 1 and TP 1 x PP 2. With other tensor or
    pipeline degrees, trainer.checkpoint.convert reshard writes a new tag whose weights and
    optimizer moments, merged, equal the original's bitwise; the resumed losses equal an
    uninterrupted run at the new layout to the tolerance of a layout change."""
    import torch

    from trainer.checkpoint import reshard as reshard_module
    from trainer.checkpoint.tags import _fs, read_tag
    from trainer.model.hf import merge_to_hf

    import shutil

    uri = tmp_path / "copy"  # the resumed run writes on: the module's checkpoint stays at step 3
    shutil.copytree(tp2_dp2_checkpoint, uri)
    if reshard is not None:
        out = tmp_path / "resharded"
        conv = subprocess.run([sys.executable, "-m", "trainer.checkpoint.convert", "reshard", str(uri / "step_3"), str(out),
                               *reshard], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert conv.returncode == 0, conv.stderr
        uri = out

        def merged(tag):
            meta, cfg, shards = read_tag(str(tag))
            fs, path = _fs(str(tag))
            olds = [reshard_module._old_rank(fs, path, meta, r, s) for r, s in enumerate(shards)]
            return [merge_to_hf(shards, cfg), merge_to_hf([o[1] for o in olds], cfg),
                    merge_to_hf([o[2] for o in olds], cfg)]
        for a, b in zip(merged(tp2_dp2_checkpoint / "step_3"), merged(out / "step_3")):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        meta = json.loads((out / "step_3" / "meta.json").read_text())
        assert "writer" not in meta and meta["reshardedFrom"]["layout"]["tensor"] == 2
        assert all((out / "step_3" / f).exists() for f in meta["files"])  # its own layout's files
        source = tmp_path / "copy" / "step_3"
        again = subprocess.run([sys.executable, "-m", "trainer.checkpoint.convert", "reshard", str(source),
                                str(out), *reshard], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert again.returncode == 2 and "exists" in again.stderr
        # a tag without done that no reshard of this source is writing (a run's save in progress):
        # never deleted
        (out / "step_3" / checkpoints.DONE).unlink()
        again = subprocess.run([sys.executable, "-m", "trainer.checkpoint.convert", "reshard", str(source),
                                str(out), *reshard], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert again.returncode == 2 and "is not an unfinished reshard" in again.stderr, again.stderr
        # a reshard of this source interrupted before its done (a drain, out of memory) is started over
        (out / "step_3" / reshard_module.RESHARDING).write_text(str(source))
        cut = next((out / "step_3" / "model").iterdir())
        cut.write_bytes(cut.read_bytes()[:100])
        again = subprocess.run([sys.executable, "-m", "trainer.checkpoint.convert", "reshard", str(source),
                                str(out), *reshard], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert again.returncode == 0 and "unfinished reshard" in again.stdout, again.stderr
        assert (out / "step_3" / checkpoints.DONE).exists()
        if target == "tp1-dp2":  # a damaged tag is refused, not laundered into a new whole one
            (source / checkpoints.DAMAGED).write_text('{"reason": "test"}')
            bad = subprocess.run([sys.executable, "-m", "trainer.checkpoint.convert", "reshard", str(source),
                                  str(tmp_path / "laundered"), *reshard], capture_output=True, text=True, cwd=ROOT,
                                 timeout=300)
            assert bad.returncode == 2 and "marked damaged" in bad.stderr
            (source / checkpoints.DAMAGED).unlink()
    common = ["training.steps=6", "training.warmupSteps=2", "checkpoint.intervalSteps=3", *layout]
    resumed = run_trainer(2, overrides(tiny_data, tmp_path, "moved", *common, f"checkpoint.uri={uri}"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 3" in resumed.stderr
    still = run_trainer(2, overrides(tiny_data, tmp_path, "still", *common, f"checkpoint.uri={tmp_path / 'still'}"))
    assert still.returncode == 0, still.stderr[-3000:]
    a, b = read_losses(tmp_path / "moved.jsonl"), read_losses(tmp_path / "still.jsonl")
    for s in (4, 5, 6):
        print(f"{target} step {s}: resumed {a[s]['loss']:.7f}, uninterrupted at this layout {b[s]['loss']:.7f}")
        assert a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-4)
