"""Hugging Face checkpoints and ours: configs, a lazy safetensors reader, per-rank shards, merging.

One table (:func:`param_map`) says how each of our parameters relates to Hugging Face's
tensors, for the Llama family (``LLAMA_FAMILIES``: Llama 2 and 3.x, Mistral, Qwen2/2.5, Qwen3) and
GPT-NeoX (``GPTNeoXForCausalLM``); both directions use it:

``rows``     column-parallel: split by rows over TP ranks (embeddings, lm_head, NeoX up_proj)
``blocks``   several HF tensors stacked, each split by rows: on rank r, qkv_proj is
             cat(q_r, k_r, v_r) and gate_up_proj is cat(gate_r, up_r) (NxD's stride layout)
``heads``    GPT-NeoX's query_key_value, interleaved per head ([q, k, v] of head 0, of head 1,
             ...): rank r reads its heads' contiguous rows and regroups them as cat(q_r, k_r, v_r)
``cols``     row-parallel weights (o_proj, down_proj): split by columns
``full``     replicated (norms, row-parallel biases)

Reading is lazy: a rank reads only the rows it keeps, tensor by tensor, with ranged reads of
the safetensors files (local or any fsspec URL such as s3://), never the whole model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import fsspec
import torch

from ..store import node_reads
from ..config import ConfigError, ModelConfig, camel
from ..store.errors import describe, retry

CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_NAMES = {v: k for k, v in _DTYPES.items()}


# --------------------------------------------------------------------------------------------
# Reading a Hugging Face directory
# --------------------------------------------------------------------------------------------


class SafetensorsDir:
    """The tensors of a Hugging Face model directory, read lazily.

    safetensors' own ``safe_open`` needs a local file; this reads the same format (an 8-byte
    header length, a JSON header of dtype, shape and byte offsets, then row-major data) through
    fsspec, so a rank fetches only the byte ranges of the rows it keeps, from disk or S3."""

    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.uri)
        self.root = self.root.rstrip("/")
        self._headers: dict[str, tuple[dict, int]] = {}
        index = _read_object(f"{self.uri}/{INDEX}")  # every rank reads it: once per node (trainer.store.node_reads)
        if index is not None:
            self.files = _json(index, f"{self.uri}/{INDEX}")["weight_map"]
        elif _exists(f"{self.uri}/{SINGLE}"):
            self.files = {name: SINGLE for name in self._header(SINGLE)[0] if name != "__metadata__"}
        else:
            raise ConfigError("init.from", f"no {SINGLE} or {INDEX} in {uri}")

    def _cat(self, file: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of one file, retried while the store's errors are transient."""
        uri = f"{self.uri}/{file}"
        try:
            # start/end by keyword: s3fs's cat_file takes a version id as its second argument
            return retry(lambda: self.fs.cat_file(f"{self.root}/{file}", start=start, end=end), f"read {uri}")
        except OSError as exc:  # what retrying cannot mend (trainer.store.errors)
            raise ConfigError("init.from", f"cannot read {uri}: {describe(exc)}") from None

    def _header(self, file: str) -> tuple[dict, int]:
        if file not in self._headers:
            size = int.from_bytes(self._cat(file, 0, 8), "little")
            self._headers[file] = (_json(self._cat(file, 8, 8 + size), f"{self.uri}/{file}"), 8 + size)
        return self._headers[file]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> list[int]:
        return self._header(self.files[name])[0][name]["shape"]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or rows [start, stop) of it, with one ranged read."""
        if name not in self.files:
            raise ConfigError("init.from", f"{self.uri} has no tensor {name}")
        file = self.files[name]
        header, base = self._header(file)
        info = header[name]
        dtype, shape = _DTYPES[info["dtype"]], list(info["shape"])
        start, end = info["data_offsets"]
        if rows is not None:
            row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
            start, end = start + rows[0] * row_bytes, start + rows[1] * row_bytes
            shape[0] = rows[1] - rows[0]
        data = self._cat(file, base + start, base + end)
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape).clone()


def _exists(uri: str) -> bool:
    """Whether init.from's directory holds this file (asked once per node, retried): "no" only
    when the store says so, never because it throttled."""
    try:
        return node_reads.exists(uri)
    except OSError as exc:  # refused for good (trainer.store.errors)
        raise ConfigError("init.from", f"cannot look up {uri}: {exc}") from None


def _read_object(uri: str) -> bytes | None:
    """A small file of init.from's directory every rank reads, None when the store says it is
    not there: once per node, retried."""
    try:
        return node_reads.read_object(uri)
    except FileNotFoundError:
        return None
    except OSError as exc:  # what retrying cannot mend (trainer.store.errors)
        raise ConfigError("init.from", f"cannot read {uri}: {describe(exc)}") from None


def _json(data: bytes, where: str):
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ConfigError("init.from", f"{where} is not JSON: {exc}") from None


def read_config(uri: str) -> dict:
    where = f"{uri.rstrip('/')}/{CONFIG}"
    data = _read_object(where)
    if data is None:
        raise ConfigError("init.from", f"{uri} has no {CONFIG} (not a Hugging Face model directory)")
    return _json(data, where)


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face ``model_type`` our Llama-family model represents: its class, what it
    fixes in our ModelConfig, and the config keys whose values we cannot represent (each refused
    by name). Its weight names are Llama's (``param_map``). A new Llama-shaped family is an entry
    here."""

    model_type: str
    architecture: str
    fixed: tuple[tuple[str, object], ...] = ()  # our ModelConfig fields this family sets
    refuse: tuple[tuple[str, object], ...] = ()  # (config key, a value we can represent) pairs


LLAMA_FAMILIES: dict[str, HFFamily] = {f.model_type: f for f in (
    HFFamily("llama", "LlamaForCausalLM", refuse=(("attention_bias", False), ("mlp_bias", False))),
    # Mistral v0.3 is Llama's shape; v0.1's sliding window is not (every token attends to all before it here)
    HFFamily("mistral", "MistralForCausalLM", refuse=(("sliding_window", None),)),
    # Qwen2 and Qwen2.5: biases on q, k and v only
    HFFamily("qwen2", "Qwen2ForCausalLM", fixed=(("qkv_bias", True),), refuse=(("use_sliding_window", False),)),
    # Qwen3: an RMSNorm on each query and key head, no biases, head_dim apart from hidden / heads
    HFFamily("qwen3", "Qwen3ForCausalLM", fixed=(("qk_norm", True),),
             refuse=(("attention_bias", False), ("use_sliding_window", False))),
)}

# Hugging Face's rope_type -> ours, and the rope parameters each one reads (theirs -> our field)
_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}
_ROPE_PARAMS = {"none": {}, "linear": {"factor": "rope_factor"},
                "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                           "high_freq_factor": "rope_high_freq_factor",
                           "original_max_position_embeddings": "rope_original_max_positions"}}


def _rope_fields(hf: dict, where: str) -> dict:
    """Our rope_* fields from config.json's rope_parameters (transformers 5) or rope_scaling (4.x)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ConfigError(where, f"rope type {kind!r} is not supported ({', '.join(_ROPE_TYPES)})")
    ours = _ROPE_TYPES[kind]
    out: dict = {"rope_scaling": ours}
    for theirs, field in _ROPE_PARAMS[ours].items():
        if theirs not in rope:
            raise ConfigError(where, f"rope type {kind!r} without its {theirs!r}")
        out[field] = int(rope[theirs]) if field == "rope_original_max_positions" else float(rope[theirs])
    return out


def _llama_fields(hf: dict, family: HFFamily, where: str) -> dict:
    heads = hf["num_attention_heads"]
    for key, representable in family.refuse:
        if hf.get(key, representable) != representable:
            raise ConfigError(where, f"{family.model_type} with {key}: {json.dumps(hf[key])} is not supported "
                                     f"(only {json.dumps(representable)})")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(where, f"activation {hf.get('hidden_act')!r} is not supported (silu)")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rope = hf.get("rope_parameters") or {}
    return dict(family="llama", hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"], num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads, vocab_size=hf["vocab_size"],
                norm_eps=float(hf["rms_norm_eps"]),
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rotary_pct=1.0,
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                head_size=None if head_dim * heads == hf["hidden_size"] else head_dim,
                **{"qkv_bias": False, "qk_norm": False, **_rope_fields(hf, where), **dict(family.fixed)})


def model_fields(hf: dict, where: str = "init.from") -> dict:
    """Our ModelConfig fields from a Hugging Face config.json; refuses what we cannot represent."""
    kind = hf.get("model_type")
    if kind in LLAMA_FAMILIES:
        return _llama_fields(hf, LLAMA_FAMILIES[kind], where)
    if kind == "gpt_neox":
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        heads = hf["num_attention_heads"]
        if not hf.get("use_parallel_residual", True):
            raise ConfigError(where, "GPT-NeoX without the parallel residual is not supported")
        if hf.get("hidden_act", "gelu") != "gelu":
            raise ConfigError(where, f"GPT-NeoX activation {hf.get('hidden_act')!r} is not supported (gelu)")
        if hf.get("tie_word_embeddings"):
            raise ConfigError(where, "GPT-NeoX with tie_word_embeddings is not supported")
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ConfigError(where, f"GPT-NeoX with rope type {rope.get('rope_type', rope.get('type'))!r} is not "
                                     f"supported (default)")
        return dict(family="neox", hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
                    num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=heads,
                    vocab_size=hf["vocab_size"], norm_eps=float(hf["layer_norm_eps"]),
                    rope_theta=float(rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0))),
                    rotary_pct=float(rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))))
    raise ConfigError(where, f"model_type {kind!r} is not supported ({', '.join([*LLAMA_FAMILIES, 'gpt_neox'])})")


def hf_family(cfg: ModelConfig) -> HFFamily:
    """The Hugging Face family a Llama-family ModelConfig goes out as: the first whose fixed
    fields it has (Qwen2 for qkv biases), else Llama (Mistral v0.3 too: without a sliding
    window it is Llama's computation, and LlamaForCausalLM loads it)."""
    for family in LLAMA_FAMILIES.values():
        if family.fixed and all(getattr(cfg, k) == v for k, v in family.fixed):
            return family
    return LLAMA_FAMILIES["llama"]


def check_matches(ours: ModelConfig, hf: dict, uri: str) -> None:
    """Refuse, naming our field, any shape or constant that differs from the checkpoint's."""
    for name, theirs in model_fields(hf).items():
        mine = getattr(ours, name)
        if not ours.same_field(name, theirs):
            raise ConfigError(f"model.{camel(name)}", f"{mine} in this run's model config but {theirs} in "
                                                      f"{uri}/{CONFIG}; set it to match (or pick another preset)")


def hf_config(cfg: ModelConfig) -> dict:
    """A config.json that transformers loads as its family's class (LlamaForCausalLM,
    MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM or GPTNeoXForCausalLM)."""
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  tie_word_embeddings=cfg.tie_embeddings,
                  initializer_range=cfg.init_std, torch_dtype="float32")
    if cfg.family == "llama":
        family = hf_family(cfg)
        rope_type = {v: k for k, v in _ROPE_TYPES.items()}[cfg.rope_scaling]
        rope = {"rope_type": rope_type, "rope_theta": cfg.rope_theta,
                **{theirs: getattr(cfg, field) for theirs, field in _ROPE_PARAMS[cfg.rope_scaling].items()}}
        scaled = {}
        if cfg.rope_scaling != "none":
            # rope_scaling too: transformers 4.x and other readers take the scaling from there; and a
            # context past the original (transformers warns when it is not, and caps at 2048 without it)
            scaled = dict(rope_scaling=rope, max_position_embeddings=int(
                cfg.rope_original_max_positions * cfg.rope_factor) if cfg.rope_scaling == "llama3" else
                int(2048 * cfg.rope_factor))
        return dict(common, model_type=family.model_type, architectures=[family.architecture], hidden_act="silu",
                    num_key_value_heads=cfg.num_kv_heads, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                    rope_parameters=rope, head_dim=cfg.head_dim(), **scaled,
                    **{key: representable for key, representable in family.refuse})
    return dict(common, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_act="gelu",
                layer_norm_eps=cfg.norm_eps, use_parallel_residual=True, rotary_pct=cfg.rotary_pct,
                rotary_emb_base=cfg.rope_theta, attention_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                 "partial_rotary_factor": cfg.rotary_pct})


# --------------------------------------------------------------------------------------------
# The parameter table
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    kind: str  # rows | blocks | heads | cols | full
    names: tuple[str, ...]


def param_map(cfg: ModelConfig, hf_names=None) -> dict[str, Source]:
    """Our parameter name -> how it is made of Hugging Face tensors. ``hf_names`` (a container of
    the checkpoint's names) decides whether lm_head is tied to the embeddings."""
    out: dict[str, Source] = {}
    if cfg.family == "llama":
        out["model.embed_tokens.weight"] = Source("rows", ("model.embed_tokens.weight",))
        # tied: the head is the embedding (merging writes it once); a checkpoint without a head is tied too
        untied = not cfg.tie_embeddings and (hf_names is None or "lm_head.weight" in hf_names)
        head = "lm_head.weight" if untied else "model.embed_tokens.weight"
        out["lm_head.weight"] = Source("rows", (head,))
        out["model.norm.weight"] = Source("full", ("model.norm.weight",))
        for n in range(cfg.num_layers):
            ours, theirs = f"model.layers.{n}.", f"model.layers.{n}."
            attn = theirs + "self_attn."
            out[ours + "input_layernorm.weight"] = Source("full", (theirs + "input_layernorm.weight",))
            out[ours + "self_attn.qkv_proj.weight"] = Source("blocks", tuple(attn + f"{p}_proj.weight" for p in "qkv"))
            if cfg.qkv_bias:
                out[ours + "self_attn.qkv_proj.bias"] = Source("blocks", tuple(attn + f"{p}_proj.bias" for p in "qkv"))
            if cfg.qk_norm:
                for p in "qk":
                    out[ours + f"self_attn.{p}_norm.weight"] = Source("full", (attn + f"{p}_norm.weight",))
            out[ours + "self_attn.o_proj.weight"] = Source("cols", (attn + "o_proj.weight",))
            out[ours + "post_attention_layernorm.weight"] = Source("full", (theirs + "post_attention_layernorm.weight",))
            out[ours + "mlp.gate_up_proj.weight"] = Source("blocks", (theirs + "mlp.gate_proj.weight",
                                                                       theirs + "mlp.up_proj.weight"))
            out[ours + "mlp.down_proj.weight"] = Source("cols", (theirs + "mlp.down_proj.weight",))
        return out
    out["model.embed_tokens.weight"] = Source("rows", ("gpt_neox.embed_in.weight",))
    # Checkpoints name the NeoX head embed_out (transformers 5 calls the module lm_head and maps it).
    head = "embed_out.weight" if hf_names is None or "embed_out.weight" in hf_names else "lm_head.weight"
    out["lm_head.weight"] = Source("rows", (head,))
    for p in ("weight", "bias"):
        out[f"model.norm.{p}"] = Source("full", (f"gpt_neox.final_layer_norm.{p}",))
    for n in range(cfg.num_layers):
        ours, theirs = f"model.layers.{n}.", f"gpt_neox.layers.{n}."
        for p in ("weight", "bias"):
            out[ours + f"input_layernorm.{p}"] = Source("full", (theirs + f"input_layernorm.{p}",))
            out[ours + f"post_attention_layernorm.{p}"] = Source("full", (theirs + f"post_attention_layernorm.{p}",))
            out[ours + f"self_attn.qkv_proj.{p}"] = Source("heads", (theirs + f"attention.query_key_value.{p}",))
            out[ours + f"mlp.up_proj.{p}"] = Source("rows", (theirs + f"mlp.dense_h_to_4h.{p}",))
        out[ours + "self_attn.o_proj.weight"] = Source("cols", (theirs + "attention.dense.weight",))
        out[ours + "self_attn.o_proj.bias"] = Source("full", (theirs + "attention.dense.bias",))
        out[ours + "mlp.down_proj.weight"] = Source("cols", (theirs + "mlp.dense_4h_to_h.weight",))
        out[ours + "mlp.down_proj.bias"] = Source("full", (theirs + "mlp.dense_4h_to_h.bias",))
    return out


def _rows(total: int, tp: int, rank: int) -> tuple[int, int]:
    per = total // tp
    return rank * per, (rank + 1) * per


def read_shard(src: SafetensorsDir, cfg: ModelConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's state dict (our names, fp32), read from a Hugging Face directory."""
    out = {}
    for ours, s in param_map(cfg, src).items():
        if s.kind == "rows":
            t = src.read(s.names[0], _rows(src.shape(s.names[0])[0], tp, rank))
        elif s.kind == "blocks":  # q, k, v (k, v replicated beyond numKvHeads ranks) or gate, up
            reps = _block_replicas(cfg, ours, tp)
            t = torch.cat([src.read(n, _rows(src.shape(n)[0], tp // r, rank // r)) for n, r in zip(s.names, reps)])
        elif s.kind == "heads":  # rank r's heads are contiguous rows of the interleaved tensor
            t = src.read(s.names[0], _rows(src.shape(s.names[0])[0], tp, rank))
            grouped = t.view(cfg.num_heads // tp, 3, cfg.head_dim(), *t.shape[1:])
            t = torch.cat([grouped[:, i].reshape(-1, *t.shape[1:]) for i in range(3)])
        elif s.kind == "cols":
            t = src.read(s.names[0]).chunk(tp, dim=1)[rank]
        else:
            t = src.read(s.names[0])
        out[ours] = t.float().contiguous()
    return out


def merge_to_hf(shards: list[dict[str, torch.Tensor]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors from our per-TP-rank state dicts (any tensor-parallel degree)."""
    tp, out = len(shards), {}
    for ours, s in param_map(cfg).items():
        parts = [sh[ours] for sh in shards]
        if s.kind == "rows":
            out[s.names[0]] = torch.cat(parts)
        elif s.kind == "blocks":
            sizes, reps = _block_sizes(cfg, ours, tp), _block_replicas(cfg, ours, tp)
            per_rank = [p.split(sizes) for p in parts]
            for i, name in enumerate(s.names):  # one copy of a replicated block
                out[name] = torch.cat([r[i] for rank, r in enumerate(per_rank) if rank % reps[i] == 0])
        elif s.kind == "heads":
            rest = parts[0].shape[1:]
            out[s.names[0]] = torch.cat([
                torch.stack([b.view(cfg.num_heads // tp, cfg.head_dim(), *rest) for b in p.chunk(3)], dim=1)
                .reshape(-1, *rest) for p in parts])
        elif s.kind == "cols":
            out[s.names[0]] = torch.cat(parts, dim=1)
        else:
            out[s.names[0]] = parts[0]
    return {k: v.contiguous() for k, v in out.items()}


def _block_sizes(cfg: ModelConfig, ours: str, tp: int) -> list[int]:
    if ours.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        kv = cfg.num_kv_heads * cfg.kv_replicas(tp) * cfg.head_dim() // tp
        return [cfg.num_heads * cfg.head_dim() // tp, kv, kv]
    return [cfg.intermediate_size // tp] * 2  # gate_up


def _block_replicas(cfg: ModelConfig, ours: str, tp: int) -> list[int]:
    """How many ranks hold each block of a stacked weight (model.Attention's replicas)."""
    if ours.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        return [1, cfg.kv_replicas(tp), cfg.kv_replicas(tp)]
    return [1, 1]


def shard_of(full: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state dict from Hugging Face tensors held in memory (conversion only)."""

    class _Mem:
        def __contains__(self, name):
            return name in full

        def shape(self, name):
            return list(full[name].shape)

        def read(self, name, rows=None):
            return full[name] if rows is None else full[name][rows[0]:rows[1]]

    return read_shard(_Mem(), cfg, tp, rank)  # type: ignore[arg-type]


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES[dtype]
