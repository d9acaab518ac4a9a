"""AWS's own NxD Llama pre-training script under the operator (tier e2e), unmodified.

NeuronX Distributed 2.29's ``examples/training/llama/tp_zero1_llama_hf_pretrain/
tp_zero1_llama_hf_pretrain.py`` runs in a pod (a real process under our launcher and torchrun),
one rank on torch-xla's CPU device (``PJRT_DEVICE=CPU``), with NxD's real source and its
example's pinned requirements (``tools/setup-nxd --example``); the only stand-ins are the
tests/standins/neuron_sdk ones (torch-neuronx's platform query, neuronx-cc's kernel configs,
NxD's inference tracing, one torch-xla constant), loaded by ``sitecustomize`` without editing
the script. The script knows nothing of the operator:

- its own logger's ``LOG ...`` lines become the run's progress (step, loss, throughput);
- its rank is SIGKILLed after NxD's ``save_checkpoint`` has finished at least one tag, before
  the run's end; the operator restarts the gang and the script, told nothing,
  resumes through NxD's own ``load_checkpoint`` (``--loading_step latest_if_exists``) from the
  newest tag with ``done``, the one the operator reports;
- every step the restarted script logs has the loss and the gradient norm (``--print_grad_norm``)
  of an uninterrupted run of the same script, as printed.

The script restarts its data loader on resume (it does not skip the batches it consumed):
that is its own behaviour, so the corpus here is one batch (every epoch the same batch), which
makes "the same losses after a resume" a test of the state NxD saved and loaded (weights,
ZeRO-1 optimizer, scheduler, step), not of the data order.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localcluster import faults, podprocs
from localcluster.drill import Drill

from trainium_api import checkpoints

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tp_zero1_llama_hf_pretrain/tp_zero1_llama_hf_pretrain.py"
STEPS = 100
SAVE_EVERY = 10
SEQ = 32
BATCH = 2
# logger.py: f"LOG {time} - ({epoch}, {step}) step_loss : {loss:.4f} ... grad-norm : {norm}"
LOG_LINE = re.compile(r"^LOG .+? - \((\d+), (\d+)\) step_loss : (\S+) .*grad-norm : (\S+)", re.M)


@pytest.fixture(scope="module")
def example_env() -> dict[str, str]:
    """NxD's source with its Llama example and the example's pinned requirements on
    PYTHONPATH (tools/setup-nxd --example), for torch-xla's CPU device: NxD's CPU mode is
    NOT set, so NxD takes its XLA path, as on trn1."""
    out = subprocess.run(["bash", str(ROOT / "tools" / "setup-nxd"), "--env", "--example"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"tools/setup-nxd --example failed:\n{out.stderr}"
    got = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    # the number of hosts, which NxD's checkpoint loader reads through torch-xla's HOST_WORLD_SIZE
    # (tests/standins/README.md); a Neuron image's launch environment sets it
    return {"PYTHONPATH": got["PYTHONPATH"], "NXD_EXAMPLES": got["NXD_EXAMPLES"], "PJRT_DEVICE": "CPU",
            "XRT_HOST_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}


def tiny_llama(tmp: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """A tiny Llama config in the example's config format (its 7B config's keys) and a
    tokenized corpus of one batch, written with the example's own datasets version."""
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_theta": 10000.0,
        "initializer_range": 0.02, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False, "torch_dtype": "float32", "sequence_parallel_enabled": False,
        "selective_checkpoint_enabled": False}))
    data = tmp / "data"
    make = ("import datasets, random, sys\n"
            "rng = random.Random(7)\n"
            f"ids = [[rng.randrange(256) for _ in range({SEQ})] for _ in range({BATCH})]\n"
            f"datasets.Dataset.from_dict({{'input_ids': ids, 'attention_mask': [[1] * {SEQ}] * {BATCH}, "
            "'labels': ids}).save_to_disk(sys.argv[1])\n")
    out = subprocess.run([sys.executable, "-c", make, str(data)], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return model, data


def arguments(model: Path, data: Path, out: Path, checkpoint_dir: str) -> list[str]:
    """The script's flags at a size that runs in seconds, in its data-parallel bf16 mode
    (``--use_gpu_compatible_precision 0``: the script sets XLA_USE_BF16; no ZeRO-1) and without
    NKI flash attention (no kernels on CPU). Not the ZeRO-1 + mixed precision flags of AWS's
    tp_zero1_llama2_7B_hf_pretrain.sh: with those, NxD 2.29 and torch-xla 2.9 do not resume
    the weights (docs/neuron.md, "NxD's Llama example under the operator")."""
    return ["--model_path", str(model), "--data_dir", str(data), "--output_dir", str(out),
            "--metrics_file", str(out / "results.json"), "--batch_size", str(BATCH), "--seq_len", str(SEQ),
            "--max_steps", str(STEPS), "--steps_this_run", str(STEPS), "--warmup_steps", "2",
            "--grad_accum_usteps", "1", "--tensor_parallel_size", "1", "--use_gpu_compatible_precision", "0",
            "--use_flash_attention", "0", "--logging_interval", "1", "--print_grad_norm",
            "--checkpoint_dir", checkpoint_dir, "--checkpoint_freq", str(SAVE_EVERY),
            "--num_kept_checkpoint", "3", "--loading_step", "latest_if_exists"]


def logged_steps(text: str) -> dict[int, tuple[str, str]]:
    """step -> (loss, gradient norm) as the script's logger printed them."""
    return {int(m[2]): (m[3], m[4]) for m in LOG_LINE.finditer(text)}


def pod_logs(pods_root: Path, namespace: str) -> list[str]:
    """Each pod's output, oldest first (one pod an attempt here)."""
    dirs = sorted((p.parent for p in (Path(pods_root) / namespace).glob(f"*/{podprocs.RECORD}")),
                  key=lambda d: podprocs.read_record(d).get("created", 0))
    return [(d / podprocs.LOG).read_text(errors="replace") for d in dirs]


def test_aws_nxd_llama_script_killed_mid_run_resumes_through_nxds_loader_with_equal_losses(e2e, example_env, tmp_path):
    model, data = tiny_llama(tmp_path, example_env)
    script = str(Path(example_env["NXD_EXAMPLES"]) / SCRIPT)

    # the uninterrupted run: the same script under plain torchrun, outside the operator
    ref = tmp_path / "reference"
    ref.mkdir()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                          "--master_port", "29561", script, *arguments(model, data, ref / "out", str(ref / "ckpt"))],
                         cwd=ref, env={**os.environ, **example_env}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    truth = logged_steps(out.stdout)
    assert sorted(truth) == list(range(1, STEPS + 1)), sorted(truth)

    ns = e2e.namespace("nxd-example")
    ckpt = str(tmp_path / "ckpt")
    work = tmp_path / "run"
    work.mkdir()
    body = {"apiVersion": "trainium.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "llama"},
            "spec": {"image": "local", "nodes": 1, "instanceType": "cpu", "processesPerNode": 1,
                     "trainer": {"kind": "command", "progressFormat": "nxd", "workingDir": str(work),
                                 "command": [script, *arguments(model, data, work / "out", "$(CHECKPOINT_URI)")],
                                 "tokensPerSample": SEQ, "samplesPerStep": BATCH},
                     "checkpoint": {"uri": ckpt}, "logging": {"progressIntervalSeconds": 1},
                     "faultTolerance": {"teardownGraceSeconds": 3},
                     "env": [{"name": k, "value": v} for k, v in example_env.items()]}}
    d = Drill(e2e.cluster, ns, body)
    d.create()
    # NxD's save_checkpoint has finished a tag (its `done` file), then the rank is killed
    saved = d.wait(lambda: checkpoints.newest_complete(ckpt, "nxd"), 240, "NxD's first complete checkpoint",
                   interval=0.02)
    rank, _ = faults.kill_rank(e2e.cluster.pods_dir, ns, d.running_pod(0).metadata.name)
    killed_at = time.time()
    d.wait(lambda: d.status().get("attempt") == 2, 90, "the crash to be detected and a new gang started")
    st = d.status()
    failure = st["failures"][-1]
    assert failure["cause"] == "application" and failure["attempt"] == 1, failure
    resumed = st["current"]["resumeCheckpoint"]
    newest = checkpoints.newest_complete(ckpt, "nxd")
    assert resumed["tag"] == newest.tag and resumed["step"] == newest.step >= saved.step, (resumed, newest)
    print(f"\nnxd example: killed rank {rank} after {saved.tag}; detected +{failure['time'] - killed_at:.1f}s; "
          f"attempt 2 resumes from {resumed['tag']}")

    st = d.wait(lambda: (s := d.status()).get("phase") in ("Succeeded", "Failed") and s, 300, "the run to end")
    assert st["phase"] == "Succeeded", st.get("message")
    assert st["step"] == STEPS and st["restarts"] == {"application": 1}
    assert st["loss"] == pytest.approx(float(truth[STEPS][0]))  # parsed from the script's own logger
    assert st["lastCheckpoint"]["tag"] == f"step_{STEPS}"

    first, second = (logged_steps(text) for text in pod_logs(e2e.cluster.pods_dir, ns))
    assert first and max(first) < STEPS, "the rank was killed before the run's end"
    assert sorted(second) == list(range(resumed["step"] + 1, STEPS + 1)), "NxD's loader resumed at the newest done tag"
    for attempt, steps in (1, first), (2, second):
        for step, logged in steps.items():
            assert logged == truth[step], f"attempt {attempt}, step {step}: {logged} != uninterrupted {truth[step]}"
    print(f"nxd example: attempt 1 logged steps 1-{max(first)}, attempt 2 steps {min(second)}-{STEPS}, every "
          f"loss and gradient norm equal to the uninterrupted run's (final loss {truth[STEPS][0]})")
