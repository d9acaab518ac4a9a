"""Tiny Hugging Face models (random weights, transformers' own classes) and a continual
pre-training corpus, made offline for the trainer and e2e tiers: one source for the families'
configurations and the Llama 3.1 + SentencePiece + Parquet case."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import transformers

MODELS = {  # our model config (the tiny preset plus overrides) and the matching transformers config
    "llama": ({"preset": "tiny"},
              lambda: transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352,
                                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                               rms_norm_eps=1e-5, max_position_embeddings=256,
                                               tie_word_embeddings=False)),
    # Llama 3.1's scaled RoPE, its original context (32) below the run's sequence (128) so it matters
    "llama3.1": ({"preset": "tiny", "ropeScaling": "llama3", "ropeFactor": 8.0, "ropeOriginalMaxPositions": 32},
                 lambda: transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352,
                                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                  rms_norm_eps=1e-5, max_position_embeddings=256,
                                                  tie_word_embeddings=False, rope_parameters={
                                                      "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 32})),
    # Llama 3.2 1B/3B's shape: the head is the embedding (one parameter, trained through both uses)
    "llama3.2": ({"preset": "tiny", "tieEmbeddings": True},
                 lambda: transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352,
                                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                  rms_norm_eps=1e-5, max_position_embeddings=256,
                                                  tie_word_embeddings=True)),
    # Qwen3 0.6B's shape: q/k norms, head_dim (64) apart from hidden / heads (32), tied
    "qwen3": ({"preset": "tiny", "qkNorm": True, "headSize": 64, "tieEmbeddings": True},
              lambda: transformers.Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=352,
                                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=256,
                                               tie_word_embeddings=True,
                                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen2": ({"preset": "tiny", "qkvBias": True},
              lambda: transformers.Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=352,
                                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                               rms_norm_eps=1e-5, max_position_embeddings=256,
                                               tie_word_embeddings=False,
                                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "neox": ({"preset": "tiny", "family": "neox", "numKvHeads": 4, "intermediateSize": 512, "rotaryPct": 0.25},
             lambda: transformers.GPTNeoXConfig(vocab_size=512, hidden_size=128, intermediate_size=512,
                                                num_hidden_layers=4, num_attention_heads=4, layer_norm_eps=1e-5,
                                                max_position_embeddings=256)),
}


def save_tiny(family: str, path: Path, tokenizer: str, seed: int = 7, max_shard_size: str = "1GB") -> Path:
    """``family``'s tiny transformers model saved in ``path`` with the tokenizers file
    ``tokenizer`` (biases and norms perturbed so that a mapping mistake cannot hide behind zeros
    and ones)."""
    import torch
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(MODELS[family][1]())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    shutil.copy(tokenizer, Path(path) / "tokenizer.json")
    return Path(path)


def texts_of(stories: str) -> list[str]:
    """The tiny corpus's documents (its raw JSONL shards), in order."""
    return [json.loads(line)["text"] for f in sorted(Path(stories).glob("*.jsonl"))
            for line in f.read_text().splitlines()]


def llama31_sentencepiece_parquet(llama31: Path, stories: str, out: Path) -> tuple[Path, Path]:
    """Continual pre-training as a team starts it today: a copy of the Llama 3.1-shaped model
    ``llama31`` whose directory ships only a SentencePiece tokenizer.model (trained on the
    corpus, BOS 1, EOS 2), and the corpus as Parquet files whose text column is ``content``.
    Returns (model directory, corpus directory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece

    texts = texts_of(stories)
    hf_dir = out / "llama31-spm"
    shutil.copytree(llama31, hf_dir)
    (hf_dir / "tokenizer.json").unlink()
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts[:2000]), model_writer=model, vocab_size=480, model_type="bpe", bos_id=1,
        eos_id=2, unk_id=0, pad_id=-1, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, minloglevel=2)
    (hf_dir / "tokenizer.model").write_bytes(model.getvalue())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer",
                                                             "add_bos_token": True, "eos_token": "</s>"}))
    corpus = out / "corpus"
    corpus.mkdir()
    for k in range(2):
        pq.write_table(pa.table({"id": list(range(len(texts[k::2]))), "content": texts[k::2]}),
                       corpus / f"part-{k}.parquet")
    return hf_dir, corpus
