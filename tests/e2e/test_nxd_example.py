"""AWS's own NxD Llama pre-training script under the operator (tier e2e), unmodified.

NeuronX Distributed 2.29's ``examples/training/llama/tp_zero1_llama_hf_pretrain/
tp_zero1_llama_hf_pretrain.py`` runs in a pod (a real process under our launcher and torchrun),
one rank on torch-xla's CPU device (``PJRT_DEVICE=CPU``), with NxD's real source and its
example's pinned requirements (``tools/setup-nxd --example``), in its data-parallel BF16 mode
(with ZeRO-1 the script does not resume its weights: tests/nxd/test_nxd_example_resume.py).
The only stand-ins are the tests/standins/neuron_sdk ones (torch-neuronx's platform query,
neuronx-cc's kernel configs, NxD's inference tracing, one torch-xla constant), loaded by
``sitecustomize`` without editing the script. The script knows nothing of the operator:

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
optimizer, scheduler, step), not of the data order.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from localcluster import faults, podprocs
from localcluster.drill import Drill
from tests import nxd_example as ex

from trainium_api import checkpoints

pytestmark = pytest.mark.e2e

STEPS = 100
SAVE_EVERY = 10


def pod_logs(pods_root: Path, namespace: str) -> list[str]:
    """Each pod's output, oldest first (one pod an attempt here)."""
    dirs = sorted((p.parent for p in (Path(pods_root) / namespace).glob(f"*/{podprocs.RECORD}")),
                  key=lambda d: podprocs.read_record(d).get("created", 0))
    return [(d / podprocs.LOG).read_text(errors="replace") for d in dirs]


def test_aws_nxd_llama_script_killed_mid_run_resumes_through_nxds_loader_with_equal_losses(e2e, tmp_path):
    env = ex.example_env()
    model, data = ex.tiny_llama(tmp_path, env)

    def args(out: Path, checkpoint_dir: str) -> list[str]:
        return ex.arguments(model, data, out, checkpoint_dir, STEPS, SAVE_EVERY, ex.BF16)

    # the uninterrupted run: the same script under plain torchrun, outside the operator
    ref = tmp_path / "reference"
    truth = ex.run(env, ref, args(ref / "out", str(ref / "ckpt")))
    assert sorted(truth) == list(range(1, STEPS + 1)), sorted(truth)

    ns = e2e.namespace("nxd-example")
    ckpt = str(tmp_path / "ckpt")
    work = tmp_path / "run"
    work.mkdir()
    body = {"apiVersion": "trainium.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "llama"},
            "spec": {"image": "local", "nodes": 1, "instanceType": "cpu", "processesPerNode": 1,
                     "trainer": {"kind": "command", "progressFormat": "nxd", "workingDir": str(work),
                                 # an out directory per attempt: the script rewrites its metrics file
                                 # in place (read, truncate, write), so a kill inside that write leaves
                                 # it empty and the script's next start dies parsing it
                                 "command": [ex.script(env), *args(work / "out-$(ATTEMPT)", "$(CHECKPOINT_URI)")],
                                 "tokensPerSample": ex.SEQ, "samplesPerStep": ex.BATCH},
                     "checkpoint": {"uri": ckpt}, "logging": {"progressIntervalSeconds": 1},
                     "faultTolerance": {"teardownGraceSeconds": 3},
                     "env": [{"name": k, "value": v} for k, v in env.items()]}}
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
    # what attempt 2's pods resumed from, once they report (the pods list the store; the
    # operator's record at the restart is what they last reported before it)
    st = d.wait(lambda: (s := d.status()).get("phase") == "Running" and s.get("attempt") == 2 and s, 120,
                "attempt 2 to report progress")
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

    first, second = (ex.logged_steps(text) for text in pod_logs(e2e.cluster.pods_dir, ns))
    assert first and max(first) < STEPS, "the rank was killed before the run's end"
    assert sorted(second) == list(range(resumed["step"] + 1, STEPS + 1)), "NxD's loader resumed at the newest done tag"
    for attempt, steps in (1, first), (2, second):
        for step, logged in steps.items():
            assert logged == truth[step], f"attempt {attempt}, step {step}: {logged} != uninterrupted {truth[step]}"
    print(f"nxd example: attempt 1 logged steps 1-{max(first)}, attempt 2 steps {min(second)}-{STEPS}, every "
          f"loss and gradient norm equal to the uninterrupted run's (final loss {truth[STEPS][0]})")
