"""The parallel layout of a run: checked in plain code before any device is touched (the
operator calls it at submission, the trainer once it knows its backend)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .fields import ConfigError


# What the layout reads of the spec's groups (trainium_api.spec ModelConfig, ParallelConfig,
# TrainingConfig, which hold a Layout: so this module names the fields it needs, not the module)
class ModelShape(Protocol):
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int


class Degrees(Protocol):
    tensor: int
    pipeline: int
    sequence_parallel: bool


class Batch(Protocol):
    seq_len: int
    global_batch_size: int
    micro_batch_size: int


@dataclass(frozen=True)
class Layout:
    world_size: int
    tensor: int
    pipeline: int
    data: int
    grad_accum_steps: int
    tokens_per_step: int


def derive_layout(world_size: int, model: ModelShape, par: Degrees, train: Batch,
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
