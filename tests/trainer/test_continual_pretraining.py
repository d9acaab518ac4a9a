"""Continual pre-training from Hugging Face weights, offline: tiny Llama and GPT-NeoX models made
with transformers (random weights, save_pretrained into a temporary directory), init.from them
at TP 1 and TP 2 under the real trainer, held-out perplexity, conversion back, and transformers
loading the result."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ROOT, TINY_CONFIG, read_losses, run_trainer
from trainium_api import exitcodes

pytestmark = pytest.mark.trainer
transformers = pytest.importorskip("transformers")

from tests.hf_models import MODELS, llama31_sentencepiece_parquet, save_tiny, texts_of  # noqa: E402


@pytest.fixture(scope="module")
def hf_dirs(tiny_data, tmp_path_factory):
    """A tiny transformers model per family, saved with our tokenizer. Llama sharded
    (model.safetensors.index.json + several files), the others in one file."""
    return {family: save_tiny(family, tmp_path_factory.mktemp(f"hf-{family}"), tiny_data["tokenizer"],
                              max_shard_size="400KB" if family == "llama" else "1GB") for family in MODELS}


def _overrides(tiny, tmp: Path, name: str, family: str, *extra: str) -> list[str]:
    model = json.dumps(MODELS[family][0])
    return [f"model={model}", f"data.sources=[{{uri: {tiny['stories']}, weight: 99}}, {{uri: {tiny['facts']}, weight: 1}}]",
            "data.tokenizer=", f"logging.lossesFile={tmp / (name + '.jsonl')}", "logging.interval=1",
            "training.globalBatchSize=8", "training.microBatchSize=4", "training.warmupSteps=2", *extra]


def _hf_loss(hf_dir: Path, family: str, tiny) -> float:
    """transformers' loss on the trainer's first batch (same data config, same seed)."""
    from trainer.config import load
    from trainer.data.packed import PackedDataset
    cfg = load(str(TINY_CONFIG), [f"data.sources=[{{uri: {tiny['stories']}, weight: 99}}, "
                                  f"{{uri: {tiny['facts']}, weight: 1}}]", f"data.tokenizer={tiny['tokenizer']}"])
    inputs, targets = PackedDataset(cfg.data, cfg.training.seq_len, cfg.training.seed, 512).next_batch(8)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).item()


@pytest.mark.parametrize("family", ["llama", "llama3.1", "llama3.2", "qwen2", "qwen3", "neox"])
def test_init_from_hf_loss_equals_transformers_at_tp1_and_tp2(family, hf_dirs, tiny_data, tmp_path):
    expected = _hf_loss(hf_dirs[family], family, tiny_data)
    for tp in (1, 2):
        name = f"{family}-tp{tp}"
        res = run_trainer(tp, _overrides(tiny_data, tmp_path, name, family, f"init.from={hf_dirs[family]}",
                                         "training.steps=1", f"parallelism.tensor={tp}", "checkpoint.uri="))
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"initialised from {hf_dirs[family]}" in res.stderr
        ours = read_losses(tmp_path / f"{name}.jsonl")[1]["loss"]
        print(f"{family} TP {tp}: ours {ours:.7f} transformers {expected:.7f}")
        assert ours == pytest.approx(expected, abs=1e-5)


def test_from_hf_tag_at_tp2_then_train_evaluate_and_back_to_transformers(hf_dirs, tiny_data, tmp_path):
    """from-hf at TP 2 -> init.from that tag -> 30 steps with held-out evaluation (perplexity
    falls) -> to-hf -> transformers loads it and its logits equal ours; evaluate prints the
    table and the plot; a restart ignores init.from because a checkpoint exists."""
    family, hf_dir = "llama", hf_dirs["llama"]
    conv = subprocess.run([sys.executable, "-m", "trainer.checkpoint.convert", "from-hf", str(hf_dir), str(tmp_path / "init"),
                           "--tensor", "2"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert conv.returncode == 0, conv.stderr
    tag = tmp_path / "init" / "step_0"
    assert (tag / "done").exists() and (tag / "tokenizer.json").exists()
    ckpt = tmp_path / "ckpt"
    common = _overrides(tiny_data, tmp_path, "run", family, f"init.from={tag}", "parallelism.tensor=2",
                        f"data.tokenizer={tag / 'tokenizer.json'}", "training.steps=30", "training.lr=3.0e-3",
                        f"data.heldOut={tiny_data['stories']}", "data.evalIntervalSteps=10",  # one URI
                        "data.evalBatches=2", f"checkpoint.uri={ckpt}", "checkpoint.intervalSteps=10",
                        "checkpoint.keep=0")
    res = run_trainer(2, common)
    assert res.returncode == 0, res.stderr[-3000:]
    assert read_losses(tmp_path / "run.jsonl")[1]["loss"] == pytest.approx(_hf_loss(hf_dir, family, tiny_data),
                                                                            abs=1e-5)
    evals = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines() if "evalStep" in line]
    ppl = {e["evalStep"]: e["evalPerplexity"] for e in evals}
    print("held-out perplexity by step:", ppl)
    assert sorted(ppl) == [10, 20, 30] and ppl[30] < ppl[10]

    # A restart with a checkpoint present resumes; init.from is not read (it points nowhere now).
    again = run_trainer(2, [*common, f"init.from={tmp_path / 'gone' / 'step_0'}", "training.steps=31"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "ignored: a checkpoint exists" in again.stderr and "at step 30" in again.stderr

    out = tmp_path / "hf-out"
    back = subprocess.run([sys.executable, "-m", "trainer.checkpoint.convert", "to-hf", str(ckpt / "step_30"), str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert back.returncode == 0, back.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer.encode("Once upon a time there was a cat")])
    from trainer.checkpoint.convert import read_tag
    from trainer.model.hf import merge_to_hf, shard_of
    from trainer.model.transformer import Transformer
    _, cfg, shards = read_tag(str(ckpt / "step_30"))
    ours = Transformer(cfg, max_seq_len=64)
    ours.load_state_dict(shard_of(merge_to_hf(shards, cfg), cfg, 1, 0))
    with torch.no_grad():
        theirs, mine = model(input_ids=ids).logits, ours.logits(ids)
    print("max |logit difference|:", (mine - theirs).abs().max().item())
    assert torch.allclose(mine, theirs, atol=1e-4)

    import yaml

    from trainer.config import load, to_dict
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(to_dict(load(str(TINY_CONFIG), common))))
    table = subprocess.run([sys.executable, "-m", "trainer.loop.evaluate", "--config", str(config),
                            "--plot", str(tmp_path / "ppl.png"), "--json", str(tmp_path / "ppl.json")],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert table.returncode == 0, table.stderr
    print(table.stdout)
    rows = {r["step"]: r["perplexity"] for r in json.loads((tmp_path / "ppl.json").read_text())}
    assert sorted(rows) == [10, 20, 30, 31]
    for step in (10, 20, 30):  # the same batches and micro batches as in training
        assert rows[step] == pytest.approx(ppl[step], rel=1e-4)
    assert (tmp_path / "ppl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _readme_commands(prefix: str) -> list[str]:
    """The trainer manual's command lines (docs/trainer.md, once the README's) that start with
    ``prefix``, as written (comments cut)."""
    return [line.split("#")[0].strip() for line in (ROOT / "docs" / "trainer.md").read_text().splitlines()
            if line.startswith(prefix)]


def test_documented_convert_round_trip_runs_as_written(hf_dirs, tmp_path):
    """docs/trainer.md's two convert commands, one after the other, with its placeholders filled in
    the way a user would (to-hf reads what from-hf wrote: OUT_ROOT/step_0) and the optional
    arguments left out: transformers loads the result and its logits equal the original's."""
    commands = _readme_commands("python -m trainer.checkpoint.convert ")
    from_hf = next(c for c in commands if " from-hf " in c)
    to_hf = next(c for c in commands if " to-hf " in c)
    out_root, back = tmp_path / "ours", tmp_path / "back"
    filled = {"HF_DIR": hf_dirs["llama"], "OUT_ROOT": out_root, "CHECKPOINT": out_root / "step_0", "OUT_DIR": back}
    for line in (from_hf, to_hf):
        words = [str(filled.get(w, w)) for w in shlex.split(re.sub(r"\[[^]]*\]", "", line))]
        assert words[:3] == ["python", "-m", "trainer.checkpoint.convert"]
        res = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, cwd=ROOT, timeout=300)
        print(" ".join(words), "->", res.stdout.strip())
        assert res.returncode == 0, f"{' '.join(words)}: {res.stderr}"
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs["llama"], dtype=torch.float32)
    converted = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(back).encode("Once upon a time")])
    with torch.no_grad():
        assert torch.equal(original(input_ids=ids).logits, converted(input_ids=ids).logits)


def test_shape_mismatch_is_refused_naming_the_field(hf_dirs, tiny_data, tmp_path):
    res = run_trainer(1, _overrides(tiny_data, tmp_path, "bad", "llama", f"init.from={hf_dirs['llama']}",
                                    "model.hiddenSize=256", "training.steps=1", "checkpoint.uri="))
    assert res.returncode == exitcodes.FATAL
    assert "model.hiddenSize: 256 in this run's model config but 128 in" in res.stderr
    wrong_family = run_trainer(1, _overrides(tiny_data, tmp_path, "bad2", "llama", f"init.from={hf_dirs['neox']}",
                                             "training.steps=1", "checkpoint.uri="))
    assert wrong_family.returncode == exitcodes.FATAL
    assert "model.family: llama in this run's model config but neox" in wrong_family.stderr


def test_llama31_with_a_sentencepiece_tokenizer_on_a_parquet_corpus(hf_dirs, tiny_data, tmp_path):
    """Continual pre-training as a team starts it today: a Llama 3.1-shaped model (scaled RoPE) whose
    directory ships only a SentencePiece tokenizer.model, on a Parquet corpus. init.from at TP 2
    reads the directory's tokenizer; the first-step loss equals transformers' on the same batch,
    the run trains, and to-hf gives transformers a directory whose tokenizer reads the same ids."""
    texts = texts_of(tiny_data["stories"])
    hf_dir, corpus = llama31_sentencepiece_parquet(hf_dirs["llama3.1"], tiny_data["stories"], tmp_path)
    model_cfg = json.dumps(MODELS["llama3.1"][0])
    common = [f"model={model_cfg}", f"data.sources=[{{uri: {corpus}, textField: content}}]", "data.tokenizer=",
              f"init.from={hf_dir}", "parallelism.tensor=2", "training.globalBatchSize=8",
              "training.microBatchSize=4", "training.warmupSteps=2", "training.steps=12", "training.lr=3.0e-3",
              f"logging.lossesFile={tmp_path / 'run.jsonl'}", "logging.interval=1",
              f"checkpoint.uri={tmp_path / 'ckpt'}", "checkpoint.intervalSteps=12", "checkpoint.keep=0"]
    res = run_trainer(2, common)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = read_losses(tmp_path / "run.jsonl")

    from trainer.config import load
    from trainer.data.packed import PackedDataset
    cfg = load(str(TINY_CONFIG), common)
    assert cfg.data.tokenizer == f"{hf_dir}/tokenizer.json"  # init.from's; read as its tokenizer.model
    inputs, targets = PackedDataset(cfg.data, cfg.training.seq_len, cfg.training.seed, 512).next_batch(8)
    assert (inputs == 1).sum() > 0  # the SentencePiece BOS (id 1) starts documents
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = F.cross_entropy(theirs(input_ids=inputs).logits.flatten(0, 1), targets.flatten()).item()
    print(f"llama3.1 + SentencePiece + Parquet, TP 2: first loss {losses[1]['loss']:.7f} transformers {expected:.7f}, "
          f"step 12 {losses[12]['loss']:.4f}")
    assert losses[1]["loss"] == pytest.approx(expected, abs=1e-5)
    assert losses[12]["loss"] < losses[1]["loss"]

    out = tmp_path / "back"
    back = subprocess.run([sys.executable, "-m", "trainer.checkpoint.convert", "to-hf", str(tmp_path / "ckpt"), str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert back.returncode == 0, back.stderr
    assert transformers.AutoConfig.from_pretrained(out).rope_parameters["rope_type"] == "llama3"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    from trainer.data.tokenizer import read_tokenizer
    ours, _ = read_tokenizer(str(hf_dir / "tokenizer.model"), "</s>")
    assert tokenizer.encode(texts[5]) == ours.encode_batch([texts[5]])[0].ids
