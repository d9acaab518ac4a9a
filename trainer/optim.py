"""AdamW with ZeRO-1, gradient synchronisation, clipping, and BF16 stochastic rounding.

The optimizer works on one flat fp32 view of this rank's (tensor-parallel) parameters:

1. Replicated parameters whose gradient covers only this rank's sequence slice (norms under
   sequence parallel) are summed over the tensor-parallel group.
2. Gradients are summed over the data-parallel group and divided by the data-parallel degree,
   not the world size (NxD ``bucket_allreduce_gradients``). With ZeRO-1 each data-parallel rank
   keeps only its slice (a reduce-scatter).
3. The global gradient norm counts replicated parameters once, across TP and DP.
4. AdamW updates this rank's slice (the whole vector without ZeRO-1); the first and second
   moments live only for that slice. With ``bf16-sr`` the parameters are bf16 and the fp32
   result is stochastically rounded back, so no fp32 master copy is kept.
5. With ZeRO-1 the updated slices are all-gathered and copied into the parameters.
"""

from __future__ import annotations

import math

import torch

from .config import TrainingConfig
from .parallel import ParallelState, all_gather_dim, all_reduce, reduce_scatter_dim


def lr_at(step: int, cfg: TrainingConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr over decay_steps, then min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / cfg.total_decay_steps())
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def stochastic_round_to_bf16(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Round fp32 to bf16 up or down with probability proportional to the distance."""
    noise = torch.randint(0, 1 << 16, x.shape, generator=gen, dtype=torch.int32, device=x.device)
    bits = (x.contiguous().view(torch.int32) + noise) & -65536  # clear the low 16 bits
    return bits.view(torch.float32).to(torch.bfloat16)


class ShardedAdamW:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], cfg: TrainingConfig,
                 ps: ParallelState, zero1: bool):
        self.cfg, self.ps = cfg, ps
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.zero1 = zero1 and ps.dp > 1
        self.bf16_sr = cfg.precision == "bf16-sr"
        numel = sum(p.numel() for p in self.params)
        parts = ps.dp if self.zero1 else 1
        self.total = -(-numel // parts) * parts  # padded so every shard has the same length
        self.shard_len = self.total // parts
        self.start = (ps.dp_rank if self.zero1 else 0) * self.shard_len
        dev = ps.device
        decay = torch.zeros(self.total, device=dev)
        norm_weight = torch.zeros(self.total, device=dev)
        offset = 0
        for p in self.params:
            n = p.numel()
            decay[offset:offset + n] = 1.0 if p.dim() >= 2 else 0.0  # no decay on norms, biases
            norm_weight[offset:offset + n] = 1.0 / ps.tp if getattr(p, "tp_replicated", False) else 1.0
            offset += n
        self.decay = decay[self.start:self.start + self.shard_len]
        self.norm_weight = norm_weight[self.start:self.start + self.shard_len]
        self.exp_avg = torch.zeros(self.shard_len, device=dev)
        self.exp_avg_sq = torch.zeros(self.shard_len, device=dev)
        self.step_count = 0
        # Stochastic rounding noise: a generator per rank, saved with the optimizer state.
        self.gen = torch.Generator(device=dev).manual_seed(cfg.seed * 100_003 + ps.rank)

    # -- helpers ---------------------------------------------------------------------------

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.total, device=self.ps.device, dtype=torch.float32)
        offset = 0
        for t in tensors:
            n = t.numel()
            flat[offset:offset + n] = t.detach().reshape(-1).float()
            offset += n
        return flat

    def _write_back(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    # -- the step --------------------------------------------------------------------------

    def sync_and_norm(self) -> tuple[torch.Tensor, float]:
        """Steps 1-3: returns this rank's averaged gradient slice and the global norm."""
        ps = self.ps
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if getattr(p, "sequence_partial", False):
                all_reduce(p.grad, ps.tp_group)
        grads = self._flat([p.grad for p in self.params])
        if self.zero1:
            grads = reduce_scatter_dim(grads.unsqueeze(0), 1, ps.dp_group).squeeze(0)
        else:
            all_reduce(grads, ps.dp_group)
        grads /= ps.dp
        sq = (grads.pow(2) * self.norm_weight).sum()
        if self.zero1:
            all_reduce(sq, ps.dp_group)
        all_reduce(sq, ps.tp_group)
        return grads, math.sqrt(sq.item())

    def step(self, grads: torch.Tensor, grad_norm: float, lr: float) -> None:
        """Steps 4-5, given the output of sync_and_norm (call only when the norm is finite)."""
        cfg = self.cfg
        if cfg.grad_clip > 0 and grad_norm > cfg.grad_clip:
            grads = grads * (cfg.grad_clip / (grad_norm + 1e-6))
        self.step_count += 1
        b1, b2 = cfg.betas
        self.exp_avg.mul_(b1).add_(grads, alpha=1 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(grads, grads, value=1 - b2)
        bias1 = 1 - b1 ** self.step_count
        bias2 = 1 - b2 ** self.step_count
        denom = (self.exp_avg_sq / bias2).sqrt_().add_(cfg.eps)
        values = self._flat(self.params)[self.start:self.start + self.shard_len]
        values.mul_(1 - lr * cfg.weight_decay * self.decay)
        values.addcdiv_(self.exp_avg, denom, value=-lr / bias1)
        if self.bf16_sr:
            values = stochastic_round_to_bf16(values, self.gen).float()
        if self.zero1:
            values = all_gather_dim(values.unsqueeze(0), 1, self.ps.dp_group).squeeze(0)
        self._write_back(values)

    # -- checkpoint state ------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"step": self.step_count, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
                "generator": self.gen.get_state(), "shard": [self.start, self.shard_len, self.total],
                "param_names": self.names, "zero1": self.zero1}

    def load_state_dict(self, state: dict) -> None:
        if state["shard"] != [self.start, self.shard_len, self.total] or state["param_names"] != self.names:
            raise ValueError("optimizer state does not match this model and layout "
                             "(checkpoints load only with the same tensor and data parallel degrees)")
        self.step_count = state["step"]
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.gen.set_state(state["generator"])
