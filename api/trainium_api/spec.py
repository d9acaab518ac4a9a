"""The TrainingRun spec: every field, its type, constraints, default and documentation.

A TrainingRun spec is the trainer's run configuration (:class:`RunConfig`: the model,
parallelism, training, data, checkpoint, health, logging and init groups, the same file
``python -m trainer --config`` reads) plus placement and fault tolerance
(:class:`TrainingRunSpec`). The CRD's schema (``trainium_api.schema``), the loader
(``trainium_api.load``) and the trainer's config all read these declarations; cross-field rules
are each group's ``validate()``. Keys are the camelCase of the field names:
``training.globalBatchSize`` is ``TrainingConfig.global_batch_size``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, get_args

from .fields import (
    DERIVED,
    Above,
    Aliases,
    ConfigError,
    Doc,
    IntOrString,
    Key,
    canonical_words,
    Min,
    MinLen,
    Newer,
    NoServerDefault,
    OneOrList,
    Positive,
    fields_of,
    path_of,
)
from . import podenv
from .launch import PREFLIGHT_PASSED_DIR, PREFLIGHT_PASSED_VOLUME
from .layout import Layout
from .runtimefaults import TERMINATION_MESSAGE_PATH

# --------------------------------------------------------------------------------------------
# Enumerations (the tuples other modules use are derived from the types)
# --------------------------------------------------------------------------------------------

Family = Literal["llama", "neox"]
RopeScaling = Literal["none", "linear", "llama3"]
ActivationCheckpointing = Literal["none", "selective", "full"]
Precision = Literal["bf16-sr", "mixed", "fp32"]
Backend = Literal["auto", "neuron", "cuda", "cpu", "xla"]
NanPolicy = Literal["skip", "stop"]
TrainerKind = Literal["builtin", "command"]
ProgressFormat = Literal["nxd", "nxdt", "regex"]
CheckpointLayout = Literal["trainer", "nxd", "nxdt"]
Unset = Literal[""]
"""The empty string: a field that is not set (a builtin trainer has no progress format)."""
# Kubernetes' CamelCase words, none a YAML 1.1 boolean (kubectl sends an unquoted on/off as
# true/false, which the API server refuses); the older lowercase words are still accepted.
StragglerPolicy = Literal["Disabled", "Report", "Replace"]
PreflightMode = Literal["Auto", "Enabled", "Disabled"]
MemoryTier = Literal["Auto", "Peers", "Disabled"]
STRAGGLER_ALIASES = Aliases((("off", "Disabled"), ("report", "Report"), ("replace", "Replace")), false="Disabled")
PREFLIGHT_ALIASES = Aliases((("auto", "Auto"), ("on", "Enabled"), ("off", "Disabled")), false="Disabled", true="Enabled")
MEMORY_ALIASES = Aliases((("auto", "Auto"), ("peers", "Peers"), ("off", "Disabled")), false="Disabled")

PRECISIONS: tuple[str, ...] = get_args(Precision)
BACKENDS: tuple[str, ...] = get_args(Backend)
PROGRESS_FORMATS: tuple[str, ...] = get_args(ProgressFormat)
LAYOUTS: tuple[str, ...] = get_args(CheckpointLayout)

# Named model shapes (published configurations).
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
    # Llama 3.1 8B's config.json: llama3-8b with its rope_scaling (meta-llama/Llama-3.1-8B)
    "llama3.1-8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, vocab_size=128256, norm_eps=1e-5, rope_theta=5e5, rope_scaling="llama3",
                        rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                        rope_original_max_positions=8192),
    # Llama 3.2 1B and 3B (meta-llama/Llama-3.2-1B, -3B config.json): Llama 3.1's RoPE with factor 32, tied
    "llama3.2-1b": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                        num_kv_heads=8, vocab_size=128256, norm_eps=1e-5, rope_theta=5e5, rope_scaling="llama3",
                        rope_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                        rope_original_max_positions=8192, tie_embeddings=True),
    "llama3.2-3b": dict(_LLAMA, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
                        num_kv_heads=8, vocab_size=128256, norm_eps=1e-5, rope_theta=5e5, rope_scaling="llama3",
                        rope_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                        rope_original_max_positions=8192, tie_embeddings=True),
    # Mistral 7B v0.3 (no sliding window)
    "mistral-7b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, vocab_size=32768, norm_eps=1e-5, rope_theta=1e6),
    # Qwen3 0.6B and 8B (Qwen/Qwen3-0.6B, -8B config.json): q/k norms, head_dim 128 (8B: hidden / heads)
    "qwen3-0.6b": dict(_LLAMA, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_size=128, vocab_size=151936, norm_eps=1e-6, rope_theta=1e6,
                       qk_norm=True, tie_embeddings=True),
    "qwen3-8b": dict(_LLAMA, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                     num_kv_heads=8, vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True),
    # Qwen2.5 7B: q/k/v biases; its embeddings are untied
    "qwen2.5-7b": dict(_LLAMA, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                       num_kv_heads=4, vocab_size=152064, norm_eps=1e-6, rope_theta=1e6, qkv_bias=True),
    "neox-20b": dict(_NEOX, hidden_size=6144, intermediate_size=24576, num_layers=44, num_heads=64,
                     num_kv_heads=64, vocab_size=50432),
    "pythia-6.9b": dict(_NEOX, hidden_size=4096, intermediate_size=16384, num_layers=32, num_heads=32,
                        num_kv_heads=32, vocab_size=50432),
}
Preset = Literal[tuple(PRESETS)]  # type: ignore[valid-type]  # the names above, one source

# Instance types: (logical) NeuronCores (= trainer processes) per node, the extended resources a
# pod asks for (the whole node: every Trainium device and every EFA interface), and on Trainium
# the chip generation and its Logical NeuronCore setting (physical cores per trainer process).
# Sources in docs/neuron.md, "Instance types".
_TRN2 = {"processes": 64, "resources": {"aws.amazon.com/neuron": "16", "vpc.amazonaws.com/efa": "16"},
         "neuron": True, "generation": "trn2", "lnc": 2}
INSTANCE_TYPES: dict[str, dict[str, Any]] = {
    "trn1.32xlarge": {"processes": 32, "resources": {"aws.amazon.com/neuron": "16", "vpc.amazonaws.com/efa": "8"},
                      "neuron": True, "generation": "trn1", "lnc": 1},
    "trn1n.32xlarge": {"processes": 32, "resources": {"aws.amazon.com/neuron": "16", "vpc.amazonaws.com/efa": "16"},
                       "neuron": True, "generation": "trn1", "lnc": 1},
    # 16 Trainium2 chips of 8 NeuronCore-v3, grouped in pairs (LNC 2, the default): 64 ranks
    "trn2.48xlarge": dict(_TRN2),
    "trn2u.48xlarge": dict(_TRN2),  # a Trn2 UltraServer's member instance
    # Any Trn3 instance: Trn3 UltraServers take their devices through DRA only, and AWS publishes
    # no instance names or per-instance EFA counts in what we read (Gen1: 4 servers of 16
    # Trainium3, Gen2: 36 of 4): the claim's selector finds the Trn3 devices, and the device
    # count is the claim's (every Neuron device of the node). processesPerNode is required
    "trn3": {"processes": None, "resources": {}, "neuron": True, "generation": "trn3", "lnc": 2, "dra_only": True},
    "cpu": {"processes": 1, "resources": {}, "neuron": False},
    "gpu": {"processes": 8, "resources": {"nvidia.com/gpu": "8"}, "neuron": False},
}
InstanceType = Literal[tuple(INSTANCE_TYPES)]  # type: ignore[valid-type]

DeviceAllocation = Literal["Auto", "DevicePlugin", "DRA"]
NEURON_DEVICE_CLASS = "neuron.aws.com"
"""The Neuron DRA driver's DeviceClass and driver name (aws-neuron-sdk deploy/eks/dra.rst)."""
EFA_DEVICE_CLASS = "efa.networking.k8s.aws"
"""The EFA DRA driver's (DRANET, driver dra.net) DeviceClass (EKS user guide, device-management-efa)."""

TRAINER_IDENTITY = "trainium-trainer"
"""The operator's trainer identities are named ``trainium-trainer-<run>`` (one per run), a prefix
no spec may name. The bare name is the namespace-wide identity of earlier releases, which
defaulted spec.serviceAccountName to it: such a run keeps it (an admin may have given it an IAM
role), with the run's Role bound to it too."""


def trainer_identity(run_name: str) -> str:
    """The ServiceAccount, Role and RoleBinding the operator makes for a run's trainer."""
    return f"{TRAINER_IDENTITY}-{run_name}"
# The pod contract's variables, volumes and mount paths (docs/architecture.md 3.2; the operator
# sets them): spec.env and spec.volumes may not override them.
CONTRACT_ENV = podenv.CONTRACT  # each named once, in trainium_api.podenv
RETIRED_ENV = podenv.RETIRED
CONDITIONAL_ENV = podenv.CONDITIONAL
"""Contract variables set only with faultTolerance.preflight in force (the devices on Neuron, the
nodes that passed recently when there are any), NEURON_CC_FLAGS on Trainium (more flags:
compileCache.extraFlags) and NEURON_LOGICAL_NC_CONFIG on Trainium2."""
ENV_SOURCES = ("secretKeyRef", "configMapKeyRef", "fieldRef")  # the valueFrom kinds spec.env accepts
CONTRACT_VOLUMES = ("config", "dshm", "compile-cache", PREFLIGHT_PASSED_VOLUME)
CONTRACT_MOUNTS = ("/etc/trainium", "/dev/shm", TERMINATION_MESSAGE_PATH, PREFLIGHT_PASSED_DIR)
# Reserved by a later release than the first: a run an earlier operator accepted with one of
# them keeps it (and its pods go without what the contract puts there: plan.pod).
CONTRACT_ADDED_LATER = (PREFLIGHT_PASSED_VOLUME, PREFLIGHT_PASSED_DIR, podenv.PREFLIGHT_PASSED_FILE_ENV)
# Named groups a progress regex may have (trainer.pod.watch reads them).
REGEX_GROUPS = ("step", "loss", "throughput")

# A run's name names its headless Service (a DNS-1035 label) and its pods' host names
# "<name>-<index>" (DNS labels of at most 63 characters): 56 leaves room for 999,999 nodes.
RUN_NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
RUN_NAME_MAX = 56
RUN_NAME_RULE = ("metadata.name must be a DNS-1035 label of at most 56 characters (lowercase letters, digits "
                 "and '-', starting with a letter and ending with a letter or digit): it names the run's "
                 "headless Service and its pods' host names <name>-<index>")


def check_run_name(name: str) -> str | None:
    """Why ``name`` cannot name a TrainingRun, or None when it can."""
    if not isinstance(name, str) or len(name) > RUN_NAME_MAX or not re.fullmatch(RUN_NAME_PATTERN, name):
        return RUN_NAME_RULE
    return None


def check_regex(pattern: str) -> str | None:
    """Why ``pattern`` cannot be a progress regex (trainer.progressRegex), or None when it can."""
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        return f"invalid regular expression: {exc}"
    if "step" not in rx.groupindex:
        return "needs a named group 'step', e.g. (?P<step>\\d+)"
    unknown = sorted(set(rx.groupindex) - set(REGEX_GROUPS))
    if unknown:
        return f"unknown named group {unknown[0]!r} (known: {', '.join(REGEX_GROUPS)})"
    return None


AtLeastOne = Annotated[int, Min(1)]
NonNegative = Annotated[int, Min(0)]
NonNegativeNumber = Annotated[float, Min(0)]
PositiveNumber = Annotated[float, Positive()]

# --------------------------------------------------------------------------------------------
# The trainer's groups
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    SERVER_DEFAULTS: ClassVar[bool] = False  # a default hiddenSize would override the preset's

    preset: Preset = "tiny"
    """Named shape (see PRESETS). Other fields given alongside it override the preset."""
    family: Family = "llama"
    """'llama' (RMSNorm, SwiGLU, sequential residual) or 'neox' (LayerNorm, GeLU, parallel residual)."""
    hidden_size: AtLeastOne = 128
    intermediate_size: AtLeastOne = 352
    num_layers: AtLeastOne = 4
    num_heads: AtLeastOne = 4
    num_kv_heads: AtLeastOne = 2
    """Key/value heads for grouped-query attention; equal to num_heads for multi-head attention."""
    head_size: Annotated[int | None, Min(1), Newer("0.2")] = None
    """Dimensions per attention head (Hugging Face's head_dim); default hiddenSize / numHeads.
    Qwen3's small models set it apart (0.6B: 1024 / 16 heads, head_dim 128)."""
    vocab_size: AtLeastOne = 512
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rotary_pct: float = 1.0
    """Fraction of each head's dimensions that get rotary embedding (0.25 for GPT-NeoX/Pythia)."""
    rope_scaling: Annotated[RopeScaling, Newer("0.2")] = "none"
    """RoPE frequency scaling, as Hugging Face's rope_type: 'none' (default), 'linear'
    (frequencies / ropeFactor) or 'llama3' (Llama 3.1-3.3: low frequencies / ropeFactor, high
    kept, a smooth ramp between, set by ropeLowFreqFactor, ropeHighFreqFactor and
    ropeOriginalMaxPositions)."""
    rope_factor: Annotated[float, Newer("0.2")] = 1.0
    """ropeScaling's factor: how much longer the context is than the original's."""
    rope_low_freq_factor: Annotated[float, Newer("0.2")] = 1.0
    """llama3 scaling: wavelengths above ropeOriginalMaxPositions / this are divided by ropeFactor."""
    rope_high_freq_factor: Annotated[float, Newer("0.2")] = 4.0
    """llama3 scaling: wavelengths below ropeOriginalMaxPositions / this are kept."""
    rope_original_max_positions: Annotated[int, Min(1), Newer("0.2")] = 8192
    """llama3 scaling: the context length the model was first trained at."""
    qkv_bias: Annotated[bool, Newer("0.2")] = False
    """Biases on the query, key and value projections (Qwen2/2.5), in the Llama family."""
    qk_norm: Annotated[bool, Newer("0.2")] = False
    """RMSNorm on each query and key head before RoPE (Qwen3)."""
    tie_embeddings: Annotated[bool, Newer("0.2")] = False
    """The LM head is the embedding matrix, one parameter (Llama 3.2 1B/3B, Qwen2.5 0.5B-3B:
    Hugging Face's tie_word_embeddings). Not with pipeline parallelism."""
    init_std: float = 0.02
    """Std of the normal init; output projections use init_std / sqrt(2 * num_layers)."""

    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    def same_field(self, name: str, theirs) -> bool:
        """Whether this config's field ``name`` (snake case) says what ``theirs`` says: numbers
        to 1e-9, and a head size by the dimension it gives (unset is hidden / heads)."""
        if name == "head_size":
            return self.head_dim() == (theirs or self.hidden_size // self.num_heads)
        mine = getattr(self, name)
        if isinstance(theirs, float) and isinstance(mine, (int, float)) and not isinstance(mine, bool):
            return math.isclose(mine, theirs, rel_tol=1e-9)
        return mine == theirs

    def kv_replicas(self, tensor: int) -> int:
        """Tensor-parallel ranks that hold each key/value head: 1 while the heads split over
        the ranks, tensor / numKvHeads beyond (Llama 2 70B's 8 heads at TP 32: 4), as NxD's
        GQA layer replicates them (kv_size_multiplier)."""
        return max(1, tensor // self.num_kv_heads)

    def num_params(self) -> int:
        """Parameter count (the embeddings once when tied), used for MFU and reports."""
        h, i, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        q, kv = self.num_heads * self.head_dim(), self.num_kv_heads * self.head_dim()
        attn = h * (q + 2 * kv) + q * h + (2 * self.head_dim() if self.qk_norm else 0)
        mlp = (2 if self.family == "llama" else 1) * h * i + i * h
        norms = 2 * h if self.family == "llama" else 4 * h
        biases = ((q + 2 * kv) if self.qkv_bias else 0) if self.family == "llama" else (q + 2 * kv) + h + i + h
        embeddings = (1 if self.tie_embeddings else 2) * v * h
        return embeddings + L * (attn + mlp + norms + biases) + (h if self.family == "llama" else 2 * h)

    def validate(self) -> None:
        if self.hidden_size % self.num_heads and self.head_size is None:
            raise ConfigError("model.numHeads", f"{self.num_heads} does not divide model.hiddenSize ({self.hidden_size}); "
                              f"or set model.headSize")
        if self.family != "llama":  # GPT-NeoX's layout has none of these (trainer.model.hf)
            for name, value in (("qkNorm", self.qk_norm), ("headSize", self.head_size),
                                ("tieEmbeddings", self.tie_embeddings)):
                if value:
                    raise ConfigError(f"model.{name}", "is for the llama family")
        if self.qk_norm and self.qkv_bias:  # no Hugging Face family has both: it could not go out
            raise ConfigError("model.qkNorm", "with model.qkvBias: no family has both (Qwen2 has the "
                                              "biases, Qwen3 the norms)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("model.numKvHeads", f"{self.num_kv_heads} does not divide model.numHeads ({self.num_heads})")
        if not 0.0 < self.rotary_pct <= 1.0:
            raise ConfigError("model.rotaryPct", f"must be in (0, 1], got {self.rotary_pct}")
        if int(self.head_dim() * self.rotary_pct) % 2:
            raise ConfigError("model.rotaryPct", "rotary dimensions per head must be even")
        if self.rope_scaling != "none" and self.rope_factor < 1.0:
            raise ConfigError("model.ropeFactor", f"must be at least 1 with ropeScaling {self.rope_scaling}, "
                              f"got {self.rope_factor}")
        if self.rope_scaling == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ConfigError("model.ropeHighFreqFactor", f"need 0 < ropeLowFreqFactor < ropeHighFreqFactor, got "
                              f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}")
        if self.qkv_bias and self.family != "llama":
            raise ConfigError("model.qkvBias", "is for the llama family (GPT-NeoX has every bias already)")


@dataclass
class ParallelConfig:
    tensor: AtLeastOne = 1
    """Tensor-parallel degree (ranks that split every weight matrix)."""
    pipeline: AtLeastOne = 1
    """Pipeline-parallel degree: stages of contiguous layers, run on a 1F1B schedule whose
    micro-batches are the gradient-accumulation steps (globalBatchSize / (data x microBatchSize)
    must be at least this)."""
    sequence_parallel: bool = False
    """Shard activations outside attention/MLP along the sequence over the tensor-parallel group."""
    zero1: bool = False
    """Shard optimizer state (and the fp32 master weights) over the data-parallel group."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """'none', 'selective' (recompute the attention core) or 'full' (recompute each layer)."""



@dataclass
class TrainingConfig:
    seq_len: AtLeastOne = 128
    global_batch_size: AtLeastOne = 16
    """Sequences per optimizer step, over all data-parallel ranks and micro batches."""
    micro_batch_size: AtLeastOne = 4
    """Sequences per forward/backward pass on one data-parallel rank."""
    steps: AtLeastOne = 200
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: NonNegative = 20
    decay_steps: int | None = None
    """Cosine decay length after warmup; defaults to steps - warmup_steps."""
    weight_decay: NonNegativeNumber = 0.1
    grad_clip: NonNegativeNumber = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    precision: Precision = "fp32"
    """'bf16-sr' (bf16 weights, stochastic rounding in the update), 'mixed' (fp32 weights,
    bf16 autocast), or 'fp32'."""
    seed: int = 1234

    def validate(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError("training.minLr", f"need 0 <= minLr <= lr, got minLr={self.min_lr} lr={self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("training.betas", f"need two values in [0, 1), got {self.betas}")

    def total_decay_steps(self) -> int:
        return self.decay_steps if self.decay_steps is not None else max(1, self.steps - self.warmup_steps)


@dataclass
class DataSource:
    SERVER_DEFAULTS: ClassVar[bool] = False
    SHORTHAND: ClassVar[str] = "uri"  # `- s3://bucket/shards/` is `- {uri: s3://bucket/shards/}`

    uri: Annotated[str, MinLen(1)]
    """A file, a directory or a glob of raw-text shards (.jsonl, .jsonl.gz, .jsonl.zst, .parquet,
    .arrow; a datasets.save_to_disk folder), or a directory trainer.data.prepare wrote; local
    path or s3://."""
    weight: PositiveNumber = 1.0
    """Relative sampling weight when several sources are mixed."""
    text_field: Annotated[str, Newer("0.2")] = ""
    """The JSON key or column holding this source's text (empty: data.textField)."""


@dataclass
class DataConfig:
    SERVER_DEFAULTS: ClassVar[bool] = False  # data sources have no meaningful default

    sources: Annotated[list[DataSource], MinLen(1)] = field(default_factory=list)
    """Training data: a list of {uri, weight, textField} (mixed by weight) or of URIs (weight 1)."""
    tokenizer: str = ""
    """Path (local or s3://) of a Hugging Face `tokenizers` JSON file, a SentencePiece
    tokenizer.model, or a directory holding either (tokenizer.json first). May be left out with
    init.from a Hugging Face directory: its tokenizer is used."""
    eos_token: str = "</s>"
    """Token appended after every document; must exist in the tokenizer."""
    text_field: str = "text"
    """The JSON key or column holding the text, for every source that does not set its own."""
    packing: bool = True
    """Pack documents back to back into full rows; if false each row is one (truncated) document."""
    shuffle: bool = True
    """Shuffle shard order per epoch, deterministically from training.seed."""
    held_out: Annotated[list[DataSource], OneOrList()] = field(default_factory=list)
    """Held-out evaluation data, written as data.sources is (one URI, a list of URIs, or a list
    of {uri, weight}). Perplexity on it is reported every evalIntervalSteps and at the end."""
    eval_interval_steps: NonNegative = 100
    """Evaluate on data.heldOut every N steps (0: only at the end). Ignored without heldOut."""
    eval_batches: AtLeastOne = 4
    """Global batches of held-out data per evaluation (the same batches every time)."""
    allow_changed_sources: bool = False
    """Resume from a checkpoint written with other data.sources (a URI or a prefix changed, a
    source added, removed or reordered) or another data.tokenizer. Refused by default, naming the field: the saved data
    positions belong to the old sources. true: the model and optimizer resume and the new
    sources are read from their beginning (continual pre-training on new data). A changed
    weight alone is not refused: the positions stay valid. Also refused: another eosToken,
    textField or packing. Our trainer only: a command trainer's checkpoints are its own."""

    def text_field_of(self, source: DataSource) -> str:
        return source.text_field or self.text_field

    def validate(self, tokenizer_optional: bool = False) -> None:
        if not self.sources:
            raise ConfigError("data.sources", "at least one source is required")
        if not self.tokenizer and not tokenizer_optional:
            raise ConfigError("data.tokenizer", "is required (or init.from a Hugging Face directory with a tokenizer)")


@dataclass
class InitConfig:
    SERVER_DEFAULTS: ClassVar[bool] = False

    from_: Annotated[str, Key("from")] = ""
    """Initial weights for the first start (YAML key: from): a Hugging Face model directory
    (config.json and safetensors, sharded or not), local or s3://, or one of our checkpoint
    tags (<uri>/step_N, e.g. another run's). Used only when no complete checkpoint exists:
    resume always wins. Shapes are checked against the model config before any weight moves."""

    def is_hf(self) -> bool:
        """Whether from_ names a Hugging Face directory (else it is a checkpoint tag)."""
        return bool(self.from_) and not re.search(r"(^|/)step_\d+/?$", self.from_)


@dataclass
class CheckpointConfig:
    uri: Annotated[str, NoServerDefault()] = ""
    """Checkpoint root: a local or shared file system path, or s3://bucket/prefix. Empty = off."""
    interval_steps: NonNegative = 0
    """Save every N steps (0 = not by steps)."""
    interval_minutes: NonNegativeNumber = 0.0
    """Save when this many minutes passed since the last save (0 = not by time)."""
    async_save: Annotated[bool, Key("async")] = True
    """Write in the background after a host copy at the step boundary (YAML key: async)."""
    keep: NonNegative = 3
    """Complete checkpoints to keep (0 = all); at least 2 whatever this says (1 keeps the newest
    2), so that a restore finding the newest damaged (a shard cut short or deleted) can fall back
    to the one before. The newest complete one is never deleted."""
    resume: str = "auto"
    """'auto' (newest complete tag, or start fresh), 'none', or a tag name."""
    save_on_stop: bool = True
    """On SIGTERM (a gang stopped for a restart, an eviction, a drained node), save the step
    reached before exiting, so the restart recomputes nothing. The pod's grace period
    (faultTolerance.teardownGraceSeconds) must cover a save; if it does not, the tag is never
    completed and the previous checkpoint is used."""

    memory: Annotated[MemoryTier, MEMORY_ALIASES] = "Auto"
    """Keep each rank's newest complete checkpoint in its node's memory (/dev/shm), so that a
    restart in the same pods (in place) restores from memory instead of the store. Auto: on
    while the node's copies fit in half of the memory free for them (/dev/shm, the node's
    MemAvailable, the pod's memory limit), decided at every save; Peers: also a copy of the
    previous node's (a ring), so that a rank on a new node (a lost node's pod replaced alone)
    restores from its peer; Disabled: the store only (the older auto, peers, off are accepted). The store stays the truth: a copy is loaded
    only for the tag the store says is complete, written by the same save (its save id), for
    the same place in the layout, with its digest intact, else that rank reads the store."""

    def __post_init__(self) -> None:
        canonical_words(self)

    def enabled(self) -> bool:
        return bool(self.uri) and (self.interval_steps > 0 or self.interval_minutes > 0)


@dataclass
class HealthConfig:
    spike_window: AtLeastOne = 20
    """Steps in the running mean of the gradient norm."""
    spike_factor: float = 3.0
    """A step is a spike when its gradient norm exceeds spike_factor x the running mean."""
    nan_policy: NanPolicy = "skip"
    """On a NaN/Inf loss or gradient: 'skip' the update, or 'stop' with the fatal exit code."""

    def validate(self) -> None:
        if self.spike_factor <= 1:
            raise ConfigError("health.spikeFactor", "must be greater than 1")


S3_URI = re.compile(r"s3://[A-Za-z0-9][A-Za-z0-9._-]*(/.*)?")


def check_store_uri(field_name: str, uri: str) -> None:
    """Raises ConfigError unless ``uri`` is s3://BUCKET[/PREFIX] or an absolute path: the operator
    never lists it, but the pods write it, with fsspec: a run must not point them at another
    protocol (http://169.254.169.254/..., the node's instance metadata) through a field that
    means a store."""
    if not (uri.startswith("/") or S3_URI.fullmatch(uri)):
        raise ConfigError(field_name, f"must be s3://BUCKET[/PREFIX] or an absolute path (a file system "
                                      f"the pods mount), got {uri!r}")


@dataclass
class LoggingConfig:
    interval: AtLeastOne = 10
    """Print a log line every N steps."""
    metrics_port: NonNegative = 0
    """Serve Prometheus metrics on this port from local rank 0 (0 = off)."""
    progress_interval_seconds: NonNegativeNumber = 5.0
    """Minimum seconds between progress annotations on the pod."""
    losses_file: str = ""
    """If set, rank 0 appends one JSON line per step (step, loss, grad norm, lr, end time, and the
    step this process resumed at) here."""
    peak_flops: NonNegativeNumber = 0.0
    """Peak FLOP/s of one rank's device, for MFU: overrides the trainer's table (Trainium,
    H100/H200/A100), for a device it lacks (a CPU has no published bf16 peak: no MFU without
    this). 0: the table's figure."""
    tensorboard: str = ""
    """If set, rank 0 writes TensorBoard scalars here, every step: loss, learning rate, gradient
    norm, tokens/s, MFU, step time, and held-out loss and perplexity. A local directory (on a
    volume the pod mounts) or s3://BUCKET[/PREFIX] such as s3://bucket/runs/name/ (uploaded off the
    step's path: a closed event file every 5 minutes and at each checkpoint). A resumed process
    replaces the steps it trains again (TensorBoard's purge step)."""

    def validate(self) -> None:
        if self.tensorboard:
            check_store_uri("logging.tensorboard", self.tensorboard)


@dataclass(kw_only=True)
class RunConfig:
    """The trainer's configuration: the file `python -m trainer --config` reads, and the part of
    a TrainingRun spec the operator renders into the pod's ConfigMap."""
    SERVER_DEFAULTS: ClassVar[bool] = True

    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    init: InitConfig = field(default_factory=InitConfig)
    backend: Backend = "auto"
    """'auto' (neuron, then cuda, then cpu), 'neuron', 'cuda', 'cpu', or 'xla' (torch-xla's
    own device in one process: the Neuron backend's loop without Trainium, for tests)."""

    def validate(self) -> None:
        for group in (self.model, self.training, self.health, self.logging):  # the others': field constraints
            group.validate()
        if self.model.tie_embeddings and self.parallelism.pipeline > 1:
            raise ConfigError("model.tieEmbeddings", f"a tied embedding lives on the first pipeline stage and the "
                              f"LM head on the last: not with parallelism.pipeline {self.parallelism.pipeline}")
        self.data.validate(tokenizer_optional=self.init.is_hf())

    def digest(self) -> str:
        """Hash of everything that shapes the model and the sample order (not intervals/logging)."""
        from .load import to_dict
        data = {k: v for k, v in to_dict(self.data).items()
                if k not in ("heldOut", "evalIntervalSteps", "evalBatches", "allowChangedSources")}
        relevant = {"model": to_dict(self.model), "parallelism": to_dict(self.parallelism),
                    "data": data, "seed": self.training.seed,
                    "seqLen": self.training.seq_len, "globalBatchSize": self.training.global_batch_size}
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


# Groups of RunConfig, by key (model, parallelism, ...): derived from its fields.
GROUPS: dict[str, type] = {f.key: f.type for f in fields_of(RunConfig) if dataclasses.is_dataclass(f.type)}

# --------------------------------------------------------------------------------------------
# The operator's groups
# --------------------------------------------------------------------------------------------


@dataclass
class RestartBudget:
    application: NonNegative = 5
    """Restarts after a rank crashed (non-fatal exit code)."""
    node: NonNegative = 10
    """Restarts after a node went NotReady, unreachable or away."""
    neuron_device: NonNegative = 10
    """Restarts after a NeuronHealth error or lost Neuron devices."""
    hang: NonNegative = 3
    """Restarts after no progress for the hang timeout."""
    eviction: NonNegative = 10
    """Restarts after a pod was evicted or deleted from outside."""
    scheduling: NonNegative = 3
    """Restarts after the gang could not be scheduled within the schedule timeout."""
    startup: NonNegative = 3
    """Restarts after a pod placed on a node did not start its container within
    startupTimeoutSeconds (image pull errors, a missing Secret or ConfigMap key, a volume that
    never mounts)."""
    straggler: NonNegative = 3
    """Restarts after a straggler's node was quarantined (faultTolerance.stragglers Replace)."""
    preflight: NonNegative = 10
    """Restarts after a node failed the pre-flight check (faultTolerance.preflight)."""
    store: NonNegative = 12
    """Restarts after the checkpoint or data store stayed unavailable past a pod's retries (about 5
    minutes of throttling, 5xx or timeouts each: 12 ride out an hour's outage). Not one of the
    job's causes: it never counts toward noProgressRestarts."""

    def for_cause(self, cause: str) -> int:
        return getattr(self, cause.replace("-", "_"))


# Failure causes: one per restart budget (neuron_device is the cause "neuron-device").
CAUSES: tuple[str, ...] = tuple(f.name.replace("_", "-") for f in dataclasses.fields(RestartBudget))
Cause = Literal[CAUSES]  # type: ignore[valid-type]  # the names above, one source
# Causes the job itself may be behind; the others are the infrastructure's, with their own budgets.
JOB_CAUSES = ("application", "hang")


@dataclass
class FaultToleranceConfig:
    restart_budget: RestartBudget = field(default_factory=RestartBudget)
    """Restarts allowed per cause within budgetWindowMinutes; one more and the run fails."""
    budget_window_minutes: PositiveNumber = 60.0
    backoff_seconds: NonNegativeNumber = 0.0
    """Wait before the first restart; doubles with each restart in the window (0 = none)."""
    max_backoff_seconds: NonNegativeNumber = 300.0
    hang_timeout_seconds: Annotated[str, IntOrString()] = "auto"
    """Seconds without step progress in any pod before the gang is restarted, or 'auto':
    hangTimeoutFactor x the slowest observed step time, at least hangTimeoutFloorSeconds."""
    hang_timeout_factor: PositiveNumber = 10.0
    hang_timeout_floor_seconds: PositiveNumber = 600.0
    startup_timeout_seconds: PositiveNumber = 3600.0
    """Time from gang Running to the first progress report (compilation and loading); also the
    longest a pod placed on a node may wait to start its container (cause startup)."""
    schedule_timeout_seconds: PositiveNumber = 600.0
    """Time for the whole gang to be scheduled. A gang not placed whole by then is released and
    placed again after a backoff, without spending a budget (a gang is placed whole or not at
    all); pods the API server would not create by then are a scheduling failure."""
    quarantine: bool = True
    """Taint and label a node whose failure caused a restart, so no attempt lands there again."""
    max_quarantined_nodes: NonNegative = 0
    """Beyond this many quarantined or avoided nodes (status.quarantinedNodes, avoidedNodes) the
    run fails as 'cluster unhealthy' (0 = nodes / 4, at least 1)."""
    no_progress_restarts: AtLeastOne = 3
    """Fail after this many consecutive restarts for application errors or hangs without the
    checkpoint step advancing (node, Neuron device, eviction and scheduling failures are the
    infrastructure's: they spend their own budgets and neither count nor break the streak)."""
    teardown_grace_seconds: NonNegativeNumber = 30.0
    """Grace period for a gang's pods to exit on SIGTERM before they are force-deleted."""
    in_place_restarts: NonNegative = 2
    """Restart the gang in place: each pod's agent stops its workers and, once every pod's have
    stopped, starts new ones, so no pod is deleted, created or scheduled. Only after a failure
    that leaves the nodes trusted (a crashed rank, a hang) and only while every pod's agent
    answers; this many consecutive in-place restarts without the checkpoint step advancing,
    and the next restart recreates the gang. 0: every restart recreates the gang. Our trainer
    only: a command trainer's gang is always recreated."""
    spares: NonNegative = 0
    """Warm spares: this many standby pods, each on a node of its own, scheduled and started
    (image pulled, container and agent running) and holding their nodes. A failure that
    replaces one pod (a lost, quarantined or avoided node, an eviction, a pod that would not
    start) gives its index to a spare at once, and a new spare is created. Needs in-place
    restarts (inPlaceRestarts above 0, our trainer); at most nodes."""
    stragglers: Annotated[StragglerPolicy, STRAGGLER_ALIASES] = "Report"
    """A pod whose compute time per step (the trainer's progress report: the time before the
    step's first collective) is above stragglerFactor x the median of the other pods for
    stragglerReports consecutive reports is a straggler. Report: an event, a metric and
    status.current.stragglers; Replace: also quarantine its node and restart the gang (budget
    restartBudget.straggler); Disabled: not watched (the older report, replace, off are accepted)."""
    straggler_factor: Annotated[float, Above(1)] = 1.5
    """How much slower than the other pods' median a pod's compute time must be (more than 1)."""
    straggler_reports: AtLeastOne = 5
    """Consecutive progress reports above the factor before a pod is called a straggler."""
    preflight: Annotated[PreflightMode, PREFLIGHT_ALIASES] = "Auto"
    """Before each attempt trains, every pod runs a check with the collectives the trainer
    uses: a timed matmul per rank, a timed all-reduce across the gang and, with 3 nodes or
    more, a timed all-reduce between pairs of nodes (each node in two pairs), and on Neuron the
    device count (neuron-ls) and a node-local collective test (nccom-test). A node that fails,
    or is more than preflightSlowFactor x slower than the median node, is left out and the gang
    restarts without it (cause preflight) before any graph is loaded. Auto: Enabled for Trainium
    instance types (a bad device or link found after the gang loaded its graphs costs a whole
    restart there), Disabled elsewhere (a small run restarts in seconds). The older auto, on, off
    are accepted (quoted: YAML reads a bare on or off as a boolean)."""
    preflight_slow_factor: Annotated[float, Above(1)] = 2.0
    """How much slower than the median node a node may be in the pre-flight check."""
    preflight_timeout_seconds: PositiveNumber = 300.0
    """The pre-flight check's time budget (its collectives time out after it)."""
    do_not_disrupt: bool = True
    """Annotate the run's pods karpenter.sh/do-not-disrupt: "true", so that Karpenter does not
    consolidate or drift-replace the nodes a gang trains on (a node moved under a gang restarts
    all of it), and give the run a PodDisruptionBudget that lets no eviction take a pod of the
    gang: a drain (kubectl drain, a node group upgrade) cordons the node and waits, the
    operator sees the cordon and moves the gang off it once, at a save, without spending the
    restart budget, and the drain then goes on. Karpenter still expires and repairs nodes, and
    a NodePool's terminationGracePeriod overrides it for drift. An edit reaches the pods made
    after it."""
    preflight_skip_minutes: NonNegativeNumber = 60.0
    """An attempt whose every node passed this run's check within this many minutes skips it
    (a restart onto the same healthy nodes pays nothing); a node that has not is checked with
    the whole gang. 0: check every attempt."""

    def __post_init__(self) -> None:
        canonical_words(self)

    def validate(self) -> None:
        for key, value, most in (("preflightTimeoutSeconds", self.preflight_timeout_seconds, 3600.0),
                                 ("preflightSlowFactor", self.preflight_slow_factor, 1000.0),
                                 ("stragglerFactor", self.straggler_factor, 1000.0),
                                 ("preflightSkipMinutes", self.preflight_skip_minutes, 10080.0)):
            if not value <= most:  # infinity too: the API server cannot carry it
                raise ConfigError(f"faultTolerance.{key}", f"must be at most {most:g}, got {value}")
        if self.preflight_timeout_seconds < 30:
            raise ConfigError("faultTolerance.preflightTimeoutSeconds",
                              f"must be at least 30 (the device tools and the collectives share it), got "
                              f"{self.preflight_timeout_seconds:g}")
        h = self.hang_timeout_seconds
        if h != "auto":
            try:
                if float(h) <= 0:
                    raise ValueError
            except (TypeError, ValueError):
                raise ConfigError("faultTolerance.hangTimeoutSeconds",
                                  f"must be 'auto' or a positive number of seconds, got {h!r}") from None


@dataclass
class CompileCacheConfig:
    path: str = "/var/tmp/neuron-compile-cache"
    """Where the trainer container sees the Neuron persistent compile cache. On the node it is a
    directory the operator chooses (its hostAccess configuration: one per namespace by default),
    never one the run names. Never a shared file system: it chokes at scale. An absolute path a
    container can mount a volume at: not /, nothing in /proc, /sys or /dev, and not at, in or
    above the operator's mounts (/etc/trainium)."""
    precompile_steps: NonNegative = 0
    """Before each attempt trains, run neuron_parallel_compile over this many steps: it extracts
    every graph without executing it and compiles them all in parallel into the cache (0: off;
    Neuron backend only). Costs one graph-extraction pass per attempt; saves the serial
    just-in-time compilation of the first steps on nodes whose cache is cold."""
    extra_flags: str = ""
    """More Neuron compiler flags, appended to the NEURON_CC_FLAGS the operator sets (e.g. "-O1"):
    NEURON_CC_FLAGS itself is the operator's (it carries the cache directory and, on trn2, the
    Logical NeuronCore setting, which must equal the runtime's), so these two may not be given."""

    def validate(self) -> None:
        for owned in ("--cache_dir", "--logical-nc-config", "-lnc"):
            if owned in self.extra_flags.split() or any(f.startswith(owned + "=") for f in self.extra_flags.split()):
                raise ConfigError("compileCache.extraFlags", f"{owned} is set by the operator (the node-local "
                                  f"cache, the instance type's Logical NeuronCore setting)")



# A command trainer's checkpoint layout follows from its progress format unless given.
LAYOUT_OF_FORMAT = {"nxd": "nxd", "nxdt": "nxdt"}
# With a command, the only fields of our trainer's groups the operator still reads.
COMMAND_TRAINER_FIELDS = {"checkpoint": ("uri",), "logging": ("progressIntervalSeconds",)}


@dataclass
class TrainerConfig:
    kind: TrainerKind = "builtin"
    """builtin: this project's trainer (python -m trainer), configured by the model, parallelism,
    training, data, checkpoint, health, logging and init groups. command: your own script (e.g. an
    NxD example or NxD Training's training_orchestrator.py) run unmodified under torchrun with the
    same pod contract; its progress is read from its log and its checkpoints from checkpoint.uri,
    in its pods (python -m trainer.watch)."""
    command: list[str] = field(default_factory=list)
    """With kind command: what torchrun runs in every process, a Python script or -m module,
    then its arguments. $(VAR) references to the pod's environment are expanded
    (e.g. --checkpoint_dir $(CHECKPOINT_URI))."""
    working_dir: str = ""
    """With kind command: the container's working directory (default: the image's)."""
    progress_format: Unset | ProgressFormat = ""
    """With kind command: how progress is read from the log. nxd: NxD examples' `LOG ... (epoch,
    step) step_loss : ...` lines; nxdt: NxD Training's progress bar (global_step=...); regex:
    progressRegex."""
    progress_regex: str = ""
    """With progressFormat regex: a Python regular expression with the named group step and
    optionally loss and throughput (samples per second), searched in every log line."""
    checkpoint_layout: Unset | CheckpointLayout = ""
    """With kind command: how checkpoints under checkpoint.uri are found (trainer, nxd, nxdt;
    default: the progress format's, nxd or nxdt). With nxdt the pods' watch appends
    exp_manager.resume_from_checkpoint=<newest complete checkpoint> (node rank 0 lists the store,
    the other pods take its choice) to the command on every start."""
    tokens_per_sample: NonNegative = 0
    """With kind command: sequence length, so tokens per second = samples per second x this (0: not reported)."""
    samples_per_step: NonNegative = 0
    """With kind command: global batch size in samples, so status.tokens = step x samplesPerStep x
    tokensPerSample (0: not reported)."""

    @property
    def is_command(self) -> bool:
        return self.kind == "command"

    @property
    def layout(self) -> str:
        """The checkpoint layout the pods read (and report to the operator)."""
        return self.checkpoint_layout or LAYOUT_OF_FORMAT.get(self.progress_format, "trainer")

    def validate(self) -> None:
        if not self.is_command:
            for name in ("command", "working_dir", "progress_format", "progress_regex", "checkpoint_layout"):
                if getattr(self, name):
                    raise ConfigError(path_of(TrainerConfig, name, "trainer"), "needs trainer.kind: command")
            return
        if not self.command or not self.command[0].strip():
            raise ConfigError("trainer.command", "is required with trainer.kind command: the script (or -m "
                                                 "module) torchrun runs, then its arguments")
        if not self.progress_format:
            raise ConfigError("trainer.progressFormat", f"must be one of {', '.join(PROGRESS_FORMATS)} "
                                                        "with trainer.kind command")
        if self.progress_format == "regex":
            why = check_regex(self.progress_regex)
            if why:
                raise ConfigError("trainer.progressRegex", why)
            if not self.checkpoint_layout:
                raise ConfigError("trainer.checkpointLayout", "is required with progressFormat regex "
                                                              f"({', '.join(LAYOUTS)})")
        elif self.progress_regex:
            raise ConfigError("trainer.progressRegex", "needs progressFormat regex")


# Kubernetes objects in the spec, passed through to the pod; the fields below are the ones checked.


@dataclass
class EnvVar:
    KUBE_OBJECT: ClassVar[bool] = True

    name: Annotated[str, MinLen(1)]
    value: str | None = None
    value_from: dict | None = None
    """One of secretKeyRef, configMapKeyRef, fieldRef."""


@dataclass
class Volume:
    KUBE_OBJECT: ClassVar[bool] = True
    OPEN: ClassVar[bool] = True  # the volume source: any of Kubernetes' kinds

    name: Annotated[str, MinLen(1)]


@dataclass
class VolumeMount:
    KUBE_OBJECT: ClassVar[bool] = True

    name: str
    mount_path: str
    read_only: bool | None = None
    sub_path: str | None = None


POD_RESOURCES = ("cpu", "memory", "ephemeral-storage", "hugepages-*")
"""What spec.podTemplate.spec.resources (and an init container's) may request: the Neuron devices
and EFA interfaces are the instance type's, set by the operator."""
SECURITY_CONTEXT_KEYS = ("runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem",
                         "allowPrivilegeEscalation")
"""What an init container's securityContext may say (allowPrivilegeEscalation only false); the
operator adds what the trainer container has: every capability dropped, RuntimeDefault seccomp."""
INIT_CONTAINER_KEYS = ("name", "image", "imagePullPolicy", "command", "args", "workingDir", "env", "envFrom",
                       "ports", "resources", "volumeMounts", "restartPolicy", "securityContext", "startupProbe",
                       "readinessProbe", "livenessProbe", "lifecycle", "terminationMessagePolicy")
"""The Container fields an init container (or sidecar) of spec.podTemplate may have."""


@dataclass
class PodTemplateMetadata:
    labels: dict[str, str] = field(default_factory=dict)
    """Labels of every pod of the run (e.g. a team's cost label). Not trainium.dev/*, the
    operator's. The run's own kueue.x-k8s.io/* labels reach its pods too."""
    annotations: dict[str, str] = field(default_factory=dict)
    """Annotations of every pod of the run (not trainium.dev/*, the operator's)."""


@dataclass
class PodTemplateSpec:
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels the pods need, with the operator's (the instance type on Trainium), e.g. a
    Karpenter NodePool's karpenter.sh/nodepool or a capacity block's label."""
    tolerations: list[dict] = field(default_factory=list)
    """Kubernetes Tolerations, after the operator's (aws.amazon.com/neuron on Trainium)."""
    affinity: dict = field(default_factory=dict)
    """A Kubernetes Affinity merged with the operator's: each required node selector term also
    keeps the pods off the nodes the run leaves out, pod anti-affinity terms are added to the
    one-pod-per-node rule, preferred terms and pod affinity are taken as given."""
    priority_class_name: str = ""
    """The pods' PriorityClass (a higher one may preempt others' pods, and be preempted by a
    higher one: an eviction, which the run survives as one)."""
    scheduler_name: str = ""
    """The pods' scheduler (default: the cluster's default scheduler)."""
    resources: dict = field(default_factory=dict)
    """The trainer container's requests and limits of cpu, memory, ephemeral-storage and
    hugepages-<size>, with the instance type's Neuron devices and EFA interfaces (the operator's)."""
    init_containers: list[dict] = field(default_factory=list)
    """Kubernetes Containers run before the trainer, or beside it for the pod's life with
    restartPolicy: Always (a sidecar, Kubernetes 1.29 and later), with the Container fields
    listed in the docs, the trainer's lock-down (no privilege escalation, every capability
    dropped, RuntimeDefault seccomp) and mounts of the pod's own volumes."""


@dataclass
class PodTemplate:
    """What the platform sets on every pod of the run. Mutable while the run is suspended (as a
    Job's template is, for a queue that places it): the next gang takes it."""
    metadata: PodTemplateMetadata = field(default_factory=PodTemplateMetadata)
    spec: PodTemplateSpec = field(default_factory=PodTemplateSpec)


@dataclass(kw_only=True)
class TrainingRunSpec(RunConfig):
    """A TrainingRun's spec: the trainer's run configuration (model ... init, backend) plus
    where and how the gang runs and how failures are handled."""
    MUTABLE: ClassVar[tuple[str, ...]] = ("suspend", "fault_tolerance")
    """The fields a live run's spec may change (the API server refuses edits of the others):
    what the operator itself reads each pass. Every other field shapes the pods, the data and
    the checkpoints, which a running gang cannot follow."""
    MUTABLE_WHILE_SUSPENDED: ClassVar[tuple[str, ...]] = ("pod_template",)
    """Fields an edit may change when the run it edits is suspended (no gang to follow them)."""

    image: Annotated[str, MinLen(1)]
    """The trainer container image."""
    nodes: AtLeastOne
    """Nodes in the gang; one pod per node."""
    checkpoint: CheckpointConfig
    """Where checkpoints go (checkpoint.uri is required: a restarted gang resumes from it)."""
    instance_type: InstanceType = "trn1.32xlarge"
    """trn1.32xlarge (16 Neuron devices, 32 cores, 8 EFA), trn1n.32xlarge (16 EFA), trn2.48xlarge or
    trn2u.48xlarge (16 Trainium2 devices, 64 logical cores, 16 EFA), trn3 (any Trn3 instance,
    through DRA only: resources DRA), or cpu/gpu for development."""
    resources: DeviceAllocation = "Auto"
    """How the pods get the node's Neuron devices and EFA interfaces: DevicePlugin (the extended
    resources aws.amazon.com/neuron and vpc.amazonaws.com/efa, counted), DRA (a
    ResourceClaimTemplate of the Neuron DRA driver's DeviceClass neuron.aws.com, every device of
    the node, and of efa.networking.k8s.aws where that class exists: Kubernetes 1.34 and later),
    or Auto: DRA when the cluster has the neuron.aws.com DeviceClass (always for trn3), else
    DevicePlugin. Read when pods are made."""
    processes_per_node: AtLeastOne | None = None
    """Trainer ranks per pod (default: 32 on trn1, 64 on trn2, 1 on cpu, 8 on gpu; required on trn3)."""
    backend: Backend | None = None
    """Trainer backend (default: neuron on trn types, cpu otherwise)."""
    suspend: bool = False
    """Stop the gang; clearing it resumes from the newest checkpoint."""
    service_account_name: str | None = None
    """ServiceAccount of the trainer pods. Default: one the operator makes for the run
    (trainium-trainer-RUN), allowed to get and patch only the pods of the run's current attempt.
    A ServiceAccount of your own (e.g. one with an IAM role for the checkpoint store) gets the
    same per-run Role bound; the admission policy does not cover it."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    compile_cache: CompileCacheConfig = field(default_factory=CompileCacheConfig)
    env: Annotated[list[EnvVar], Doc(
        "Extra environment variables of the trainer container, e.g. AWS_ENDPOINT_URL for an S3-compatible "
        f"store or credentials from a Secret. Each has a value or a valueFrom ({', '.join(ENV_SOURCES)}); the "
        f"pod contract's variables ({', '.join(CONTRACT_ENV)}) cannot be set here.")] = field(default_factory=list)
    volumes: Annotated[list[Volume], Doc(
        "Extra pod volumes (Kubernetes Volume objects: a name and one source, e.g. persistentVolumeClaim for a "
        f"shared file system), mounted with volumeMounts. Names {', '.join(CONTRACT_VOLUMES)} are the "
        "operator's.")] = field(default_factory=list)
    volume_mounts: list[VolumeMount] = field(default_factory=list)
    """Where the trainer container mounts spec.volumes."""
    pod_template: PodTemplate = field(default_factory=PodTemplate)
    layout: Layout | None = field(default=None, metadata=DERIVED)
    dra_efa: bool = field(default=False, metadata=DERIVED)
    """With resources DRA (in force): the cluster has the EFA DRA driver's DeviceClass, so the
    claim asks for the node's EFA interfaces too (observer.devices_in_force)."""
    """Our trainer's parallel layout (derived); None with a command trainer (its layout is its own)."""

    @property
    def run(self) -> RunConfig:
        """The trainer's part (what the pod's ConfigMap holds)."""
        return RunConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RunConfig)})

    @property
    def world_size(self) -> int:
        return self.nodes * (self.processes_per_node or 0)

    @property
    def tokens_per_step(self) -> int | None:
        if self.layout is not None:
            return self.layout.tokens_per_step
        return (self.trainer.samples_per_step * self.trainer.tokens_per_sample) or None

    def trainer_service_account(self, run_name: str) -> str:
        """The trainer pods' ServiceAccount: the run's own unless the spec names another."""
        return self.service_account_name or trainer_identity(run_name)

    @property
    def own_trainer_identity(self) -> bool:
        """The operator makes the trainer's ServiceAccount (the spec names none of its own)."""
        return self.service_account_name is None

    def preflight_on(self) -> bool:
        """faultTolerance.preflight in force: Enabled, or Auto on a Trainium instance type."""
        mode = self.fault_tolerance.preflight
        return mode == "Enabled" or (mode == "Auto" and bool(INSTANCE_TYPES[self.instance_type]["neuron"]))

    def in_place_on(self) -> bool:
        """In-place restarts in force: our trainer (a command trainer's script is not run under
        the agent's protocol) and faultTolerance.inPlaceRestarts above 0."""
        return self.fault_tolerance.in_place_restarts > 0 and not self.trainer.is_command

    def quarantine_limit(self) -> int:
        return self.fault_tolerance.max_quarantined_nodes or max(1, self.nodes // 4)
