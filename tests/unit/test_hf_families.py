"""The Hugging Face families our Llama-family model represents (trainer.model.hf.LLAMA_FAMILIES):
Llama 3.x with its scaled RoPE, Mistral v0.3 and Qwen2/2.5, each against transformers' own class
on a tiny random-weight model: logits from init.from's reader equal transformers', and to-hf's
config and tensors load back into the same class with the same logits. What we cannot represent
is refused by name. (TP 2 runs under the real trainer: tests/trainer/test_continual_pretraining.py.)
"""

from __future__ import annotations

import json

import pytest
import torch

from trainer.config import ConfigError, ModelConfig, from_dict as _from_dict
from trainer.model import hf
from trainer.model.transformer import Transformer

transformers = pytest.importorskip("transformers")


def from_dict(raw: dict):
    return _from_dict({**raw, "data": {"sources": ["/corpus"], "tokenizer": "/tokenizer.json"}})

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False)
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

FAMILIES = {  # a transformers config per family, with what distinguishes it
    "llama3.1": lambda: transformers.LlamaConfig(**SHAPE, rope_parameters=LLAMA31_ROPE),
    "llama-linear": lambda: transformers.LlamaConfig(**SHAPE, rope_parameters={"rope_type": "linear",
                                                                               "rope_theta": 10000.0, "factor": 4.0}),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=None,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Llama 3.2 1B/3B: Llama 3.1's RoPE and one matrix for the embedding and the head
    "llama3.2-tied": lambda: transformers.LlamaConfig(**{**SHAPE, "tie_word_embeddings": True},
                                                      rope_parameters=LLAMA31_ROPE),
    # Qwen3 0.6B's shape: q/k norms, head_dim (32) apart from hidden / heads (16), tied
    "qwen3": lambda: transformers.Qwen3Config(**{**SHAPE, "tie_word_embeddings": True}, head_dim=32,
                                              rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2.5-small-tied": lambda: transformers.Qwen2Config(**{**SHAPE, "tie_word_embeddings": True},
                                                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}


def saved(tmp_path, name: str):
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[name]())
    with torch.no_grad():  # non-zero biases and norms: a mapping mistake cannot hide behind zeros and ones
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / name)
    return model.eval(), tmp_path / name


@pytest.mark.parametrize("name", FAMILIES)
def test_init_from_reads_each_family_with_transformers_logits_and_to_hf_goes_back(tmp_path, name):
    theirs, directory = saved(tmp_path, name)
    fields = hf.model_fields(hf.read_config(str(directory)))
    cfg = ModelConfig(**fields)
    cfg.validate()
    ours = Transformer(cfg, max_seq_len=200)
    ours.load_state_dict(hf.read_shard(hf.SafetensorsDir(str(directory)), cfg, 1, 0))
    ids = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(1))  # past the original 64
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
        assert torch.allclose(ours.logits(ids), expected, atol=2e-5), (ours.logits(ids) - expected).abs().max()
    # to-hf: the config and the tensors merged from TP 2 shards load into the same class, same logits
    shards = [hf.shard_of(hf.merge_to_hf([ours.state_dict()], cfg), cfg, 2, r) for r in (0, 1)]
    out = tmp_path / f"{name}-back"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf.hf_config(cfg)))
    from safetensors.torch import save_file
    save_file(hf.merge_to_hf(shards, cfg), str(out / "model.safetensors"))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # Mistral v0.3 goes out as Llama (the same computation without a sliding window)
    assert type(back).__name__ == ("LlamaForCausalLM" if name == "mistral" else type(theirs).__name__)
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, expected)
    assert hf.model_fields(json.loads((out / "config.json").read_text())) == fields
    if cfg.tie_embeddings:  # one parameter in our model, one tensor in the export, tied in transformers
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
        assert "lm_head.weight" not in hf.merge_to_hf([ours.state_dict()], cfg)
        assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()


def test_a_tied_head_trains_as_one_parameter():
    """Gradients from the embedding and the head land on one tensor, which the optimizer sees once."""
    cfg = from_dict({"model": {"preset": "tiny", "tieEmbeddings": True}}).model
    model = Transformer(cfg, max_seq_len=16)
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids[:, :-1], ids[:, 1:]).backward()
    untied = Transformer(from_dict({"model": {"preset": "tiny"}}).model, max_seq_len=16)
    untied.lm_head.weight = untied.model.embed_tokens.weight  # the same tie made by hand: the same gradient
    untied(ids[:, :-1], ids[:, 1:]).backward()
    assert torch.equal(model.model.embed_tokens.weight.grad, untied.model.embed_tokens.weight.grad)
    with pytest.raises(ConfigError) as err:
        _from_dict({"model": {"preset": "tiny", "tieEmbeddings": True}, "parallelism": {"pipeline": 2},
                    "data": {"sources": ["/c"], "tokenizer": "/t.json"}})
    assert err.value.field == "model.tieEmbeddings"


def test_llama31_preset_is_what_its_config_json_says():
    config = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
                  rope_theta=500000.0, rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192, "rope_type": "llama3"})
    hf.check_matches(from_dict({"model": {"preset": "llama3.1-8b"}}).model, config, "meta-llama/Llama-3.1-8B")
    with pytest.raises(ConfigError) as err:
        hf.check_matches(from_dict({"model": {"preset": "llama3-8b"}}).model, config, "meta-llama/Llama-3.1-8B")
    assert err.value.field == "model.ropeScaling"


@pytest.mark.parametrize("config,named", [
    (dict(model_type="mistral", sliding_window=4096), "sliding_window: 4096"),
    (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window: true"),
    (dict(model_type="llama", attention_bias=True), "attention_bias: true"),
    (dict(model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
    (dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0}), "without its 'low_freq_factor'"),
    (dict(model_type="qwen3", attention_bias=True), "attention_bias: true"),
    (dict(model_type="gemma2"), "model_type 'gemma2' is not supported"),
])
def test_what_we_cannot_represent_is_refused_by_name(config, named):
    base = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=100, rms_norm_eps=1e-6)
    with pytest.raises(ConfigError) as err:
        hf.model_fields({**base, **config})
    assert err.value.field == "init.from" and named in err.value.message


def test_qkv_bias_is_counted_and_only_for_the_llama_family():
    plain = from_dict({"model": {"preset": "tiny"}}).model
    biased = from_dict({"model": {"preset": "tiny", "qkvBias": True}}).model
    assert biased.num_params() - plain.num_params() == plain.num_layers * (128 + 2 * 2 * 32)
    assert sum(p.numel() for p in Transformer(biased, max_seq_len=8).parameters()) == biased.num_params()
    with pytest.raises(ConfigError) as err:
        from_dict({"model": {"preset": "tiny", "family": "neox", "numKvHeads": 4, "qkvBias": True}})
    assert err.value.field == "model.qkvBias"


def test_review_findings_on_presets_mfu_and_combinations():
    # qwen3-8b's head size is hidden / heads: its config.json's head_dim 128 matches the preset
    qwen3_8b = dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                    rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
    hf.check_matches(from_dict({"model": {"preset": "qwen3-8b"}}).model, qwen3_8b, "Qwen/Qwen3-8B")
    explicit = from_dict({"model": {"preset": "qwen3-8b", "headSize": 128}}).model  # said outright: the same
    hf.check_matches(explicit, qwen3_8b, "Qwen/Qwen3-8B")
    # a tied head is a matmul: MFU counts it (num_params counts the matrix once)
    from trainer.model.metrics import flops_per_token
    tied = from_dict({"model": {"preset": "llama3.2-1b"}}).model
    untied = from_dict({"model": {"preset": "llama3.2-1b", "tieEmbeddings": False}}).model
    assert flops_per_token(tied, 2048) == flops_per_token(untied, 2048)
    for model, field in (({"preset": "tiny", "qkvBias": True, "qkNorm": True}, "model.qkNorm"),
                         ({"preset": "pythia-6.9b", "headSize": 64}, "model.headSize"),
                         ({"preset": "pythia-6.9b", "tieEmbeddings": True}, "model.tieEmbeddings")):
        with pytest.raises(ConfigError) as err:
            from_dict({"model": model})
        assert err.value.field == field
    # to-hf of a scaled RoPE writes it both ways and a context past the original
    out = hf.hf_config(from_dict({"model": {"preset": "llama3.1-8b"}}).model)
    assert out["rope_scaling"] == out["rope_parameters"] and out["max_position_embeddings"] == 65536
