"""The Neuron backend: torch-xla's device and step model, NxD's process groups and layers.

Everything that imports ``torch_xla``, ``torch_neuronx`` or ``neuronx_distributed`` lives in
this module, imported lazily, so the rest of the trainer runs without them. Two backend kinds
use it:

``neuron``  Trainium. torch-neuronx is the PJRT plugin that gives torch-xla its Neuron device;
            NeuronX Distributed (NxD) builds the tensor-parallel process groups and provides
            the parallel layers and the vocabulary-parallel loss.
            In NxD's CPU mode (``NXD_CPU_MODE=1``) the same NxD calls run on gloo and CPU
            tensors, eagerly: how CI runs NxD's real code without Trainium.
``xla``     torch-xla's own device in ONE process, with the PyTorch backend's layers. On a
            machine without Trainium, ``PJRT_DEVICE=CPU`` runs the whole lazy-tensor loop
            (device placement, graph cuts at step boundaries, deferred host reads, the host
            copy of an asynchronous checkpoint, resume) on the CPU: it is how CI tests the
            loop that the Neuron backend runs. Across processes torch-xla's CPU collectives do
            nothing and every worker believes it is rank 0 (pytorch/xla issues 5005 and
            9089), so ``xla`` refuses more than one process (``config.check_backend``).

What has and has not run is stated in docs/what-has-not-run.md. In short: the XLA loop,
our optimizer and our checkpointer run on torch-xla's CPU device in CI, one process; every NxD
call below (aws-neuron/neuronx-distributed, release 2.29, paths cited at each call) runs in CI
in NxD's CPU mode (``NXD_CPU_MODE=1``: gloo groups, CPU tensors, 2 and 4 ranks; tests/nxd),
and none has run on the XLA device or Trainium.

Design choices, and why:

* Our optimizer (``optim.ShardedAdamW``) and checkpointer run on XLA too, instead of NxD's
  ``NeuronZero1Optimizer`` and ``save_checkpoint``. Their state files are then the same on
  every backend (a checkpoint moves between backends), the optimizer runs under test here,
  ``done`` is written as soon as every rank finished (NxD writes it one save late), and the
  clipping and non-finite skip are computed on the device, so a step needs no host round trip.
* Host reads lag one step (:class:`XlaRuntime`): the loss and gradient norm of step k are read
  in a step closure that runs after step k+1's graph was handed to the device, so the device
  never waits for the host, and every rank takes its stop decisions at the same step.
* BF16 stochastic rounding is the Neuron runtime's (``NEURON_RT_STOCHASTIC_ROUNDING_EN=1``, set
  by the operator's pod spec): the optimizer casts its fp32 result to bf16 on the device and
  the hardware rounds stochastically. XLA on CPU rounds to nearest.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import logging
import os
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from trainium_api import exitcodes
from trainium_api.podenv import NEURON_CC_FLAGS

from ..config import ConfigError, Layout
from ..contract.podenv import PodEnv
from .eager import Backend, CheckCollectives
from .trainium import neuron_rank_peak, nxd_cpu_mode
from .parallel import (DeferredRuntime, ParallelState, TPContext, eager_runtime, mark_kv_replicated, shard_cols,
                       shard_rows)

log = logging.getLogger(__name__)

# Where each kind's packages come from, for the error a user sees when one is missing.
_PACKAGES = {
    "torch_xla": "torch-xla (pip install torch-xla matching your torch; it ships in the Neuron training images)",
    "torch_neuronx": "torch-neuronx (the Neuron SDK's PyTorch plugin, in the pytorch-training-neuronx images)",
    "neuronx_distributed": "neuronx-distributed (NxD, in the pytorch-training-neuronx images)",
}


def require(module: str):
    """Import a Neuron-side package or fail with the fatal exit code naming what is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise exitcodes.FatalError(f"the {('neuron' if top != 'torch_xla' else 'xla')} backend needs "
                                   f"{_PACKAGES.get(top, top)}; importing {module} failed: {exc}") from None


def neuron_available() -> bool:
    """Whether this process can use Trainium (torch-neuronx importable). Cheap enough for 'auto'."""
    return importlib.util.find_spec("torch_neuronx") is not None


# --------------------------------------------------------------------------------------------
# The step model: lazy tensors, graph cuts at step boundaries, deferred host reads
# --------------------------------------------------------------------------------------------


class XlaRuntime(DeferredRuntime):
    """Step boundaries on torch-xla.

    ``end_step(observe)`` cuts the graph (``torch_xla.sync()``, formerly ``xm.mark_step()``),
    which hands the step to the device asynchronously. ``observe`` reads the step's values on
    the host; it is registered as a step closure one step later (``xm.add_step_closure``), so it
    runs right after the NEXT step was handed over and its reads wait only for a step that is
    already finished or about to be. ``flush()`` runs the pending observation now (before a
    checkpoint and at the end).
    """

    def __init__(self):
        super().__init__()
        self.xm = require("torch_xla.core.xla_model")
        self.torch_xla = require("torch_xla")

    def end_step(self, observe: Callable[[], None]) -> None:
        if self._pending is not None:
            self.xm.add_step_closure(self._pending)  # runs after this sync, in this thread
        self._pending = observe
        self.torch_xla.sync()


def xla_device() -> torch.device:
    return require("torch_xla").device()


def refuse_cpu_mode_on_trainium() -> None:
    """NxD's CPU mode on a node whose Neuron devices are in the container would hold every
    NeuronCore while training on the CPU, orders of magnitude slower, and nothing would fail:
    a pod spec's NXD_CPU_MODE (a user's env, or one read from a ConfigMap) is refused there."""
    import glob
    if glob.glob("/dev/neuron[0-9]*"):
        raise ConfigError("env NXD_CPU_MODE", "NxD's CPU mode is for machines without Trainium; this container "
                                              "has Neuron devices: remove NXD_CPU_MODE from the run's env")


def init_xla_parallel(kind: str, layout_fn: Callable[[int], Layout], sequence_parallel: bool,
                      precision: str, kv_replicas: int = 1, env: PodEnv | None = None) -> ParallelState:
    """Device, process groups and ranks for the ``neuron`` and ``xla`` kinds.

    ``neuron``: the ``xla`` process group from torchrun's environment
    (``torch_xla.distributed.xla_backend`` registers it; ``init_method="xla://"``), or gloo in
    NxD's CPU mode, then NxD's ``parallel_state.initialize_model_parallel`` builds the tensor-,
    pipeline- and data-parallel groups. Ranks come from NxD, not from our formula: on trn1 with
    TP 4, NxD groups non-neighbouring ranks (src/neuronx_distributed/parallel_layers/
    parallel_state.py, initialize_model_parallel).
    """
    env = env or PodEnv.from_environ()
    world_size, rank, local_rank = env.world_size, env.rank, env.local_rank
    layout = layout_fn(world_size)  # check_backend has refused what this kind cannot run
    cpu_mode = kind == "neuron" and nxd_cpu_mode(env)
    if cpu_mode:
        refuse_cpu_mode_on_trainium()
    if kind == "neuron" and not cpu_mode:
        if precision == "bf16-sr":
            # Read by the Neuron runtime when it starts (the operator's pod spec sets it too).
            os.environ.setdefault("NEURON_RT_STOCHASTIC_ROUNDING_EN", "1")
        _compile_cache_env(env)
        require("torch_neuronx")  # registers the Neuron PJRT device with torch-xla
    device = torch.device("cpu") if cpu_mode else xla_device()
    if kind == "xla":
        return ParallelState(backend=kind, device=device, rank=0, world_size=1, local_rank=0, layout=layout,
                             tp_rank=0, dp_rank=0, tp_group=None, dp_group=None, sequence_parallel=False,
                             runtime=XlaRuntime())
    # NxD's layers look up their groups in parallel_state even at TP 1, so the process group
    # exists in a single process too (as in NxD's examples, which always run under torchrun).
    if world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "29500")
    if cpu_mode:
        # NxD's CPU mode builds its groups on the default process group's backend: gloo.
        dist.init_process_group("gloo", rank=rank, world_size=world_size,  # one process has no RANK
                                timeout=datetime.timedelta(minutes=10))
        version = getattr(require("neuronx_distributed._version"), "__version__", "?")
        if rank == 0:
            log.info("neuronx-distributed %s in CPU mode (NXD_CPU_MODE=1): NxD's process groups, layers and loss on gloo "
                     "and CPU tensors; no Neuron device is used", version)
    else:
        require("torch_xla.distributed.xla_backend")  # registers the "xla" process group backend
        dist.init_process_group("xla", init_method="xla://", timeout=datetime.timedelta(minutes=30))
    ps_mod = require("neuronx_distributed.parallel_layers.parallel_state")
    # src/neuronx_distributed/parallel_layers/parallel_state.py: initialize_model_parallel
    ps_mod.initialize_model_parallel(tensor_model_parallel_size=layout.tensor,
                                     pipeline_model_parallel_size=layout.pipeline)
    tp_group, dp_group = ps_mod.get_tensor_model_parallel_group(), ps_mod.get_data_parallel_group()
    tp_rank, dp_rank = ps_mod.get_tensor_model_parallel_rank(), ps_mod.get_data_parallel_rank()
    kv_group = None
    if kv_replicas > 1:
        # Replicated key/value heads: our layers give head h to the TP ranks h*r .. h*r+r-1
        # (parallel.shard_rows). NxD's initialize_kv_group builds its groups from consecutive
        # GLOBAL ranks, which on trn1 at TP 4 and above are not one TP group's (NxD interleaves
        # the TP groups there: parallel_state.py, the replica-group logic get_platform_target
        # picks), so the groups are built from NxD's own TP groups (a group's ranks sorted are
        # its TP ranks in order), the way NxD builds its own (_build_and_assign_groups): in CPU
        # mode every rank creates every gloo group in the same order; on XLA each rank creates
        # its own group with the whole mesh, which torch-xla puts in the collective's replica
        # groups.
        mesh = [ordered[i:i + kv_replicas]
                for ordered in (sorted(g) for g in ps_mod.get_tensor_model_parallel_replica_groups())
                for i in range(0, len(ordered), kv_replicas)]
        for members in mesh:
            if cpu_mode:
                group = dist.new_group(members, backend="gloo")
                if rank in members:
                    kv_group = group
            elif rank in members:
                kv_group = dist.new_group(members, pg_options={"xla_pg_options": {"mesh": mesh}})
                break
    pp_group = ps_mod.get_pipeline_model_parallel_group() if layout.pipeline > 1 else None
    runtime = eager_runtime(env) if cpu_mode else XlaRuntime()
    return ParallelState(backend=kind, device=device, rank=rank, world_size=world_size, local_rank=local_rank,
                         layout=layout, tp_rank=tp_rank, dp_rank=dp_rank, tp_group=tp_group, dp_group=dp_group,
                         pp_rank=ps_mod.get_pipeline_model_parallel_rank(), pp_group=pp_group, kv_group=kv_group,
                         sequence_parallel=sequence_parallel and layout.tensor > 1, runtime=runtime)


def _compile_cache_env(env: PodEnv) -> None:
    """The persistent compile cache on node-local disk: NEURON_COMPILE_CACHE_URL (the operator
    sets it to spec.compileCache.path) also goes into NEURON_CC_FLAGS' --cache_dir when a
    user's flags do not name one, so neuronx-cc and the runtime agree on one directory."""
    cache, flags = env.neuron_compile_cache_url, env.neuron_cc_flags
    if cache and "--cache_dir" not in flags:
        os.environ[NEURON_CC_FLAGS] = f"{flags} --cache_dir={cache}".strip()


# --------------------------------------------------------------------------------------------
# NxD's parallel layers behind our layer factory
# --------------------------------------------------------------------------------------------


def _keep(_weight: torch.Tensor) -> None:
    """init_method for NxD layers: no draw; the factory copies our shard in afterwards."""


class NxDLayers(TPContext):
    """The layer factory of the Neuron backend: NxD's ColumnParallelLinear, RowParallelLinear,
    ParallelEmbedding and parallel_cross_entropy, with our full-weight initialisation copied
    into their shards.

    Parameter names and shapes equal the PyTorch backend's (``weight``/``bias``; column weights
    [out/tp, in], row weights [out, in/tp], embedding [vocab/tp, hidden]), so checkpoints move
    between backends. Our activations are [batch, seq, hidden], so sequence parallel runs on
    dimension 1 (NxD's ``sequence_dimension``); NxD's own Llama example is sequence-first.
    Source: src/neuronx_distributed/parallel_layers/layers.py and loss_functions.py.
    """

    SEQ_DIM = 1

    def __init__(self, size: int, rank: int, group, sequence_parallel: bool, kv_group=None):
        super().__init__(size, rank, group, sequence_parallel, kv_group)
        self.layers = require("neuronx_distributed.parallel_layers.layers")
        self.mappings = require("neuronx_distributed.parallel_layers.mappings")
        self.loss_functions = require("neuronx_distributed.parallel_layers.loss_functions")
        self.on_xla = not nxd_cpu_mode()

    def _sp(self) -> dict:
        return {"sequence_parallel_enabled": self.sequence_parallel,
                "sequence_dimension": self.SEQ_DIM if self.sequence_parallel else None}

    def column_linear(self, full_weight, splits=None, full_bias=None, replicas=None) -> nn.Module:
        out_features = shard_rows(full_weight[:, :1], self, splits, replicas).shape[0] * self.size
        in_features = full_weight.shape[1]
        # stride = number of stacked blocks (3 for qkv, 2 for gate_up), as in NxD's Llama
        # example; it is recorded on the parameter for NxD's own checkpoint conversion. NxD's
        # stride means equal blocks (it divides each rank's rows by it, layers.py
        # create_local_weight): with grouped-query attention q is larger than k and v, so the
        # fused qkv is described as one block (our converter, not NxD's, merges it).
        equal_blocks = bool(splits) and len(set(splits)) == 1 and not any(n > 1 for n in replicas or [])
        layer = self.layers.ColumnParallelLinear(
            in_features, out_features, bias=full_bias is not None, gather_output=False,
            dtype=full_weight.dtype, stride=len(splits) if equal_blocks else 1, init_method=_keep, **self._sp())
        with torch.no_grad():
            layer.weight.copy_(shard_rows(full_weight, self, splits, replicas))
            if full_bias is not None:
                layer.bias.copy_(shard_rows(full_bias, self, splits, replicas))
        mark_kv_replicated(layer, self, splits, replicas)
        return layer

    def row_linear(self, full_weight, full_bias=None) -> nn.Module:
        out_features, in_features = full_weight.shape
        layer = self.layers.RowParallelLinear(
            in_features, out_features, bias=full_bias is not None, input_is_parallel=True,
            dtype=full_weight.dtype, init_method=_keep, **self._sp())
        with torch.no_grad():
            layer.weight.copy_(shard_cols(full_weight, self))
            if full_bias is not None:
                layer.bias.copy_(full_bias)
        if full_bias is not None:  # replicated: counted once in the norm, summed over TP with SP
            layer.bias.tp_replicated = True
            layer.bias.sequence_partial = self.sequence_parallel
        return layer

    def embedding(self, full_weight) -> nn.Module:
        vocab, hidden = full_weight.shape
        mappings, group, sp = self.mappings, self.group, self.sequence_parallel

        class Embedding(self.layers.ParallelEmbedding):
            """NxD's vocabulary-parallel embedding. Its own sequence-parallel path transposes to
            sequence-first, so it returns its partial sums (collect_output=False) and we
            reduce (or reduce-scatter along our sequence dimension) here."""

            def forward(self, ids):
                out = super().forward(ids)
                if sp:
                    return mappings.reduce_scatter_to_sequence_parallel_region(
                        out, NxDLayers.SEQ_DIM, process_group=group)
                return mappings.reduce_from_tensor_model_parallel_region(out, process_group=group)

        layer = Embedding(vocab, hidden, init_method=_keep, dtype=full_weight.dtype, collect_output=False)
        with torch.no_grad():
            layer.weight.copy_(shard_rows(full_weight, self))
        return layer

    def cross_entropy(self, logits, target, ignore_index: int = -100):
        # parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing) has no
        # ignore_index: mask those targets ourselves. fp32 logits, as in NxD's Llama example.
        valid = target != ignore_index
        losses = self.loss_functions.parallel_cross_entropy(logits.float(), target.masked_fill(~valid, 0))
        return losses * valid

    def checkpoint(self, fn, *args):
        if not self.on_xla:  # NxD's CPU mode: eager tensors, torch's own checkpoint
            return super().checkpoint(fn, *args)
        # torch-xla's checkpoint keeps the compiler from merging the recomputation away.
        return require("torch_xla.utils.checkpoint").checkpoint(fn, *args)


class XlaLayers(TPContext):
    """The ``xla`` kind: the PyTorch backend's layers (one process, no tensor parallelism),
    with torch-xla's activation checkpointing."""

    def checkpoint(self, fn, *args):
        return require("torch_xla.utils.checkpoint").checkpoint(fn, *args)



# --------------------------------------------------------------------------------------------
# Pipeline parallelism: NxD's pipeline runtime over our stage
# --------------------------------------------------------------------------------------------


class _ListIO(nn.Module):
    """One of our pieces in NxD's manual-partition convention: NxD hands each listed module
    the micro-batch as a list of tensors and passes its output on, and to the loss function,
    as ``outputs[0]`` (pipeline/model.py ``_manual_pp_preprocess_stage_io`` and
    ``_fwd_step_task``; NxD's own test modules unwrap ``x[0]`` and return ``[y]``). The piece
    is held without registering it, so parameter names stay the model's."""

    def __init__(self, piece: nn.Module):
        super().__init__()
        object.__setattr__(self, "piece", piece)

    def forward(self, x):
        if isinstance(x, (list, tuple)):
            x = x[0]
        return [self.piece(x)]


class NxDPipeline:
    """Pipeline stages on Trainium with NxD's own schedule (``NxDPPModel``), in its manual
    partition mode: NxD runs a list of single-input modules and we hand it this stage's
    (``Transformer.pieces()``, built with only this stage's layers), so the parameters, the
    optimizer and the checkpoint files stay ours, exactly as on the PyTorch backend.

    Written against src/neuronx_distributed/pipeline/model.py (NxDPPModel.__init__ with
    ``manual_pp_partition=True``, ``manual_pp_stage_partition_fn``, ``manual_pp_loss_fn``;
    ``_create_manual_partition`` wraps the list in ``PipelineStageModule``), manual_pipe_stage.py
    (the partition function maps every listed module to its stage) and NxD's own test
    test/integration/parallel_layers/pipeline/manual_pp/test_training_tp_pp.py, which calls
    ``run_train(inputs=..., labels=...)`` with CPU tensors. NxD divides each micro-batch's loss
    by the number of micro-batches before its backward (``_bwd_step_task``), as our loop does.
    It has never run: see docs/what-has-not-run.md.

    Every rank hands NxD the same number of modules, so NxD's even partition would need the
    other stages' layers; instead each rank lists ``stages`` placeholders around its own pieces
    and the partition function maps its pieces to its stage and placeholder i to stage i.
    ``use_zero1_optimizer=True`` tells NxD not to average gradients over data parallel ranks:
    our optimizer does (with ZeRO-1 or not).
    """

    def __init__(self, model, ps: ParallelState, micro_batches: int):
        pp_model_mod = require("neuronx_distributed.pipeline.model")
        self.model, self.ps = model, ps
        stage, stages = ps.stage
        pieces = [_ListIO(piece) for piece in model.pieces()]
        placeholders = [nn.Identity() for _ in range(stages)]
        own = {id(p) for p in pieces}

        def partition(layers, num_stages):
            return {layer: (stage if id(layer) in own else placeholders.index(layer)) for layer in layers}

        # Placeholder i sits on stage i (never ours: that slot is taken by our pieces).
        listed = [*placeholders[:stage], *pieces, *placeholders[stage + 1:]]
        self.nxd = pp_model_mod.NxDPPModel(
            module=listed, num_microbatches=micro_batches, manual_pp_partition=True,
            manual_pp_stage_partition_fn=partition, manual_pp_loss_fn=model.loss,
            use_zero1_optimizer=True, return_loss_on_cpu=False, broadcast_and_average_loss=False)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The step's mean loss on the last stage (a device tensor), zero elsewhere."""
        loss = self.nxd.run_train(inputs=inputs, labels=targets)  # CPU tensors, as NxD wants
        if self.ps.is_last_stage and loss is not None:
            return loss.float()
        return torch.zeros((), device=self.ps.device)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.nxd.run_eval(inputs=inputs, labels=targets)
        if self.ps.is_last_stage and loss is not None:
            return loss.float()
        return torch.zeros((), device=self.ps.device)


# --------------------------------------------------------------------------------------------
# The two XLA-based backends (trainer.model.backends picks them)
# --------------------------------------------------------------------------------------------


class NeuronBackend(Backend):
    """Trainium through torch-xla and NxD; NxD's CPU mode runs the same calls on gloo."""

    def __init__(self):
        super().__init__("neuron")

    def init_parallel(self, layout_fn, sequence_parallel, precision, kv_replicas, env=None) -> ParallelState:
        return init_xla_parallel("neuron", layout_fn, sequence_parallel, precision, kv_replicas, env)

    def prepare(self, micro_batch_size: int, ps: ParallelState, env: PodEnv | None = None) -> None:
        """What NxD's CPU mode cannot run, refused before the first step with the field named.

        Sequence parallel over our batch-first activations: NxD gathers the sequence (dimension
        1) by swapping it to the front and back (mappings.py ``nonzero_partition_dim_swap``),
        and the backward of its linear layers calls ``.view`` on that gather (layers.py
        ``LinearWithAsyncCommunication.backward``). An XLA tensor has no strides, so the view
        always works on Trainium; a CPU tensor is then non-contiguous unless the batch is 1."""
        if ps.sequence_parallel and micro_batch_size > 1 and nxd_cpu_mode(env):
            raise ConfigError("training.microBatchSize",
                              f"NxD's CPU mode runs sequence parallel with micro-batches of 1 only, got "
                              f"{micro_batch_size}: its linear layers' backward views a gathered CPU tensor "
                              "that is non-contiguous for larger batches (on Trainium it is not)")

    def layers(self, ps: ParallelState) -> TPContext:
        return NxDLayers(ps.tp, ps.tp_rank, ps.tp_group, ps.sequence_parallel, ps.kv_group)

    def pipeline(self, model, ps: ParallelState, micro_batches: int, autocast):
        return NxDPipeline(model, ps, micro_batches)

    def peak_flops(self) -> float | None:
        return neuron_rank_peak()

    def check_collectives(self, env: PodEnv | None = None) -> CheckCollectives:
        """The pre-flight check on the trainer's collectives (xla_check_collectives); in NxD's
        CPU mode, gloo and the CPU, as its process groups are."""
        if nxd_cpu_mode(env):
            refuse_cpu_mode_on_trainium()
            return Backend("cpu").check_collectives(env)
        require("torch_neuronx")  # registers the Neuron PJRT device with torch-xla
        return xla_check_collectives()


def xla_check_collectives() -> CheckCollectives:
    """The XLA device (on Trainium the NeuronCore) and an ``xla`` process group for the gang
    all-reduce (Neuron's collectives over EFA); each timing ends with ``torch_xla.sync()`` and
    ``wait_device_ops``. The node pairs run on gloo: an XLA collective is compiled for a mesh of
    every rank (its replica groups), and a group of two nodes' leaders alone is not one; they
    time their link over the host network."""
    require("torch_xla.distributed.xla_backend")  # registers the "xla" process group backend
    torch_xla, xm = require("torch_xla"), require("torch_xla.core.xla_model")

    def sync() -> None:
        torch_xla.sync()
        xm.wait_device_ops()
    return CheckCollectives(xla_device(), sync, "xla", "gloo", "xla on the XLA device")


class XlaBackend(Backend):
    """torch-xla's own device in one process, with the PyTorch backend's layers."""

    def __init__(self):
        super().__init__("xla")

    def init_parallel(self, layout_fn, sequence_parallel, precision, kv_replicas, env=None) -> ParallelState:
        return init_xla_parallel("xla", layout_fn, sequence_parallel, precision, kv_replicas, env)

    def prepare(self, micro_batch_size: int, ps: ParallelState, env: PodEnv | None = None) -> None:
        """Nothing to refuse: check_backend already limited xla to one process."""

    def layers(self, ps: ParallelState) -> TPContext:
        return XlaLayers()

    def pipeline(self, model, ps: ParallelState, micro_batches: int, autocast):
        raise ConfigError("parallelism.pipeline", "xla runs one process: no pipeline stages")

    def peak_flops(self) -> float | None:
        return None

    def check_collectives(self, env: PodEnv | None = None) -> CheckCollectives:
        return xla_check_collectives()


# -- the pre-flight check's device part (trainer.pod.preflight) ---------------------------------------
# Written against the Neuron tools' documented behaviour, never run here (no Trainium):
# the Neuron device plugin gives the container one /dev/neuronN per allocated device;
# `neuron-ls` (aws-neuron-sdk tools/neuron-sys-tools/neuron-ls.rst) lists the devices the
# driver sees and fails when it cannot; `nccom-test -r N allr` (nccom-test.rst) runs an
# all-reduce over N NeuronCores of this node and exits non-zero when it fails. Only the exit
# statuses and the device files are read: neuron-ls's JSON changes format in Neuron 2.34.

def preflight_devices(expected: int, local_rank: int, tool_timeout: float, cores: str = "2") -> list[str]:
    """What is wrong with this node's Neuron devices ([] when nothing): checked by local rank 0
    only (the others return [] at once; the node's verdict takes the worst of its ranks)."""
    import re
    import shutil
    import subprocess
    if local_rank != 0:
        return []
    found = sorted(n for n in os.listdir("/dev") if re.fullmatch(r"neuron\d+", n))
    if len(found) != expected:
        return [f"{len(found)} Neuron devices in the container, the instance type has {expected}"]
    for tool, argv in (("neuron-ls", ["neuron-ls"]),
                       ("nccom-test", ["nccom-test", "-r", cores, "allr"])):
        if shutil.which(tool) is None:
            return [f"{tool} is not on PATH (it ships with the Neuron training images)"]  # on every node: FATAL
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=tool_timeout)
        except subprocess.TimeoutExpired:
            return [f"{tool} did not finish in {tool_timeout:.0f}s"]
        if res.returncode != 0:
            last = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
            return [f"{' '.join(argv)} exited {res.returncode}: {last[0][:200]}"]
    return []
