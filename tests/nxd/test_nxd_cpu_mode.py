"""The Neuron backend's NxD path, run for real in NxD's CPU mode (tier `nxd`).

NxD 2.29's own code (tools/setup-nxd puts its source on PYTHONPATH, unedited, with the named
stand-ins of tests/standins/neuron_sdk for the SDK packages that are not on the public index)
builds the process groups (``initialize_model_parallel``, ``initialize_kv_group``) on gloo,
and its ``ColumnParallelLinear``, ``RowParallelLinear``, ``ParallelEmbedding``, mappings and
``parallel_cross_entropy`` run the trainer's model on CPU tensors under torchrun, as
``backend: neuron`` does on Trainium minus the XLA device. Each layout is compared step by step
with the PyTorch backend (``backend: cpu``) training the same weights on the same data in one
process.

Tolerance: losses within 1e-4 and global gradient norms within 1e-3 (1e-5 at step 1, from the
same weights), relative, as the PyTorch
backend's own multi-rank layouts are held to (tests/trainer/test_pipeline.py): both sides are
fp32 on the same CPU, and only the order of floating-point sums differs (a tensor-parallel
matmul sums its halves in a collective; NxD's loss subtracts the max and sums the exponentials
per shard). Measured differences are about 1e-6 relative; a wrong shard, a missing or doubled
reduction or a lost gradient moves the loss at the first or second decimal.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY_CONFIG, eval_losses, held_out, read_losses, run_trainer, trainer_env
from tests.trainer.test_training import overrides
from trainium_api import checkpoints, exitcodes

pytestmark = [pytest.mark.trainer, pytest.mark.nxd]

STEPS = ["training.steps=4", "training.warmupSteps=2", "data.evalIntervalSteps=2"]
NEURON = ["backend=neuron"]


@pytest.fixture(scope="session")
def nxd_env() -> dict[str, str]:
    """The trainer's environment with NxD in CPU mode (tools/setup-nxd: NXD_CPU_MODE=1 and
    the PYTHONPATH of NxD's source, its pinned dependencies and the stand-ins)."""
    out = subprocess.run(["bash", str(ROOT / "tools" / "setup-nxd"), "--env"], cwd=ROOT,
                         env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"tools/setup-nxd failed:\n{out.stderr}"
    found = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    env = trainer_env(NXD_CPU_MODE=found["NXD_CPU_MODE"])
    env["PYTHONPATH"] = found["PYTHONPATH"] + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """The PyTorch backend in one process: the numbers every NxD layout must reproduce."""
    tmp = tmp_path_factory.mktemp("nxd-reference")
    res = run_trainer(1, overrides(tiny_data, tmp, "ref", *STEPS, held_out(tiny_data), "checkpoint.uri="))
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp / "ref.jsonl"


def _assert_matches(got_file, ref_file, what: str) -> None:
    """Every step's loss and gradient norm, and the held-out losses (steps 2 and 4)."""
    got, ref = read_losses(got_file), read_losses(ref_file)
    got_eval, ref_eval = eval_losses(got_file), eval_losses(ref_file)
    assert sorted(got_eval) == sorted(ref_eval) == [2, 4]
    for s in ref_eval:
        print(f"held-out at step {s}: pytorch {ref_eval[s]:.7f} nxd {what} {got_eval[s]:.7f}")
        assert got_eval[s] == pytest.approx(ref_eval[s], rel=1e-4)
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    for s in ref:
        print(f"step {s}: pytorch {ref[s]['loss']:.7f} nxd {what} {got[s]['loss']:.7f}  "
              f"grad norm {ref[s]['gradNorm']:.6f} / {got[s]['gradNorm']:.6f}")
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-4)
        assert got[s]["gradNorm"] == pytest.approx(ref[s]["gradNorm"], rel=1e-3)
    # step 1 starts from the same weights: only the order of sums differs (optim.sum_sq)
    assert got[1]["gradNorm"] == pytest.approx(ref[1]["gradNorm"], rel=1e-5)


# Sequence parallel in NxD's CPU mode needs micro-batches of 1 (trainer.model.neuron.NeuronBackend.prepare
# says why); the reference's 4 accumulate to the same global batch.
SP = ["parallelism.sequenceParallel=true", "training.microBatchSize=1"]


@pytest.mark.parametrize("ranks, layout", [
    (1, ["parallelism.tensor=1"]),
    (2, ["parallelism.tensor=2", "parallelism.zero1=false"]),
    (4, ["parallelism.tensor=2", *SP, "parallelism.zero1=true"]),
    (4, ["parallelism.tensor=4", *SP]),
    (4, ["parallelism.pipeline=2", "parallelism.tensor=2"]),
    (8, ["parallelism.tensor=4"]),
], ids=["one-process", "tp2", "tp2-sp-dp2-zero1", "tp4-sp-kv-replicated", "pp2-tp2", "tp4-dp2-trn1-interleaved"])
def test_nxd_layers_match_the_pytorch_backend(ranks, layout, nxd_env, reference, tiny_data, tmp_path):
    """NxD's groups, layers, mappings (sequence parallel's gather and reduce-scatter included)
    and vocabulary-parallel loss against the PyTorch backend. tp4: the tiny model's 2 key/value
    heads are each held by 2 ranks, as Llama 2 70B's 8 heads are at TP 32. pp2: NxD's pipeline runtime (NxDPPModel, manual partition) runs our two stages' 1F1B
    over the 4 accumulation micro-batches, training and held-out evaluation. tp4-dp2 on 8
    ranks: NxD interleaves trn1's TP groups ([0, 2, 4, 6], [1, 3, 5, 7]; the stand-in names the
    platform trn1), so the replicated heads' groups must come from those TP groups, not from
    consecutive ranks. one-process: NxD's groups in a process started without torchrun."""
    res = run_trainer(ranks, overrides(tiny_data, tmp_path, "nxd", *STEPS, *NEURON, held_out(tiny_data),
                                       "checkpoint.uri=", *layout), env=nxd_env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "backend neuron" in res.stderr
    assert re.search(r"neuronx-distributed \S+ in CPU mode", res.stderr), res.stderr[-2000:]
    assert ("pp=2" in res.stderr) == ("parallelism.pipeline=2" in layout)
    if ranks == 8:  # NxD's own log line: the interleaved groups this case is about
        assert "tp_groups=[[0, 2, 4, 6], [1, 3, 5, 7]]" in res.stdout + res.stderr
    _assert_matches(tmp_path / "nxd.jsonl", reference, layout[0])


def test_nxd_checkpoint_resumes_on_the_pytorch_backend(nxd_env, tiny_data, tmp_path):
    """A checkpoint written by the NxD path at TP 2 resumes on the PyTorch backend at TP 2 and
    the later steps equal an uninterrupted NxD run's: the shard files NxD's layers fill are the
    PyTorch backend's, name for name and shape for shape."""
    layout = ["parallelism.tensor=2", "parallelism.zero1=false", "checkpoint.intervalSteps=2"]
    full = run_trainer(2, overrides(tiny_data, tmp_path, "full", *STEPS, *NEURON, *layout), env=nxd_env)
    assert full.returncode == 0, full.stderr[-3000:]
    half = run_trainer(2, overrides(tiny_data, tmp_path, "half", "training.steps=2", "training.warmupSteps=2",
                                    *NEURON, *layout), env=nxd_env)
    assert half.returncode == 0, half.stderr[-3000:]
    assert checkpoints.newest_complete(str(tmp_path / "half-ckpt")).tag == "step_2"
    (tmp_path / "half.jsonl").unlink()
    resumed = run_trainer(2, overrides(tiny_data, tmp_path, "half", *STEPS, *layout))  # backend: cpu
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step_2" in resumed.stderr
    got, ref = read_losses(tmp_path / "half.jsonl"), read_losses(tmp_path / "full.jsonl")
    assert sorted(got) == [3, 4]
    for s in got:
        print(f"step {s}: nxd throughout {ref[s]['loss']:.7f}, resumed on pytorch {got[s]['loss']:.7f}")
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-4)
        assert got[s]["gradNorm"] == pytest.approx(ref[s]["gradNorm"], rel=1e-3)


def test_sequence_parallel_with_larger_micro_batches_is_refused_in_cpu_mode(nxd_env, tiny_data, tmp_path):
    """What NxD's CPU mode cannot run (its backward views a non-contiguous gather) stops the
    run before the first step with the fatal exit code and the field named, not a traceback."""
    res = run_trainer(2, overrides(tiny_data, tmp_path, "refused", *STEPS, *NEURON, "checkpoint.uri=",
                                   "parallelism.tensor=2", "parallelism.sequenceParallel=true"), env=nxd_env)
    assert res.returncode == exitcodes.FATAL, res.stderr[-3000:]
    assert "invalid configuration: training.microBatchSize: NxD's CPU mode" in res.stderr


def test_nxd_load_checkpoint_reads_our_checkpoints(nxd_env, tiny_data, tmp_path):
    """NxD's own loader (neuronx_distributed.trainer.checkpoint.load_checkpoint, tag=None,
    strict=True) finds the newest complete tag of a checkpoint root the trainer wrote at TP 2
    and loads every rank's shard into the trainer's model: same tensor names, every tensor
    equal to the file. With the newest tag torn (no `done`), NxD skips it as we do."""
    layout = ["parallelism.tensor=2", "parallelism.zero1=false"]
    res = run_trainer(2, overrides(tiny_data, tmp_path, "save", *STEPS, *NEURON, *layout,
                                   "checkpoint.intervalSteps=2"), env=nxd_env)
    assert res.returncode == 0, res.stderr[-3000:]
    root = tmp_path / "save-ckpt"

    def nxd_load() -> list[dict]:
        cmd = [sys.executable, "-m", "trainer.pod.launch", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "tests" / "nxd" / "nxd_loads_our_checkpoint.py"), str(TINY_CONFIG), str(root),
               *[a for o in [*NEURON, *layout] for a in ("--override", o)]]
        out = subprocess.run(cmd, cwd=ROOT, env=nxd_env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")),
                      key=lambda r: r["rank"])

    loaded = nxd_load()
    print(f"NxD's load_checkpoint: {loaded}")
    assert [r["rank"] for r in loaded] == [0, 1]
    assert all(r["tag"] == "step_4" and r["equal_to_file"] and r["changed_by_load"] == r["tensors"] > 0
               for r in loaded)
    (root / "step_4" / "done").unlink()
    assert all(r["tag"] == "step_2" and r["equal_to_file"] for r in nxd_load())


def _preflight(env: dict[str, str], backend: str, ranks: int, tmp_path) -> str:
    """The launcher's pre-flight check alone (then a trivial real run) on ``backend``: its
    summary line from rank 0."""
    script = tmp_path / "real.py"
    script.write_text("print('real run', flush=True)\n")
    res = subprocess.run([sys.executable, "-m", "trainer.pod.launch", "--preflight", f"20,60,{backend}", "--standalone",
                          "--nproc_per_node", str(ranks), str(script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "real run" in res.stdout, res.stderr[-3000:]
    return next(line for line in res.stderr.splitlines() if line.startswith("trainer.pod.preflight:") and "passed" in line)


def test_the_preflight_check_runs_on_the_neuron_backends_collectives_in_cpu_mode(nxd_env, tmp_path):
    """backend neuron in NxD's CPU mode: the check's device and process group are the Neuron
    backend's (NeuronBackend.check_collectives), which in CPU mode are NxD's: gloo and the CPU."""
    summary = _preflight(nxd_env, "neuron", 2, tmp_path)
    assert "1 nodes, 2 ranks, gloo on cpu" in summary, summary


def test_the_preflight_check_runs_the_trn1_xla_path_on_torch_xlas_cpu_device(nxd_env, tmp_path):
    """backend neuron outside CPU mode is the trn1 path: the ``xla`` process group, the matmuls
    and the all-reduce on the XLA device, each timing synced (xla_check_collectives), with
    torch-neuronx's stand-in. Here the device is torch-xla's CPU device in one process (its CPU
    collectives join no other process); on trn1 it is the NeuronCore."""
    env = {k: v for k, v in nxd_env.items() if k != "NXD_CPU_MODE"}
    summary = _preflight({**env, "PJRT_DEVICE": "CPU"}, "neuron", 1, tmp_path)
    assert "1 nodes, 1 ranks, xla on the XLA device" in summary, summary


# The model features of the newer families (trainer.model.hf.LLAMA_FAMILIES), in two models since
# no family has both q/k/v biases and q/k norms: Qwen3's q/k norms and head size apart from
# hidden / heads, and Qwen2's q/k/v biases; each with Llama 3.1's scaled RoPE and a head tied to
# the embedding (Llama 3.2, small Qwen)
_SCALED_TIED = '"ropeScaling": "llama3", "ropeFactor": 8.0, "ropeOriginalMaxPositions": 32, "tieEmbeddings": true'
MODERN = {"qwen3-like": [f'model={{"preset": "tiny", "qkNorm": true, "headSize": 64, {_SCALED_TIED}}}'],
          "qwen2-like": [f'model={{"preset": "tiny", "qkvBias": true, {_SCALED_TIED}}}']}


@pytest.mark.parametrize("model", MODERN)
def test_nxd_layers_take_the_newer_families_features(model, nxd_env, tiny_data, tmp_path):
    """The same model through NxD's layers at TP 2 (biased column-parallel q/k/v, replicated
    q/k norms, a ColumnParallelLinear head sharing ParallelEmbedding's weight) against the
    PyTorch backend in one process."""
    ref = run_trainer(1, overrides(tiny_data, tmp_path, "ref", *STEPS, *MODERN[model], held_out(tiny_data),
                                   "checkpoint.uri="))
    assert ref.returncode == 0, ref.stderr[-3000:]
    res = run_trainer(2, overrides(tiny_data, tmp_path, "nxd", *STEPS, *NEURON, *MODERN[model], held_out(tiny_data),
                                   "checkpoint.uri=", "parallelism.tensor=2"), env=nxd_env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"neuronx-distributed \S+ in CPU mode", res.stderr), res.stderr[-2000:]
    _assert_matches(tmp_path / "nxd.jsonl", tmp_path / "ref.jsonl", f"{model} tp2")
