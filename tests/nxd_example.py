"""AWS's NxD Llama example script (NxD 2.29's examples/training/llama/tp_zero1_llama_hf_pretrain),
run unmodified on torch-xla's CPU device: its environment, a tiny model and corpus, its flags,
its log. Shared by tests/e2e/test_nxd_example.py (under the operator) and
tests/nxd/test_nxd_example_resume.py (plain torchrun)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "tp_zero1_llama_hf_pretrain/tp_zero1_llama_hf_pretrain.py"
SEQ = 32
BATCH = 2
# logger.py: f"LOG {time} - ({epoch}, {step}) step_loss : {loss:.4f} ... grad-norm : {norm}"
LOG_LINE = re.compile(r"^LOG .+? - \((\d+), (\d+)\) step_loss : (\S+) .*grad-norm : (\S+)", re.M)
# The script's data-parallel BF16 mode (it sets XLA_USE_BF16), no ZeRO-1: the mode in which it
# resumes exactly (docs/neuron.md, "Scripts users already run").
BF16 = ["--use_gpu_compatible_precision", "0"]
# The flags of AWS's tp_zero1_llama2_7B_hf_pretrain.sh: ZeRO-1 with mixed precision (fp32
# master weights in the optimizer).
ZERO1 = ["--use_zero_1", "--use_mix_precision"]


def example_env() -> dict[str, str]:
    """NxD's source with its Llama example and the example's pinned requirements on PYTHONPATH
    (tools/setup-nxd --example), for torch-xla's CPU device: NxD's CPU mode is NOT set, so NxD
    takes its XLA path, as on trn1."""
    out = subprocess.run(["bash", str(ROOT / "tools" / "setup-nxd"), "--env", "--example"], cwd=ROOT,
                         env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"tools/setup-nxd --example failed:\n{out.stderr}"
    got = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    # XRT_HOST_WORLD_SIZE: the number of hosts, which NxD's checkpoint loader reads through
    # torch-xla's HOST_WORLD_SIZE (tests/standins/README.md); a Neuron image's launcher sets it
    return {"PYTHONPATH": got["PYTHONPATH"], "NXD_EXAMPLES": got["NXD_EXAMPLES"], "PJRT_DEVICE": got["PJRT_DEVICE"],
            "NXD_CPU_MODE": got["NXD_CPU_MODE"], "XRT_HOST_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}


def script(env: dict[str, str]) -> str:
    return str(Path(env["NXD_EXAMPLES"]) / SCRIPT)


def tiny_llama(tmp: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """A tiny Llama config with the keys of the example's 7B config (the script reads
    sequence_parallel_enabled and selective_checkpoint_enabled from it) and a tokenized corpus
    of one batch, written with the example's own datasets version. One batch: the script
    restarts its data loader on resume, so equal losses after a resume test the saved state."""
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


def arguments(model: Path, data: Path, out: Path, checkpoint_dir: str, steps: int, save_every: int,
              mode: list[str], steps_this_run: int | None = None) -> list[str]:
    """The script's flags at a size that runs in seconds, without NKI flash attention (no
    kernels on CPU); ``mode`` is BF16 or ZERO1."""
    return ["--model_path", str(model), "--data_dir", str(data), "--output_dir", str(out),
            "--metrics_file", str(out / "results.json"), "--batch_size", str(BATCH), "--seq_len", str(SEQ),
            "--max_steps", str(steps), "--steps_this_run", str(steps_this_run or steps), "--warmup_steps", "2",
            "--grad_accum_usteps", "1", "--tensor_parallel_size", "1", *mode,
            "--use_flash_attention", "0", "--logging_interval", "1", "--print_grad_norm",
            "--checkpoint_dir", checkpoint_dir, "--checkpoint_freq", str(save_every),
            "--num_kept_checkpoint", "3", "--loading_step", "latest_if_exists"]


def run(env: dict[str, str], cwd: Path, args: list[str]) -> dict[int, tuple[str, str]]:
    """The script under plain torchrun (--standalone: a free port), one rank; returns its logged steps."""
    cwd.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                          script(env), *args],
                         cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return logged_steps(out.stdout)


def logged_steps(text: str) -> dict[int, tuple[str, str]]:
    """step -> (loss, gradient norm) as the script's logger printed them."""
    return {int(m[2]): (m[3], m[4]) for m in LOG_LINE.finditer(text)}
