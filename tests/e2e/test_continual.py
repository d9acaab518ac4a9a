"""Continual pre-training under the operator (tier e2e), as a team starts it today: init.from a
Llama 3.1-shaped Hugging Face model (rope_type llama3) whose directory ships only a
SentencePiece tokenizer.model, on a Parquet corpus whose text column is not ``text``. The
operator runs in its own pod's view (it sees neither the model, the corpus nor the checkpoints);
a rank is killed mid-run and the gang resumes from its checkpoint.

- the first step's loss equals transformers' on the same batch (the weights, the scaled RoPE,
  the tokenizer and the Parquet reader all reached the pods as meant);
- the steps trained again after the restart have the losses of their first execution, bitwise
  (exact resume of a continual run: its data position, the SentencePiece stream);
- the checkpoint records the directory's tokenizer and the scaled RoPE.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from localcluster import drill
from localcluster.drill import Drill

pytestmark = pytest.mark.e2e
transformers = pytest.importorskip("transformers")

from tests.hf_models import MODELS, llama31_sentencepiece_parquet, save_tiny  # noqa: E402

STEPS, CHECKPOINT_EVERY, FAULT_AFTER = 30, 10, 13


def test_llama31_sentencepiece_parquet_run_survives_a_killed_rank(e2e, tiny_data, tmp_path):
    llama31 = save_tiny("llama3.1", tmp_path / "hf-llama3.1", tiny_data["tokenizer"])
    hf_dir, corpus = llama31_sentencepiece_parquet(llama31, tiny_data["stories"], tmp_path)
    ns = e2e.namespace("continual")
    body = drill.manifest(
        "llama31", tiny_data, tmp_path, model=MODELS["llama3.1"][0], init={"from": str(hf_dir)},
        training={"steps": STEPS, "globalBatchSize": 8, "microBatchSize": 4, "warmupSteps": 2},
        checkpoint={"intervalSteps": CHECKPOINT_EVERY, "keep": 100},
        logging={"interval": 1, "progressIntervalSeconds": 1})
    body["spec"]["data"] = {"sources": [{"uri": str(corpus), "textField": "content"}]}  # the tokenizer: init.from's
    assert not e2e.operator.sees(str(hf_dir)) and not e2e.operator.sees(str(corpus))
    d = Drill(e2e.cluster, ns, body)
    d.create()
    d.wait(lambda: (d.status().get("lastCheckpoint") or {}).get("step") == CHECKPOINT_EVERY, 240,
           f"checkpoint {CHECKPOINT_EVERY} in the status")
    d.wait_step(FAULT_AFTER, 120)
    failed_at = d.trained_step()
    d.inject("kill-rank")
    st = d.wait(lambda: (s := d.status()).get("phase") in ("Succeeded", "Failed") and s, 300, "the run to end")
    assert st["phase"] == "Succeeded", st.get("message")
    assert [f.get("resumedStep") for f in st["failures"]] == [CHECKPOINT_EVERY], st["failures"]

    records = drill.read_losses(d.losses_path)
    runs: dict[int, list[float]] = {}
    for r in records:
        runs.setdefault(r["step"], []).append(r["loss"])
    assert sorted(runs) == list(range(1, STEPS + 1))
    again = {s: v for s, v in runs.items() if len(v) > 1}
    assert set(again) >= set(range(CHECKPOINT_EVERY + 1, failed_at + 1)), again
    assert all(v[0] == v[-1] for v in again.values()), again  # bitwise: exact resume

    # the first loss against transformers', on the batch the run's own configuration gives
    from trainer.config import load
    from trainer.data.packed import PackedDataset
    rendered = d.core.read_namespaced_config_map(f"{d.name}-config", ns).data["run.yaml"]
    (tmp_path / "run.yaml").write_text(rendered)
    cfg = load(str(tmp_path / "run.yaml"))
    assert cfg.data.tokenizer == f"{hf_dir}/tokenizer.json"  # init.from's, read as its tokenizer.model
    inputs, targets = PackedDataset(cfg.data, cfg.training.seq_len, cfg.training.seed,
                                    cfg.model.vocab_size).next_batch(cfg.training.global_batch_size)
    assert (inputs == 1).sum() > 0  # SentencePiece's BOS (id 1) starts the documents
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = F.cross_entropy(theirs(input_ids=inputs).logits.flatten(0, 1), targets.flatten()).item()
    print(f"\ncontinual llama3.1 + SentencePiece + Parquet under the operator: first loss {runs[1][0]:.7f}, "
          f"transformers {expected:.7f}; killed at step {failed_at}, resumed at {CHECKPOINT_EVERY}; "
          f"step {STEPS} loss {runs[STEPS][-1]:.4f}; goodput {st['goodput']['effectiveRatio']}")
    assert runs[1][0] == pytest.approx(expected, abs=1e-5)
    assert runs[STEPS][-1] < runs[1][0]

    meta = json.loads((tmp_path / "llama31-ckpt" / f"step_{STEPS}" / "meta.json").read_text())
    assert meta["tokenizer"] == f"{hf_dir}/tokenizer.json" and "content" in json.dumps(meta["dataSources"])
    assert meta["model"]["ropeScaling"] == "llama3", meta["model"]
