import torch

from trainer.config import from_dict
from trainer.model.transformer import Transformer
from trainer.model.parallel import TPContext

DATA = {"sources": ["x"], "tokenizer": "t"}


def model_cfg(**kw):
    return from_dict({"model": {"preset": "tiny", **kw}, "data": DATA}).model


def test_parameter_names_match_nxd_llama():
    names = set(dict(Transformer(model_cfg(numLayers=1), seed=0).named_parameters()))
    assert names == {
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
        "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight"}


def test_tp_shards_follow_nxd_stride_layout():
    """On TP rank r, qkv_proj = cat(q_r, k_r, v_r) and gate_up_proj = cat(gate_r, up_r)."""
    cfg = model_cfg(numLayers=1)
    full = Transformer(cfg, seed=3)
    hd = cfg.head_dim()
    W = full.model.layers[0].self_attn.qkv_proj.weight
    q, k, v = W.split([cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd])
    gu = full.model.layers[0].mlp.gate_up_proj.weight
    g, u = gu.chunk(2)
    for r in range(2):
        shard = Transformer(cfg, TPContext(size=2, rank=r), seed=3)
        got = shard.model.layers[0].self_attn.qkv_proj.weight
        want = torch.cat([q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]])
        assert torch.equal(got, want)
        assert torch.equal(shard.model.layers[0].mlp.gate_up_proj.weight, torch.cat([g.chunk(2)[r], u.chunk(2)[r]]))
        assert torch.equal(shard.model.layers[0].self_attn.o_proj.weight,
                           full.model.layers[0].self_attn.o_proj.weight.chunk(2, dim=1)[r])
        assert torch.equal(shard.model.embed_tokens.weight, full.model.embed_tokens.weight.chunk(2)[r])


def test_scaled_init_of_output_projections():
    cfg = model_cfg(numLayers=8, hiddenSize=256, intermediateSize=512)
    m = Transformer(cfg, seed=0)
    std_o = m.model.layers[0].self_attn.o_proj.weight.std().item()
    std_q = m.model.layers[0].self_attn.qkv_proj.weight.std().item()
    assert abs(std_q - 0.02) < 0.002 and abs(std_o - 0.02 / 4) < 0.001


def test_neox_family_and_checkpointing_modes_agree():
    cfg = model_cfg(family="neox", rotaryPct=0.25, numKvHeads=4)
    ids = torch.randint(0, 512, (2, 32))
    losses = []
    for mode in ("none", "selective", "full"):
        m = Transformer(cfg, seed=1, activation_checkpointing=mode)
        loss = m(ids, ids)
        loss.backward()
        losses.append((loss.item(), m.model.layers[0].mlp.up_proj.weight.grad.norm().item()))
    assert losses[0] == losses[1] == losses[2]
    assert "model.layers.0.mlp.up_proj.bias" in dict(m.named_parameters())


def test_causal_no_peeking():
    m = Transformer(model_cfg(), seed=0)
    ids = torch.randint(0, 512, (1, 16))
    ids2 = ids.clone()
    ids2[0, -1] = (ids[0, -1] + 1) % 512
    tgt = torch.full_like(ids, -100)
    tgt[0, :8] = ids[0, 1:9]  # loss only on early positions
    assert m(ids, tgt).item() == m(ids2, tgt).item()
