"""Typed, documented configuration for a training run.

One dataclass per concern. The YAML file (and the TrainingRun spec the operator renders into
the pod's ConfigMap) uses the same fields in camelCase: ``training.globalBatchSize`` here is
``TrainingConfig.global_batch_size``. This module imports no torch: the operator uses it to
validate a TrainingRun before anything is scheduled.

Every validation error is a :class:`ConfigError` that names the field, e.g.
``parallelism.tensor: 3 does not divide model.numHeads (32)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml


class ConfigError(ValueError):
    """An invalid configuration value. ``field`` is the dotted camelCase path of the culprit."""

    def __init__(self, field_path: str, message: str):
        super().__init__(f"{field_path}: {message}")
        self.field = field_path
        self.message = message


# --------------------------------------------------------------------------------------------
# Config groups
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """Named shape (see PRESETS). Other fields given alongside it override the preset."""
    family: str = "llama"
    """'llama' (RMSNorm, SwiGLU, sequential residual) or 'neox' (LayerNorm, GeLU, parallel residual)."""
    hidden_size: int = 128
    intermediate_size: int = 352
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    """Key/value heads for grouped-query attention; equal to num_heads for multi-head attention."""
    vocab_size: int = 512
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rotary_pct: float = 1.0
    """Fraction of each head's dimensions that get rotary embedding (0.25 for GPT-NeoX/Pythia)."""
    init_std: float = 0.02
    """Std of the normal init; output projections use init_std / sqrt(2 * num_layers)."""

    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def kv_replicas(self, tensor: int) -> int:
        """Tensor-parallel ranks that hold each key/value head: 1 while the heads split over
        the ranks, tensor / numKvHeads beyond (Llama 2 70B's 8 heads at TP 32: 4), as NxD's
        GQA layer replicates them (kv_size_multiplier)."""
        return max(1, tensor // self.num_kv_heads)

    def num_params(self) -> int:
        """Parameter count (untied embeddings), used for MFU and reports."""
        h, i, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        kv = self.num_kv_heads * self.head_dim()
        attn = h * (h + 2 * kv) + h * h
        mlp = (2 if self.family == "llama" else 1) * h * i + i * h
        norms = 2 * h if self.family == "llama" else 4 * h
        biases = 0 if self.family == "llama" else (h + 2 * kv) + h + i + h
        return 2 * v * h + L * (attn + mlp + norms + biases) + (h if self.family == "llama" else 2 * h)

    def validate(self) -> None:
        if self.family not in ("llama", "neox"):
            raise ConfigError("model.family", f"must be 'llama' or 'neox', got {self.family!r}")
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{camel(name)}", "must be at least 1")
        if self.hidden_size % self.num_heads:
            raise ConfigError("model.numHeads", f"{self.num_heads} does not divide model.hiddenSize ({self.hidden_size})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("model.numKvHeads", f"{self.num_kv_heads} does not divide model.numHeads ({self.num_heads})")
        if not 0.0 < self.rotary_pct <= 1.0:
            raise ConfigError("model.rotaryPct", f"must be in (0, 1], got {self.rotary_pct}")
        if int(self.head_dim() * self.rotary_pct) % 2:
            raise ConfigError("model.rotaryPct", "rotary dimensions per head must be even")


@dataclass
class ParallelConfig:
    tensor: int = 1
    """Tensor-parallel degree (ranks that split every weight matrix)."""
    pipeline: int = 1
    """Pipeline-parallel degree: stages of contiguous layers, run on a 1F1B schedule whose
    micro-batches are the gradient-accumulation steps (globalBatchSize / (data x microBatchSize)
    must be at least this)."""
    sequence_parallel: bool = False
    """Shard activations outside attention/MLP along the sequence over the tensor-parallel group."""
    zero1: bool = False
    """Shard optimizer state (and the fp32 master weights) over the data-parallel group."""
    activation_checkpointing: str = "none"
    """'none', 'selective' (recompute the attention core) or 'full' (recompute each layer)."""

    def validate(self) -> None:
        if self.tensor < 1:
            raise ConfigError("parallelism.tensor", "must be at least 1")
        if self.pipeline < 1:
            raise ConfigError("parallelism.pipeline", "must be at least 1")
        if self.activation_checkpointing not in ("none", "selective", "full"):
            raise ConfigError("parallelism.activationCheckpointing",
                              f"must be none, selective or full, got {self.activation_checkpointing!r}")


PRECISIONS = ("bf16-sr", "mixed", "fp32")
BACKENDS = ("auto", "neuron", "cuda", "cpu", "xla")


@dataclass
class TrainingConfig:
    seq_len: int = 128
    global_batch_size: int = 16
    """Sequences per optimizer step, over all data-parallel ranks and micro batches."""
    micro_batch_size: int = 4
    """Sequences per forward/backward pass on one data-parallel rank."""
    steps: int = 200
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    decay_steps: int | None = None
    """Cosine decay length after warmup; defaults to steps - warmup_steps."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    precision: str = "fp32"
    """'bf16-sr' (bf16 weights, stochastic rounding in the update), 'mixed' (fp32 weights,
    bf16 autocast), or 'fp32'."""
    seed: int = 1234

    def validate(self) -> None:
        for name in ("seq_len", "global_batch_size", "micro_batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"training.{camel(name)}", "must be at least 1")
        if self.precision not in PRECISIONS:
            raise ConfigError("training.precision", f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError("training.minLr", f"need 0 <= minLr <= lr, got minLr={self.min_lr} lr={self.lr}")
        if self.warmup_steps < 0:
            raise ConfigError("training.warmupSteps", "must not be negative")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("training.betas", f"need two values in [0, 1), got {self.betas}")
        if self.grad_clip < 0:
            raise ConfigError("training.gradClip", "must not be negative")

    def total_decay_steps(self) -> int:
        return self.decay_steps if self.decay_steps is not None else max(1, self.steps - self.warmup_steps)


@dataclass
class DataSource:
    uri: str = ""
    """A file, a directory or a glob of .jsonl/.parquet/.arrow shards; local path or s3://."""
    weight: float = 1.0
    """Relative sampling weight when several sources are mixed."""


@dataclass
class DataConfig:
    sources: list[DataSource] = field(default_factory=list)
    tokenizer: str = ""
    """Path (local or s3://) of a Hugging Face `tokenizers` JSON file. May be left out with
    init.from a Hugging Face directory: its tokenizer.json is used."""
    eos_token: str = "</s>"
    """Token appended after every document; must exist in the tokenizer."""
    text_field: str = "text"
    packing: bool = True
    """Pack documents back to back into full rows; if false each row is one (truncated) document."""
    shuffle: bool = True
    """Shuffle shard order per epoch, deterministically from training.seed."""
    held_out: list[DataSource] = field(default_factory=list)
    """Held-out evaluation data (sources as in data.sources, mixed by weight). Perplexity on it
    is reported every evalIntervalSteps and at the end."""
    eval_interval_steps: int = 100
    """Evaluate on data.heldOut every N steps (0: only at the end). Ignored without heldOut."""
    eval_batches: int = 4
    """Global batches of held-out data per evaluation (the same batches every time)."""

    def validate(self, tokenizer_optional: bool = False) -> None:
        if not self.sources:
            raise ConfigError("data.sources", "at least one source is required")
        for name in ("sources", "held_out"):
            for i, src in enumerate(getattr(self, name)):
                if not src.uri:
                    raise ConfigError(f"data.{camel(name)}[{i}].uri", "is required")
                if src.weight <= 0:
                    raise ConfigError(f"data.{camel(name)}[{i}].weight", f"must be positive, got {src.weight}")
        if not self.tokenizer and not tokenizer_optional:
            raise ConfigError("data.tokenizer", "is required (or init.from a Hugging Face directory with a tokenizer)")
        if self.eval_interval_steps < 0:
            raise ConfigError("data.evalIntervalSteps", "must not be negative")
        if self.eval_batches < 1:
            raise ConfigError("data.evalBatches", "must be at least 1")


@dataclass
class InitConfig:
    from_: str = ""
    """Initial weights for the first start (YAML key: from): a Hugging Face model directory
    (config.json and safetensors, sharded or not), local or s3://, or one of our checkpoint
    tags (<uri>/step_N, e.g. another run's). Used only when no complete checkpoint exists:
    resume always wins. Shapes are checked against the model config before any weight moves."""

    def is_hf(self) -> bool:
        """Whether from_ names a Hugging Face directory (else it is a checkpoint tag)."""
        return bool(self.from_) and not re.search(r"(^|/)step_\d+/?$", self.from_)


@dataclass
class CheckpointConfig:
    uri: str = ""
    """Checkpoint root: a local or shared file system path, or s3://bucket/prefix. Empty = off."""
    interval_steps: int = 0
    """Save every N steps (0 = not by steps)."""
    interval_minutes: float = 0.0
    """Save when this many minutes passed since the last save (0 = not by time)."""
    async_save: bool = True
    """Write in the background after a host copy at the step boundary (YAML key: async)."""
    keep: int = 3
    """Complete checkpoints to keep (0 = all). The newest complete one is never deleted."""
    resume: str = "auto"
    """'auto' (newest complete tag, or start fresh), 'none', or a tag name."""
    save_on_stop: bool = True
    """On SIGTERM (a gang stopped for a restart, an eviction, a drained node), save the step
    reached before exiting, so the restart recomputes nothing. The pod's grace period
    (faultTolerance.teardownGraceSeconds) must cover a save; if it does not, the tag is never
    completed and the previous checkpoint is used."""

    def validate(self) -> None:
        if self.interval_steps < 0:
            raise ConfigError("checkpoint.intervalSteps", "must not be negative")
        if self.interval_minutes < 0:
            raise ConfigError("checkpoint.intervalMinutes", "must not be negative")
        if self.keep < 0:
            raise ConfigError("checkpoint.keep", "must not be negative")

    def enabled(self) -> bool:
        return bool(self.uri) and (self.interval_steps > 0 or self.interval_minutes > 0)


@dataclass
class HealthConfig:
    spike_window: int = 20
    """Steps in the running mean of the gradient norm."""
    spike_factor: float = 3.0
    """A step is a spike when its gradient norm exceeds spike_factor x the running mean."""
    nan_policy: str = "skip"
    """On a NaN/Inf loss or gradient: 'skip' the update, or 'stop' with the fatal exit code."""

    def validate(self) -> None:
        if self.spike_window < 1:
            raise ConfigError("health.spikeWindow", "must be at least 1")
        if self.spike_factor <= 1:
            raise ConfigError("health.spikeFactor", "must be greater than 1")
        if self.nan_policy not in ("skip", "stop"):
            raise ConfigError("health.nanPolicy", f"must be skip or stop, got {self.nan_policy!r}")


@dataclass
class LoggingConfig:
    interval: int = 10
    """Print a log line every N steps."""
    metrics_port: int = 0
    """Serve Prometheus metrics on this port from local rank 0 (0 = off)."""
    progress_interval_seconds: float = 5.0
    """Minimum seconds between progress annotations on the pod."""
    losses_file: str = ""
    """If set, rank 0 appends one JSON line per step (step, loss, grad norm, lr, end time, and the
    step this process resumed at) here."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    init: InitConfig = field(default_factory=InitConfig)
    backend: str = "auto"
    """'auto' (neuron, then cuda, then cpu), 'neuron', 'cuda', 'cpu', or 'xla' (torch-xla's
    own device in one process: the Neuron backend's loop without Trainium, for tests)."""

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError("backend", f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for group in (self.model, self.parallelism, self.training, self.checkpoint, self.health):
            group.validate()
        self.data.validate(tokenizer_optional=self.init.is_hf())

    def digest(self) -> str:
        """Hash of everything that shapes the model and the sample order (not intervals/logging)."""
        data = {k: v for k, v in to_dict(self.data).items() if k not in ("heldOut", "evalIntervalSteps", "evalBatches")}
        relevant = {"model": to_dict(self.model), "parallelism": to_dict(self.parallelism),
                    "data": data, "seed": self.training.seed,
                    "seqLen": self.training.seq_len, "globalBatchSize": self.training.global_batch_size}
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Parallel layout: checked in plain code before any device is touched (the operator calls it)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    world_size: int
    tensor: int
    pipeline: int
    data: int
    grad_accum_steps: int
    tokens_per_step: int


def derive_layout(world_size: int, model: ModelConfig, par: ParallelConfig, train: TrainingConfig,
                  backend: str = "auto", processes_per_node: int | None = None) -> Layout:
    """Derive the data-parallel degree and gradient accumulation, or raise naming the field.

    With a concrete ``backend``, also refuse what that backend cannot run (check_backend):
    the trainer calls this once it knows its backend, the operator at submission."""
    if world_size < 1:
        raise ConfigError("nodes", "world size must be at least 1")
    tp, pp = par.tensor, par.pipeline
    if world_size % (tp * pp):
        raise ConfigError("parallelism.tensor",
                          f"tensor x pipeline ({tp} x {pp}) does not divide the world size ({world_size})")
    if model.num_heads % tp:
        raise ConfigError("parallelism.tensor", f"{tp} does not divide model.numHeads ({model.num_heads})")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ConfigError("parallelism.tensor", f"{tp} neither divides nor is a multiple of model.numKvHeads "
                                                f"({model.num_kv_heads}); key/value heads split over the ranks "
                                                "or are replicated on tensor / numKvHeads of them")
    if model.intermediate_size % tp:
        raise ConfigError("parallelism.tensor",
                          f"{tp} does not divide model.intermediateSize ({model.intermediate_size})")
    if model.vocab_size % tp:
        raise ConfigError("parallelism.tensor", f"{tp} does not divide model.vocabSize ({model.vocab_size})")
    if par.sequence_parallel and train.seq_len % tp:
        raise ConfigError("training.seqLen",
                          f"{train.seq_len} is not divisible by parallelism.tensor ({tp}) with sequence parallel")
    if pp > 1 and model.num_layers % pp:
        raise ConfigError("parallelism.pipeline", f"{pp} does not divide model.numLayers ({model.num_layers})")
    dp = world_size // (tp * pp)
    per_step = dp * train.micro_batch_size
    if train.global_batch_size % per_step:
        raise ConfigError("training.globalBatchSize",
                          f"{train.global_batch_size} is not divisible by data parallel x microBatchSize "
                          f"({dp} x {train.micro_batch_size} = {per_step})")
    micro_batches = train.global_batch_size // per_step
    if pp > 1 and micro_batches < pp:
        raise ConfigError("training.globalBatchSize",
                          f"{train.global_batch_size} gives {micro_batches} micro-batches per step "
                          f"(globalBatchSize / (data parallel {dp} x microBatchSize {train.micro_batch_size})); "
                          f"a {pp}-stage 1F1B schedule needs at least {pp}")
    layout = Layout(world_size=world_size, tensor=tp, pipeline=pp, data=dp,
                    grad_accum_steps=micro_batches,
                    tokens_per_step=train.global_batch_size * train.seq_len)
    check_backend(backend, layout, processes_per_node)
    return layout


def check_backend(backend: str, layout: Layout, processes_per_node: int | None = None) -> None:
    """What each backend cannot run, refused before any device is touched (one list for the
    trainer's fatal exit and the operator's Valid=False)."""
    if backend == "xla" and layout.world_size > 1:
        raise ConfigError("backend", "xla runs one process only: torch-xla's CPU collectives do nothing "
                                     "across processes (pytorch/xla issues 5005, 9089); use neuron on "
                                     f"Trainium or cpu/cuda, got world size {layout.world_size}")
    if backend == "neuron" and processes_per_node and processes_per_node % layout.tensor:
        raise ConfigError("parallelism.tensor", f"{layout.tensor} must divide the processes per node "
                                                f"({processes_per_node}): on Neuron a tensor-parallel "
                                                "group stays inside one node's NeuronLink")


# --------------------------------------------------------------------------------------------
# Presets: published shapes
# --------------------------------------------------------------------------------------------

_LLAMA = dict(family="llama", rotary_pct=1.0)
_NEOX = dict(family="neox", rotary_pct=0.25, norm_eps=1e-5, rope_theta=10000.0)

PRESETS: dict[str, dict[str, Any]] = {
    # A few hundred thousand parameters: trains on a laptop CPU in minutes.
    "tiny": dict(_LLAMA, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4,
                 num_kv_heads=2, vocab_size=512),
    "llama2-7b": dict(_LLAMA, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                      num_kv_heads=32, vocab_size=32000, norm_eps=1e-5, rope_theta=1e4),
    "llama2-13b": dict(_LLAMA, hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40,
                       num_kv_heads=40, vocab_size=32000, norm_eps=1e-5, rope_theta=1e4),
    "llama2-70b": dict(_LLAMA, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                       num_kv_heads=8, vocab_size=32000, norm_eps=1e-5, rope_theta=1e4),
    "llama3-8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, vocab_size=128256, norm_eps=1e-5, rope_theta=5e5),
    "neox-20b": dict(_NEOX, hidden_size=6144, intermediate_size=24576, num_layers=44, num_heads=64,
                     num_kv_heads=64, vocab_size=50432),
    "pythia-6.9b": dict(_NEOX, hidden_size=4096, intermediate_size=16384, num_layers=32, num_heads=32,
                        num_kv_heads=32, vocab_size=50432),
}


# --------------------------------------------------------------------------------------------
# Loading: dict/YAML (camelCase) -> dataclasses, with overrides
# --------------------------------------------------------------------------------------------

# YAML keys that are not simply camelCase of the field name.
_ALIASES = {"async": "async_save", "from": "from_"}
_YAML_KEYS = {v: k for k, v in _ALIASES.items()}


def yaml_key(name: str) -> str:
    """The YAML/CRD key of a dataclass field."""
    return _YAML_KEYS.get(name) or camel(name)


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def snake(name: str) -> str:
    return _ALIASES.get(name) or re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def to_dict(obj: Any) -> Any:
    """Dataclass -> camelCase dict (the YAML/CRD form)."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            key = yaml_key(f.name)
            out[key] = to_dict(getattr(obj, f.name))
        return out
    if isinstance(obj, list):
        return [to_dict(x) for x in obj]
    return obj


def _coerce(value: Any, typ: Any, path: str) -> Any:
    if typ in (int, "int"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ConfigError(path, f"must be an integer, got {value!r}")
        return int(value)
    if typ in (float, "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"must be a number, got {value!r}")
        return float(value)
    if typ in (bool, "bool"):
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {value!r}")
        return value
    if typ in (str, "str"):
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {value!r}")
        return value
    return value


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(path or "config", f"must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        name = snake(str(key))
        where = f"{path}.{key}" if path else str(key)
        if name not in fields:
            known = ", ".join(sorted(yaml_key(n) for n in fields))
            raise ConfigError(where, f"unknown field (known: {known})")
        kwargs[name] = _convert_field(cls, name, value, where)
    return cls(**kwargs)


_GROUPS = {"model": ModelConfig, "parallelism": ParallelConfig, "training": TrainingConfig,
           "data": DataConfig, "checkpoint": CheckpointConfig, "health": HealthConfig,
           "logging": LoggingConfig, "init": InitConfig}

def _field_type(cls: type, name: str) -> Any:
    ann = cls.__annotations__[name]
    return {"int": int, "float": float, "bool": bool, "str": str, "int | None": int,
            "list[float]": list, "list[DataSource]": list}.get(ann, ann)


def _convert_field(cls: type, name: str, value: Any, where: str) -> Any:
    if cls is RunConfig and name in _GROUPS:
        return _build(_GROUPS[name], value or {}, where)
    if cls is DataConfig and name in ("sources", "held_out"):
        if not isinstance(value, list):
            raise ConfigError(where, "must be a list of {uri, weight}")
        return [_build(DataSource, v if isinstance(v, Mapping) else {"uri": v}, f"{where}[{i}]")
                for i, v in enumerate(value)]
    if cls.__annotations__[name] == "list[str]":
        if not isinstance(value, list):
            raise ConfigError(where, f"must be a list of strings, got {value!r}")
        return [_coerce(v, str, f"{where}[{i}]") for i, v in enumerate(value)]
    typ = _field_type(cls, name)
    if value is None and cls.__annotations__[name].endswith("None"):
        return None
    if typ is list:
        if not isinstance(value, list):
            raise ConfigError(where, f"must be a list, got {value!r}")
        return [_coerce(v, float, f"{where}[{i}]") for i, v in enumerate(value)]
    return _coerce(value, typ, where)


def _apply_preset(raw: dict[str, Any]) -> dict[str, Any]:
    model = raw.get("model") or {}
    if not isinstance(model, Mapping):
        raise ConfigError("model", f"must be a mapping, got {type(model).__name__}")
    model = dict(model)
    preset = model.get("preset", ModelConfig.preset)
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError("model.preset", f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    merged = {camel(k): v for k, v in PRESETS[preset].items()}
    merged.update(model)
    merged["preset"] = preset
    return {**raw, "model": merged}


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: ``3e-4`` is a number (YAML 1.1, and so
    PyYAML, read it as a string unless written ``3.0e-4``), as kubectl and the API server read
    the same manifest."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789"))


def _set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(dotted, "cannot set a field inside a non-mapping")
    node[parts[-1]] = value


def from_dict(raw: Mapping[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build and validate a RunConfig from its camelCase dict form plus ``key=value`` overrides."""
    raw = json.loads(json.dumps(raw or {}))  # deep copy, plain types
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "override must look like group.field=value")
        key, text = item.split("=", 1)
        key = ".".join(camel(p) if "_" in p else p for p in key.strip().split("."))
        _set_path(raw, key, yaml.load(text, Loader=YamlLoader) if text.strip() else "")
    cfg = _build(RunConfig, _apply_preset(raw), "")
    cfg.validate()
    if not cfg.data.tokenizer and cfg.init.is_hf():  # the model's own tokenizer
        cfg.data.tokenizer = cfg.init.from_.rstrip("/") + "/tokenizer.json"
    return cfg


def load(path: str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a YAML config file (local path or fsspec URI)."""
    import fsspec

    try:
        with fsspec.open(path, "r") as fh:
            raw = yaml.load(fh, Loader=YamlLoader) or {}
    except FileNotFoundError:
        raise ConfigError("--config", f"file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("--config", f"{path} is not valid YAML: {exc}") from None
    return from_dict(raw, overrides)
