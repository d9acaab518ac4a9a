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

Pipeline stages (``stage=(index, count)``) hold contiguous layer ranges: the embedding on the
first stage, the final norm and LM head on the last. A stage still draws every tensor in the
same order and keeps only its own, so every pipeline degree starts from the same model too;
layers keep their global index in parameter names (``model.layers.12.*`` on stage 1 of 44
layers split 4 ways), as NxD's pipeline checkpoints name them.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
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


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """RoPE's inverse frequencies, scaled as cfg.rope_scaling says; computed as transformers'
    modeling_rope_utils does for the same rope_type, so init.from a Hugging Face model matches."""
    rot = int(cfg.head_dim() * cfg.rotary_pct)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old = cfg.rope_original_max_positions
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)  # long wavelengths: scaled
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rotary_tables(cfg: ModelConfig, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = inverse_frequencies(cfg)
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
        kv_rep = cfg.kv_replicas(tp.size)  # > 1: each K/V head on kv_rep consecutive ranks
        self.heads = cfg.num_heads // tp.size
        self.kv_heads = cfg.num_kv_heads * kv_rep // tp.size
        self.head_dim = hd
        splits = [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd]
        neox = cfg.family == "neox"
        qkv_w = init.normal(sum(splits), h)
        self.qkv_proj = tp.column_linear(qkv_w, splits, torch.zeros(sum(splits)) if neox or cfg.qkv_bias else None,
                                         replicas=[1, kv_rep, kv_rep])
        self.o_proj = tp.row_linear(init.normal(h, cfg.num_heads * hd, output=True), torch.zeros(h) if neox else None)
        # Qwen3: an RMSNorm over each query and key head (weights shared by the heads, replicated)
        self.q_norm = Norm(hd, cfg.norm_eps, False, tp) if cfg.qk_norm else None
        self.k_norm = Norm(hd, cfg.norm_eps, False, tp) if cfg.qk_norm else None
        if cfg.qk_norm and tp.size > 1:
            # Each rank normalises only its own heads, so its gradient of these shared weights is
            # partial: the optimizer sums it over the TP group (as for sequence-parallel norms).
            for norm in (self.q_norm, self.k_norm):
                norm.weight.sequence_partial = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        b, s, _ = qkv.shape
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim)
        k = k.view(b, s, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
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


def stage_layers(num_layers: int, stage: tuple[int, int]) -> range:
    """The global indices of the decoder layers on pipeline stage ``stage = (index, count)``:
    contiguous and equal (derive_layout has checked that count divides num_layers)."""
    index, count = stage
    per = num_layers // count
    return range(index * per, (index + 1) * per)


class LayerStack(nn.ModuleDict):
    """Decoder layers keyed by their global index (so names match across pipeline degrees);
    iterates over the layers in order and indexes by int, like the ModuleList it replaces."""

    def __getitem__(self, key):
        return self._modules[str(key)]

    def __iter__(self):
        return iter(self._modules.values())


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, init: _Init, ckpt_mode: str, stage: tuple[int, int]):
        super().__init__()
        first, last = stage[0] == 0, stage[0] == stage[1] - 1
        mine = stage_layers(cfg.num_layers, stage)
        embed = init.normal(cfg.vocab_size, cfg.hidden_size)  # drawn on every stage: same stream
        self.embed_tokens = tp.embedding(embed) if first else None
        self.layers = LayerStack()
        for n in range(cfg.num_layers):
            if n in mine:
                self.layers[str(n)] = DecoderLayer(cfg, tp, init, ckpt_mode)
            else:
                _skip_layer(cfg, init)
        self.norm = Norm(cfg.hidden_size, cfg.norm_eps, cfg.family == "neox", tp) if last else None


def _skip_layer(cfg: ModelConfig, init: _Init) -> None:
    """Draw (and drop) one decoder layer's tensors, in DecoderLayer's order, so the layers of
    later stages get the same values as in a single process."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim()
    init.normal(cfg.num_heads * hd + 2 * cfg.num_kv_heads * hd, h)
    init.normal(h, cfg.num_heads * hd, output=True)
    if cfg.family == "llama":
        init.normal(2 * i, h)
    else:
        init.normal(i, h)
    init.normal(h, i, output=True)


class Transformer(nn.Module):
    """Decoder + LM head, or one pipeline stage of it. ``forward(ids, targets)`` returns the
    mean token loss (whole model); ``stage_forward`` runs this stage alone."""

    def __init__(self, cfg: ModelConfig, tp: TPContext | None = None, seed: int = 0,
                 activation_checkpointing: str = "none", max_seq_len: int = 4096,
                 stage: tuple[int, int] = (0, 1)):
        super().__init__()
        self.cfg, self.stage = cfg, stage
        self.first, self.last = stage[0] == 0, stage[0] == stage[1] - 1
        self.tp = tp or TPContext()
        self.full_ckpt = activation_checkpointing == "full"
        init = _Init(cfg, seed)
        self.model = Decoder(cfg, self.tp, init, activation_checkpointing, stage)
        head = init.normal(cfg.vocab_size, cfg.hidden_size)  # drawn when tied too: the same stream after it
        self.lm_head = self.tp.column_linear(head) if self.last else None
        self.retie()
        cos, sin = rotary_tables(cfg, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def retie(self) -> None:
        """With cfg.tie_embeddings the LM head's weight is the embedding's Parameter (both
        vocabulary-parallel by rows, so the shards line up at any tensor degree). Called again
        after a move that makes new Parameter objects (parallel.to_device on XLA)."""
        if self.cfg.tie_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(self.logits(ids), targets)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token loss from this rank's vocabulary shard of the logits."""
        losses = self.tp.cross_entropy(logits, targets)
        valid = (targets != -100).sum().clamp(min=1)
        return losses.sum() / valid

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq, vocab / tp]: this rank's vocabulary shard of the logits (one stage)."""
        return self.stage_forward(ids)

    def stage_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits (last stage) out."""
        for piece in self.pieces():
            x = piece(x)
        return x

    def block(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """One decoder layer with the rotary tables for x's sequence length."""
        s = x.shape[1] * (self.tp.size if self.tp.sequence_parallel else 1)
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        if self.full_ckpt and self.training:
            return self.tp.checkpoint(layer, x, cos, sin)
        return layer(x, cos, sin)

    def pieces(self) -> list[nn.Module]:
        """This stage as a list of single-input modules, in order: the embedding (first stage),
        each decoder layer, the norm and head (last stage). NxD's manual pipeline partition
        takes a model in this form (trainer.model.neuron); parameters are the model's own."""
        if not hasattr(self, "_pieces"):
            pieces: list[nn.Module] = [self.model.embed_tokens] if self.first else []
            pieces += [_Block(self, layer) for layer in self.model.layers]
            if self.last:
                pieces.append(nn.Sequential(self.model.norm, self.lm_head))
            object.__setattr__(self, "_pieces", pieces)  # not submodules: no second parameter names
        return self._pieces


class _Block(nn.Module):
    """A decoder layer as a single-input module (the rotary tables come from the model)."""

    def __init__(self, model: Transformer, layer: DecoderLayer):
        super().__init__()
        self.layer = layer
        object.__setattr__(self, "_model", model)  # a back reference, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._model.block(self.layer, x)
