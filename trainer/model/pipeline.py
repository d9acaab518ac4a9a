"""Pipeline parallelism on the PyTorch backend: ``torch.distributed.pipelining``'s 1F1B.

Each pipeline stage is one :class:`trainer.model.transformer.Transformer` built with ``stage=(index,
count)``: a contiguous range of decoder layers, the embedding on the first stage, the final
norm, LM head and loss on the last. The micro-batches of the schedule are the trainer's
gradient-accumulation steps, so a step's arithmetic is the single-process loop's: every
micro-batch's mean token loss divided by their number, gradients summed.

Why PyTorch's schedule and not one of ours: it is the schedule torchtitan trains with, it
overlaps each stage's sends with the next receive (batched P2P), and its 1F1B keeps at most
``stages - index`` micro-batches of activations alive on stage ``index``. Shapes are
inferred at the first step from the real inputs (one extra forward of the first
micro-batch, without gradients), so sequence-parallel shards and bf16 activations need no
declaration here.

The Neuron backend pipelines with NxD's own ``NxDPPModel`` instead (``trainer.model.neuron``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from .transformer import Transformer
from .parallel import ParallelState


class _StageModule(nn.Module):
    """What a PipelineStage runs: this stage's forward, under the run's autocast."""

    def __init__(self, model: Transformer, autocast: AbstractContextManager):
        super().__init__()
        self.model, self.autocast = model, autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autocast:
            return self.model.stage_forward(x)


class _Stage(PipelineStage):
    """PipelineStage whose first handshake also works on gloo: torch 2.9 sends an int64
    scalar and receives into a float32 one, which NCCL tolerates and gloo refuses ("Received
    data size doesn't match expected size. 8 vs 4"). Same ops, with matching float32 buffers."""

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        return [dist.P2POp(op.op, torch.zeros(1, device=self.device), group=op.group, group_peer=op.group_peer)
                if op.tensor.dtype != torch.float32 else op
                for op in super()._get_init_p2p_neighbors_ops()]


class Pipeline:
    """One optimizer step's forward and backward over ``micro_batches`` on a 1F1B schedule."""

    def __init__(self, model: Transformer, ps: ParallelState, micro_batches: int,
                 autocast: AbstractContextManager):
        self.model, self.ps, self.micro_batches, self.autocast = model, ps, micro_batches, autocast
        stage = _Stage(_StageModule(model, autocast), ps.pp_rank, ps.pp, ps.device, group=ps.pp_group)
        # scale_grads=False: the loss already divides by the number of micro-batches, as the
        # single-process loop does, so the gradients are summed in the same order of operations.
        self.schedule = Schedule1F1B(stage, micro_batches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.autocast:
            return self.model.loss(logits, targets) / self.micro_batches

    def _run(self, run, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Calls ``run`` (the schedule's step or eval) with what this stage needs: the token
        ids on the first stage, the targets on the last. Returns this stage's loss sum (the
        step's mean loss on the last stage, zero elsewhere)."""
        ps = self.ps
        args = (inputs.to(ps.device),) if self.model.first else ()
        losses: list[torch.Tensor] = []
        if self.model.last:
            run(*args, target=targets.to(ps.device), losses=losses)
            return torch.stack([l.detach().float() for l in losses]).sum()
        run(*args)
        return torch.zeros((), device=ps.device)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """inputs/targets: this data-parallel rank's [micro_batches x micro_batch_size, seq]."""
        return self._run(self.schedule.step, inputs, targets)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only (call under torch.no_grad); the same return as forward_backward."""
        return self._run(self.schedule.eval, inputs, targets)
