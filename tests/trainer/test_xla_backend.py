"""The Neuron backend's loop on torch-xla's CPU device (backend ``xla``, one process).

What these tests run for real: the lazy-tensor training loop the Neuron backend uses (the model
and optimizer on the XLA device, one graph per step cut by ``torch_xla.sync()``, host reads
deferred to a step closure one step later, clipping and the non-finite skip on the device),
the host copy of an asynchronous checkpoint, and exact resume. What they cannot run: NxD's
parallel layers and process groups, and anything across processes (torch-xla's CPU
collectives do nothing across processes, so no multi-process XLA test is written; the rank
logic is tested with gloo in test_training.py).

Tolerance against the CPU backend: losses within 1e-5 relative and gradient norms within 1e-3
(measured: 5e-7 and 5e-5 over 8 steps). XLA's CPU kernels sum in another order than ATen's,
so bitwise equality is expected only between XLA runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import data_overrides, read_losses, run_trainer
from trainer.checkpoint import ckpt_store
from trainium_api import checkpoints

pytest.importorskip("torch_xla", reason="torch-xla is part of the dev install (pip install -e .[dev])")
pytestmark = pytest.mark.trainer

XLA_ENV = {"PJRT_DEVICE": "CPU"}
STEPS = 8


def _run(tiny, tmp: Path, name: str, backend: str, *extra: str, ckpt: str | None = None):
    args = [*data_overrides(tiny), f"backend={backend}", f"logging.lossesFile={tmp / (name + '.jsonl')}",
            "logging.interval=1", f"training.steps={STEPS}",
            f"checkpoint.uri={tmp / (ckpt or name + '-ckpt')}", "checkpoint.intervalSteps=3", "checkpoint.keep=0",
            *extra]
    res = run_trainer(1, args, env={**os.environ, **XLA_ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert res.returncode == 0, res.stderr[-4000:]
    return read_losses(tmp / (name + ".jsonl")), res


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """Uninterrupted 8-step runs of the same config on the CPU backend and on XLA."""
    tmp = tmp_path_factory.mktemp("xla-ref")
    cpu, _ = _run(tiny_data, tmp, "cpu", "cpu")
    xla, res = _run(tiny_data, tmp, "xla", "xla")
    return {"cpu": cpu, "xla": xla, "tmp": tmp, "xla_log": res.stderr}


def test_xla_loop_matches_cpu_backend(reference):
    cpu, xla = reference["cpu"], reference["xla"]
    assert sorted(xla) == sorted(cpu) == list(range(1, STEPS + 1))
    for s in cpu:
        print(f"step {s}: cpu {cpu[s]['loss']:.7f} xla {xla[s]['loss']:.7f}  "
              f"grad norm cpu {cpu[s]['gradNorm']:.5f} xla {xla[s]['gradNorm']:.5f}")
        assert xla[s]["loss"] == pytest.approx(cpu[s]["loss"], rel=1e-5)
        assert xla[s]["gradNorm"] == pytest.approx(cpu[s]["gradNorm"], rel=1e-3)
    assert "backend xla" in reference["xla_log"]
    # Checkpoints of the XLA run (async, host copies of device tensors) completed.
    assert [t.step for t in checkpoints.list_tags(str(reference["tmp"] / "xla-ckpt")) if t.complete] == [3, 6, 8]


def _nxd_pick(root: Path) -> str:
    """Stand-in for NxD's ``load_checkpoint(tag=None)`` tag choice, which cannot be imported
    here: the completed tag (has ``done``) whose ``done`` file is newest by modification time
    (neuronx_distributed/trainer/checkpoint_storage.py, list_completed_checkpoint_tags, and
    checkpoint.py, load_checkpoint). It proves only that our layout meets that rule."""
    done = sorted(root.glob("*/done"), key=lambda p: p.stat().st_mtime)
    return done[-1].parent.name


def test_xla_exact_resume_and_one_answer_to_which_checkpoint(reference, tiny_data, tmp_path):
    """Stop at step 6 (checkpoints 3 and 6), leave a torn step_7 behind as a killed async save
    would, resume on XLA: the trainer, the operator's reader and NxD's rule pick step_6, and
    steps 7-8 reproduce the uninterrupted XLA run bitwise."""
    first, _ = _run(tiny_data, tmp_path, "part1", "xla", "training.steps=6", "training.decaySteps=6", ckpt="ckpt")
    root = tmp_path / "ckpt"
    torn = root / checkpoints.tag_for_step(7)
    (torn / "model").mkdir(parents=True)
    (torn / checkpoints.BEGIN).write_text("")
    (torn / "model" / ckpt_store.shard_name(0, 0)).write_bytes(b"half a shard")

    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.config import CheckpointConfig
    one_process = SimpleNamespace(rank=0, is_distributed=False)  # the parallel state of a single process
    trainer_pick = Checkpointer(CheckpointConfig(uri=str(root)), one_process).select_resume()
    operator_pick = checkpoints.newest_complete(str(root))
    assert trainer_pick.tag == operator_pick.tag == _nxd_pick(root) == "step_6"

    resumed, res = _run(tiny_data, tmp_path, "part2", "xla", "training.decaySteps=6", ckpt="ckpt")
    assert "resumed from" in res.stderr and "at step 6" in res.stderr
    assert sorted(resumed) == [7, 8]
    xla = reference["xla"]
    for s in (7, 8):
        print(f"step {s}: uninterrupted {xla[s]['loss']!r} resumed {resumed[s]['loss']!r}")
    # decaySteps pins the schedule of both halves to the reference's.
    assert [resumed[s]["loss"] for s in (7, 8)] == [xla[s]["loss"] for s in (7, 8)]


def test_checkpoint_moves_between_cpu_and_xla_backends(reference, tiny_data, tmp_path):
    """A checkpoint written by the CPU backend resumes on XLA and one written on XLA resumes on
    CPU: same keys, shapes and shard files. Continued losses match the uninterrupted runs
    within the cross-backend tolerance."""
    cpu_ref, xla_ref = reference["cpu"], reference["xla"]
    _run(tiny_data, tmp_path, "cpu-part", "cpu", "training.steps=3", "training.decaySteps=6", ckpt="from-cpu")
    on_xla, _ = _run(tiny_data, tmp_path, "xla-cont", "xla", "training.steps=5", "training.decaySteps=6",
                     ckpt="from-cpu")
    _run(tiny_data, tmp_path, "xla-part", "xla", "training.steps=3", "training.decaySteps=6", ckpt="from-xla")
    on_cpu, _ = _run(tiny_data, tmp_path, "cpu-cont", "cpu", "training.steps=5", "training.decaySteps=6",
                     ckpt="from-xla")
    assert sorted(on_xla) == sorted(on_cpu) == [4, 5]
    for s in (4, 5):
        assert on_xla[s]["loss"] == pytest.approx(cpu_ref[s]["loss"], rel=1e-5)
        assert on_cpu[s]["loss"] == pytest.approx(xla_ref[s]["loss"], rel=1e-5)
    files = {p.relative_to(tmp_path / "from-cpu" / "step_3") for p in (tmp_path / "from-cpu" / "step_3").rglob("*")}
    files_xla = {p.relative_to(tmp_path / "from-xla" / "step_3") for p in (tmp_path / "from-xla" / "step_3").rglob("*")}
    assert files == files_xla


def test_moving_a_tensor_parallel_model_to_xla_keeps_the_layers_marks():
    """The marks the layers put on their parameters (replicated norms counted once in the
    gradient norm and summed under sequence parallel; replicated key/value rows) survive the
    move to the XLA device, which makes new Parameter objects. A TP 4 rank's model of the tiny
    config, built on CPU and moved as the trainer moves it (parallel.to_device)."""
    import subprocess
    import sys
    script = """
import torch, torch_xla
from trainer.config import load
from trainer.model.transformer import Transformer
from trainer.model.parallel import TPContext, to_device
cfg = load("examples/tiny-cpu.yaml")
model = Transformer(cfg.model, TPContext(4, 1, None, True), max_seq_len=64)
before = {n: dict(vars(p)) for n, p in model.named_parameters() if vars(p)}
plain = Transformer(cfg.model, TPContext(4, 1, None, True), max_seq_len=64).to(torch_xla.device())
lost = sum(1 for n, p in plain.named_parameters() if n in before and not vars(p))
to_device(model, torch_xla.device(), torch.float32)
after = {n: dict(vars(p)) for n, p in model.named_parameters() if vars(p)}
assert next(model.parameters()).device.type == "xla"
print(len(before), lost, after == before, model.model.norm.weight.tp_replicated)
"""
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    marked, lost_by_plain_to, kept, norm_replicated = out.stdout.split()[-4:]
    print(f"{marked} marked parameters; a plain .to(xla) drops {lost_by_plain_to} of them; to_device keeps all")
    assert int(marked) > 0 and int(lost_by_plain_to) == int(marked)  # the hazard is real
    assert kept == "True" and norm_replicated == "True"
