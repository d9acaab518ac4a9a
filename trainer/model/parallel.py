"""Process groups, step runtimes and the PyTorch backend's tensor/sequence-parallel layers.

The PyTorch backend uses gloo on CPU and NCCL on CUDA. The backend object that chooses between
these and the Neuron backend (torch-neuronx + NxD, see docs/neuron.md) is ``trainer.model.backends``;
NxD's layers have the parameter names and shard layouts these layers reproduce, so checkpoints
interchange.

Tensor layout: activations are [batch, seq, hidden]. With sequence parallel, the tensors that
flow between layers are sharded along seq over the tensor-parallel group; each block gathers
the full sequence before its column-parallel matmul and reduce-scatters after its row-parallel
matmul (Megatron-LM / NxD sequence parallelism).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..contract.podenv import PodEnv
from ..config import Layout


class EagerRuntime:
    """Step boundaries on eager devices (CPU, CUDA): a step's values are read as soon as it ends."""

    lazy = False

    def end_step(self, observe) -> None:
        observe()

    def flush(self) -> None:
        """Nothing is deferred on an eager device: every step was observed when it ended."""


class DeferredRuntime(EagerRuntime):
    """The lazy device's step model on an eager one: the update is decided on the device
    (no host read inside a step) and each step is observed one step late, exactly as on XLA.
    Chosen with ``TRAINER_LAZY_STEPS=1`` on cpu/cuda, so multi-process tests over gloo cover
    the rank logic the Neuron backend runs (XLA on CPU cannot run more than one process)."""

    lazy = True

    def __init__(self):
        self._pending = None

    def end_step(self, observe) -> None:
        previous, self._pending = self._pending, observe
        if previous is not None:
            previous()

    def flush(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending()


def eager_runtime(env: PodEnv | None = None) -> EagerRuntime:
    return DeferredRuntime() if (env or PodEnv.from_environ()).lazy_steps else EagerRuntime()


def all_agree(ok: bool, group, distributed: bool = True) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (a gloo group: a host tensor, MIN)."""
    if not distributed:
        return ok
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


@dataclass
class ParallelState:
    """Ranks and process groups of one process. Plain data plus the group handles."""

    backend: str
    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    layout: Layout
    tp_rank: int
    dp_rank: int
    tp_group: object | None
    dp_group: object | None
    sequence_parallel: bool
    pp_rank: int = 0
    pp_group: object | None = None
    kv_group: object | None = None
    """The ranks of this TP group that hold the same key/value heads (replicated K/V)."""
    runtime: object = field(default_factory=EagerRuntime)
    """Step boundaries: EagerRuntime, or neuron.XlaRuntime on the lazy XLA device."""

    @property
    def tp(self) -> int:
        return self.layout.tensor

    @property
    def dp(self) -> int:
        return self.layout.data

    @property
    def pp(self) -> int:
        return self.layout.pipeline

    @property
    def stage(self) -> tuple[int, int]:
        """(this rank's pipeline stage, number of stages)."""
        return self.pp_rank, self.layout.pipeline

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pipeline - 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


# The eager devices: where a rank's tensors live and the process group that joins them.
EAGER_DEVICES = {"cpu": "gloo", "cuda": "nccl", "neuron": "neuron"}  # neuron: TorchNeuron (native)


def eager_device(kind: str, local_rank: int) -> torch.device:
    """This rank's device of an eager kind (``EAGER_DEVICES``), made current where that matters."""
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    # TorchNeuron gives each process its own NeuronCores and names the device "neuron"
    # (AWS's examples use torch.device("neuron") with backend "neuron"; docs/neuron.md)
    return torch.device(kind)


def init_parallel(backend_kind: str, layout_fn, sequence_parallel: bool, precision: str = "fp32",
                  kv_replicas: int = 1, env: PodEnv | None = None) -> ParallelState:
    """Initialise torch.distributed from torchrun's environment (or a single process).

    ``layout_fn(world_size)`` validates and derives the layout before any collective runs.
    Ranks are laid out as NxD's ``parallel_state`` lays them out: a row-major [pipeline, data,
    tensor] grid, rank = (pp_rank * dp + dp_rank) * tp + tp_rank, so a tensor-parallel group
    sits on neighbouring ranks (one node on real clusters) and a pipeline stage on consecutive
    nodes. For the eager devices (``EAGER_DEVICES``, by the backend's name); the XLA-based
    ``neuron`` and ``xla`` backends set up their own (``trainer.model.neuron``).
    """
    device_type = backend_kind
    env = env or PodEnv.from_environ()
    world_size, rank, local_rank = env.world_size, env.rank, env.local_rank
    layout = layout_fn(world_size)
    device = eager_device(device_type, local_rank)
    grid = RankGrid(layout.pipeline, layout.data, layout.tensor)
    pp_rank, dp_rank, tp_rank = grid.coords(rank)
    groups: dict[str, object | None] = {"tp": None, "dp": None, "pp": None, "kv": None}
    if world_size > 1:
        dist.init_process_group(EAGER_DEVICES[device_type], timeout=datetime.timedelta(minutes=10))
        for kind in ("tp", "dp", "pp"):
            for ranks in grid.groups(kind):  # every rank creates every group, in the same order
                g = dist.new_group(ranks)
                if rank in ranks:
                    groups[kind] = g
        if kv_replicas > 1:  # consecutive TP ranks share a key/value head
            for tp_ranks in grid.groups("tp"):
                for i in range(0, len(tp_ranks), kv_replicas):
                    g = dist.new_group(tp_ranks[i:i + kv_replicas])
                    if rank in tp_ranks[i:i + kv_replicas]:
                        groups["kv"] = g
    return ParallelState(backend=backend_kind, device=device, rank=rank, world_size=world_size,
                         local_rank=local_rank, layout=layout, tp_rank=tp_rank, dp_rank=dp_rank,
                         tp_group=groups["tp"], dp_group=groups["dp"], pp_rank=pp_rank, pp_group=groups["pp"],
                         kv_group=groups["kv"],
                         sequence_parallel=sequence_parallel and layout.tensor > 1, runtime=eager_runtime(env))


@dataclass(frozen=True)
class RankGrid:
    """NxD's rank order: a row-major [pipeline, data, tensor] grid of global ranks."""

    pp: int
    dp: int
    tp: int

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def groups(self, kind: str) -> list[list[int]]:
        """The rank lists of every ``tp``, ``dp`` or ``pp`` group, in a fixed order."""
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        others = [k for k in ("pp", "dp", "tp") if k != kind]
        out = []
        for a in range(sizes[others[0]]):
            for b in range(sizes[others[1]]):
                out.append([self.rank(**{f"{others[0]}_rank": a, f"{others[1]}_rank": b, f"{kind}_rank": i})
                            for i in range(sizes[kind])])
        return out


def shutdown_parallel() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Collectives that work on gloo too (gloo has no reduce-scatter)
# --------------------------------------------------------------------------------------------


def group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and group_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def all_gather_dim(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_dim(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return t
    rank = dist.get_rank(group)
    if t.is_cuda:
        out = torch.empty_like(t.chunk(n, dim=dim)[rank]).contiguous()
        inputs = [c.contiguous() for c in t.chunk(n, dim=dim)]
        dist.reduce_scatter(out, inputs, group=group)
        return out
    if t.device.type == "xla":  # the xla process group has a real reduce-scatter (on dim 0)
        src = t.movedim(dim, 0).contiguous()
        out = torch.empty((src.shape[0] // n, *src.shape[1:]), dtype=t.dtype, device=t.device)
        dist.reduce_scatter_tensor(out, src, group=group)
        return out.movedim(0, dim).contiguous()
    t = t.contiguous()
    dist.all_reduce(t, group=group)  # gloo: reduce everything, keep our slice
    return t.chunk(n, dim=dim)[rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward (sequence parallel)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, 1, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_dim(g, 1, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward (sequence parallel)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim(x, 1, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim(g, 1, ctx.group), None


# --------------------------------------------------------------------------------------------
# Parallel layers (names and shard layouts as NxD's ColumnParallelLinear / RowParallelLinear /
# ParallelEmbedding)
# --------------------------------------------------------------------------------------------


class TPContext:
    """The layer factory of the PyTorch backend, and what its layers know about tensor
    parallelism; (1, 0, None) is single-process.

    ``model.py`` builds every parallel layer through these methods, so one model serves every
    backend: the Neuron backend's subclass (``trainer.model.neuron.NxDLayers``) returns NxD's own
    layers, with the same parameter names and shard layouts. Full weights come in, each rank
    keeps its shard.
    """

    def __init__(self, size: int = 1, rank: int = 0, group=None, sequence_parallel: bool = False,
                 kv_group=None):
        self.size, self.rank, self.group = size, rank, group
        self.sequence_parallel = sequence_parallel and size > 1
        self.kv_group = kv_group

    # -- the factory ----------------------------------------------------------------------

    def column_linear(self, full_weight: torch.Tensor, splits: list[int] | None = None,
                      full_bias: torch.Tensor | None = None, replicas: list[int] | None = None) -> nn.Module:
        """Input [b, s(/tp), h], output this rank's columns [b, s, out/tp]. ``replicas[i]``
        ranks share block i (replicated key/value heads; see shard_rows)."""
        return ColumnParallelLinear(full_weight, self, splits, full_bias, replicas)

    def row_linear(self, full_weight: torch.Tensor, full_bias: torch.Tensor | None = None) -> nn.Module:
        """Input this rank's columns, output the combined result (+ bias) [b, s(/tp), h]."""
        return RowParallelLinear(full_weight, self, full_bias)

    def embedding(self, full_weight: torch.Tensor) -> nn.Module:
        return ParallelEmbedding(full_weight, self)

    def cross_entropy(self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Per-token losses from vocabulary-parallel logits."""
        return vocab_parallel_cross_entropy(logits, target, self, ignore_index)

    def checkpoint(self, fn, *args):
        """Activation checkpointing (recompute ``fn`` in backward)."""
        return checkpoint(fn, *args, use_reentrant=False)

    # -- communication around the matmuls ----------------------------------------------------

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Input of a column-parallel matmul: full sequence, gradient summed over TP."""
        if self.size == 1:
            return x
        if self.sequence_parallel:
            return _GatherSeq.apply(x, self.group)
        return _CopyToTP.apply(x, self.group)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Output of a row-parallel matmul: partial sums combined (and re-sharded with SP)."""
        if self.size == 1:
            return x
        if self.sequence_parallel:
            return _ScatterSeq.apply(x, self.group)
        return _ReduceFromTP.apply(x, self.group)


def shard_rows(full: torch.Tensor, tp: TPContext, splits: list[int] | None = None,
               replicas: list[int] | None = None) -> torch.Tensor:
    """Rows of a column-parallel weight for this rank. With ``splits`` the full weight is
    stacked blocks of those sizes (q, k, v or gate, up) and each rank takes its slice of every
    block, stacked: the NxD ``stride=`` layout (on TP rank r, qkv is cat(q_r, k_r, v_r)).
    A block with ``replicas[i] = n > 1`` is split n times fewer, and n consecutive ranks hold
    the same slice (key/value heads replicated when TP exceeds their number)."""
    blocks = full.split(splits, dim=0) if splits else (full,)
    reps = replicas or [1] * len(blocks)
    return torch.cat([b.chunk(tp.size // n, dim=0)[tp.rank // n] for b, n in zip(blocks, reps)], dim=0).contiguous()


def replicated_row_ranges(splits: list[int], replicas: list[int], tp_size: int, in_features: int
                          ) -> list[tuple[int, int]]:
    """Element ranges of a local column-parallel weight (flattened) that other ranks hold too."""
    out, row = [], 0
    for size, n in zip(splits, replicas):
        local = size * n // tp_size
        if n > 1:
            out.append((row * in_features, (row + local) * in_features))
        row += local
    return out


def shard_cols(full: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return full.chunk(tp.size, dim=1)[tp.rank].contiguous()


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows over the TP group (gather_output=False); the
    input is gathered along the sequence first with sequence parallel."""

    def __init__(self, full_weight: torch.Tensor, tp: TPContext, splits: list[int] | None = None,
                 full_bias: torch.Tensor | None = None, replicas: list[int] | None = None):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(shard_rows(full_weight, tp, splits, replicas))
        self.bias = nn.Parameter(shard_rows(full_bias, tp, splits, replicas)) if full_bias is not None else None
        mark_kv_replicated(self, tp, splits, replicas)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.tp.enter(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial outputs are combined over the TP
    group before the (replicated) bias is added, as in NxD."""

    def __init__(self, full_weight: torch.Tensor, tp: TPContext, full_bias: torch.Tensor | None = None):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(shard_cols(full_weight, tp))
        # The bias is replicated and added once, after the partial sums are combined.
        self.bias = nn.Parameter(full_bias.clone()) if full_bias is not None else None
        if self.bias is not None:
            self.bias.tp_replicated = True  # type: ignore[attr-defined]
            self.bias.sequence_partial = tp.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        out = self.tp.leave(F.linear(x_local, self.weight))
        return out + self.bias if self.bias is not None else out


class ParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; out-of-shard ids contribute zeros."""

    def __init__(self, full_weight: torch.Tensor, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.per_rank = full_weight.shape[0] // tp.size
        self.weight = nn.Parameter(shard_rows(full_weight, tp))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] -> [b, s(/tp with SP), h]."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        start = self.tp.rank * self.per_rank
        local = ids - start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.tp.sequence_parallel:
            return _ScatterSeq.apply(out, self.tp.group)
        return _ReduceFromTP.apply(out, self.tp.group)


def mark_kv_replicated(layer: nn.Module, tp: TPContext, splits: list[int] | None,
                       replicas: list[int] | None) -> None:
    """Record on a column-parallel layer's parameters which of their elements other TP ranks
    hold too (``kv_replicated = (replicas, element ranges)``). Each rank's gradient of those
    elements covers only its own query heads: the optimizer sums them over ``tp.kv_group`` and
    counts them once in the global norm."""
    if not replicas or max(replicas) == 1:
        return
    n = max(replicas)
    layer.weight.kv_replicated = (n, replicated_row_ranges(splits, replicas, tp.size, layer.weight.shape[1]))
    if layer.bias is not None:
        layer.bias.kv_replicated = (n, replicated_row_ranges(splits, replicas, tp.size, 1))


def to_device(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``module.to(device, dtype)`` keeping what the layers marked on their parameters
    (``tp_replicated``, ``sequence_partial``, ``kv_replicated``; NxD's partition attributes).
    Moving to a device whose tensors cannot share the CPU tensor's type (XLA) makes new
    Parameter objects, which would drop them, and the optimizer would then count replicated
    parameters once per rank and skip the sequence-parallel gradient sums."""
    marks = {name: dict(vars(p)) for name, p in module.named_parameters() if vars(p)}
    module.to(device=device, dtype=dtype)
    if hasattr(module, "retie"):  # a tied LM head shares the embedding's (maybe new) Parameter
        module.retie()
    for name, p in module.named_parameters():
        for attr, value in marks.get(name, {}).items():
            if not hasattr(p, attr):
                setattr(p, attr, value)
    return module


def mark_replicated(module: nn.Module, tp: TPContext) -> None:
    """Tag parameters that every TP rank holds in full (norms, biases of row-parallel layers).

    Their gradients are counted once in the global norm, and with sequence parallel each rank's
    gradient covers only its sequence slice, so the trainer sums them over the TP group.
    """
    for p in module.parameters(recurse=False):
        p.tp_replicated = True  # type: ignore[attr-defined]
        p.sequence_partial = tp.sequence_parallel  # type: ignore[attr-defined]


class _VocabParallelCE(torch.autograd.Function):
    """Cross entropy over logits split by vocabulary across the TP group (NxD
    parallel_cross_entropy). Returns per-token losses; ignore_index targets give 0."""

    @staticmethod
    def forward(ctx, logits, target, tp: TPContext, ignore_index: int):
        logits = logits.float()
        vocab_local = logits.shape[-1]
        start = tp.rank * vocab_local
        logits_max = logits.max(dim=-1)[0]
        all_reduce(logits_max, tp.group, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        local_t = target - start
        in_shard = (local_t >= 0) & (local_t < vocab_local)
        safe_t = local_t.clamp(0, vocab_local - 1)
        predicted = shifted.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1) * in_shard
        all_reduce(predicted, tp.group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, tp.group)
        loss = torch.log(sum_exp) - predicted
        valid = target != ignore_index
        loss = loss * valid
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, safe_t, in_shard & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, safe_t, hit, valid = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, safe_t.unsqueeze(-1), -hit.unsqueeze(-1).to(grad.dtype))
        grad = grad * (g * valid).unsqueeze(-1)
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: TPContext,
                                 ignore_index: int = -100) -> torch.Tensor:
    if tp.size == 1:
        return F.cross_entropy(logits.float().flatten(0, -2), target.flatten(),
                               ignore_index=ignore_index, reduction="none").view(target.shape)
    return _VocabParallelCE.apply(logits, target, tp, ignore_index)

