"""One decoder-only transformer for the Llama family and the GPT-NeoX/Pythia family.

Parameter names follow NxD's Llama training example, so a tensor-parallel shard written here
has the same keys and shapes as one written by NxD on Trainium:

    model.embed_tokens.weight                          ParallelEmbedding (vocab rows split)
    model.layers.N.input_layernorm.weight              replicated
    model.layers.N.self_attn.qkv_proj.weight           column parallel, rank r = cat(q_r, k_r, v_r)
    model.layers.N.self_attn.o_proj.weight             row parallel
    model.layers.N.post_attention_layernorm.weight     replicated
    model.layers.N.mlp.gate_up_proj.weight             column parallel, rank r = cat(gate_r, up_r)
    model.layers.N.mlp.down_proj.weight                row parallel
    model.norm.weight, lm_head.weight                  replicated, column parallel

GPT-NeoX uses the same skeleton with LayerNorm (weight and bias), biases on every projection,
``mlp.up_proj`` with GeLU instead of SwiGLU, a parallel residual, and rotary embedding on the
first ``rotary_pct`` of each head's dimensions (the layout of Hugging Face's GPTNeoX).

Weights are drawn in full from one seeded generator and then sharded, so any tensor-parallel
degree starts from exactly the same model as a single process.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .parallel import TPContext, mark_replicated


class _Init:
    """Draws full-size initial tensors in a fixed order from one generator."""

    def __init__(self, cfg: ModelConfig, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.std = cfg.init_std
        self.out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)

    def normal(self, *shape: int, output: bool = False) -> torch.Tensor:
        return torch.empty(*shape).normal_(0.0, self.out_std if output else self.std, generator=self.gen)


class Norm(nn.Module):
    """RMSNorm (Llama) or LayerNorm (NeoX); replicated over tensor parallel ranks."""

    def __init__(self, dim: int, eps: float, layer_norm: bool, tp: TPContext):
        super().__init__()
        self.eps, self.layer_norm = eps, layer_norm
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if layer_norm else None
        mark_replicated(self, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer_norm:
            return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps).to(x.dtype)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rotary_tables(cfg: ModelConfig, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rot = int(cfg.head_dim() * cfg.rotary_pct)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d]; rotates the first cos.shape[-1] dims (rotate-half convention)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = x_rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out


def attention_core(q, k, v, cos, sin, kv_repeat: int) -> torch.Tensor:
    """Rotary + causal softmax attention; the part selective checkpointing recomputes."""
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if kv_repeat > 1:
        k = k.repeat_interleave(kv_repeat, dim=1)
        v = v.repeat_interleave(kv_repeat, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, init: _Init, selective_ckpt: bool):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim()
        self.tp, self.selective_ckpt = tp, selective_ckpt
        self.heads = cfg.num_heads // tp.size
        self.kv_heads = cfg.num_kv_heads // tp.size
        self.head_dim = hd
        splits = [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd]
        neox = cfg.family == "neox"
        qkv_w = init.normal(sum(splits), h)
        self.qkv_proj = tp.column_linear(qkv_w, splits, torch.zeros(sum(splits)) if neox else None)
        self.o_proj = tp.row_linear(init.normal(h, h, output=True), torch.zeros(h) if neox else None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        b, s, _ = qkv.shape
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        if self.selective_ckpt and self.training:
            out = self.tp.checkpoint(attention_core, q, k, v, cos, sin, repeat)
        else:
            out = attention_core(q, k, v, cos, sin, repeat)
        out = out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, init: _Init):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.tp, self.swiglu = tp, cfg.family == "llama"
        if self.swiglu:
            self.gate_up_proj = tp.column_linear(init.normal(2 * i, h), [i, i])
            self.down_proj = tp.row_linear(init.normal(h, i, output=True))
        else:
            self.up_proj = tp.column_linear(init.normal(i, h), None, torch.zeros(i))
            self.down_proj = tp.row_linear(init.normal(h, i, output=True), torch.zeros(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(self.up_proj(x))
        return self.down_proj(hidden)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, init: _Init, ckpt_mode: str):
        super().__init__()
        ln = cfg.family == "neox"
        self.parallel_residual = cfg.family == "neox"
        self.input_layernorm = Norm(cfg.hidden_size, cfg.norm_eps, ln, tp)
        self.self_attn = Attention(cfg, tp, init, selective_ckpt=ckpt_mode == "selective")
        self.post_attention_layernorm = Norm(cfg.hidden_size, cfg.norm_eps, ln, tp)
        self.mlp = MLP(cfg, tp, init)

    def forward(self, x, cos, sin):
        if self.parallel_residual:
            return x + self.self_attn(self.input_layernorm(x), cos, sin) + self.mlp(self.post_attention_layernorm(x))
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, init: _Init, ckpt_mode: str):
        super().__init__()
        self.embed_tokens = tp.embedding(init.normal(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, init, ckpt_mode) for _ in range(cfg.num_layers))
        self.norm = Norm(cfg.hidden_size, cfg.norm_eps, cfg.family == "neox", tp)


class Transformer(nn.Module):
    """Decoder + LM head. ``forward(ids, targets)`` returns the mean token loss."""

    def __init__(self, cfg: ModelConfig, tp: TPContext | None = None, seed: int = 0,
                 activation_checkpointing: str = "none", max_seq_len: int = 4096):
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TPContext()
        self.full_ckpt = activation_checkpointing == "full"
        init = _Init(cfg, seed)
        self.model = Decoder(cfg, self.tp, init, activation_checkpointing)
        self.lm_head = self.tp.column_linear(init.normal(cfg.vocab_size, cfg.hidden_size))
        cos, sin = rotary_tables(cfg, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses = self.tp.cross_entropy(self.logits(ids), targets)
        valid = (targets != -100).sum().clamp(min=1)
        return losses.sum() / valid

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq, vocab / tp]: this rank's vocabulary shard of the logits."""
        s = ids.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            if self.full_ckpt and self.training:
                x = self.tp.checkpoint(layer, x, cos, sin)
            else:
                x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))
