"""AdamW with ZeRO-1, gradient synchronisation, clipping, and BF16 stochastic rounding.

The optimizer works on one flat fp32 view of this rank's (tensor-parallel) parameters:

1. Replicated parameters whose gradient covers only this rank's sequence slice (norms under
   sequence parallel) are summed over the tensor-parallel group.
2. Gradients are summed over the data-parallel group and divided by the data-parallel degree,
   not the world size (NxD ``bucket_allreduce_gradients``). With ZeRO-1 each data-parallel rank
   keeps only its slice (a reduce-scatter).
3. The global gradient norm counts replicated parameters once, across TP and DP, and sums
   over pipeline stages (each holds its own layers).
4. AdamW updates this rank's slice (the whole vector without ZeRO-1); the first and second
   moments live only for that slice. With ``bf16-sr`` the parameters are bf16 and the fp32
   result is stochastically rounded back, so no fp32 master copy is kept.
5. With ZeRO-1 the updated slices are all-gathered and copied into the parameters.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..config import TrainingConfig
from .parallel import ParallelState, all_reduce, reduce_scatter_dim


def lr_at(step: int, cfg: TrainingConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr over decay_steps, then min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / cfg.total_decay_steps())
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def rounding_seed(seed: int, pp_rank: int, slice_index: int) -> int:
    """The stochastic-rounding generator's seed of a pipeline stage's slice (ShardedAdamW)."""
    return (seed * 100_003 + pp_rank) * 100_003 + slice_index


def stochastic_round_to_bf16(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Round fp32 to bf16 up or down with probability proportional to the distance."""
    noise = torch.randint(0, 1 << 16, x.shape, generator=gen, dtype=torch.int32, device=x.device)
    bits = (x.contiguous().view(torch.int32) + noise) & -65536  # clear the low 16 bits
    return bits.view(torch.float32).to(torch.bfloat16)


SUM_SQ_CHUNK = 1 << 16


def sum_sq(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a flat vector: the gradient norm and its clipping threshold.

    ``dot`` on a CPU accumulates in fp32 in one running sum, in ATen as in XLA's CPU kernels
    (measured against fp64: 2e-6 relative over 870k elements, 4e-3 over 134M). On the CPU the
    vector is summed in chunks of 64K, whose dot products are summed as a tensor: 2e-8 at both
    sizes, twice one dot's time (23 ms at 134M) and no temporary of the vector's size. On XLA
    the reduction of the squares sums pairwise (the graph fuses the square); CUDA's dot reduces
    in a tree."""
    if t.device.type == "xla":
        return (t * t).sum()
    if t.device.type == "cpu" and t.numel() > SUM_SQ_CHUNK:
        return torch.stack([c.dot(c) for c in t.split(SUM_SQ_CHUNK)]).sum()
    return t.dot(t)


def shard_geometry(numel: int, parts: int, index: int) -> tuple[int, int, int]:
    """(start, length, total) of slice ``index`` of a flat vector of ``numel`` values cut into
    ``parts`` equal slices (ZeRO-1 over the data-parallel group), padded to ``total``."""
    total = -(-numel // parts) * parts
    length = total // parts
    return index * length, length, total


class ShardedAdamW:
    """AdamW over flat buffers. At construction every parameter's storage moves into one
    contiguous buffer and every gradient becomes a view of a second one (as DDP's
    ``gradient_as_bucket_view`` and Megatron's contiguous buffers do), so synchronisation and
    the update run in place on whole buffers with a single temporary.

    On a lazy device (XLA) parameters and gradients stay separate tensors: a view of a shared
    buffer written in place becomes, in the traced graph, a fresh copy of the whole buffer per
    write (the 134M model asked XLA for 48 GB). There the flat vectors are concatenated per
    step and the result is copied back into each parameter, as torch-xla's own ZeRO does."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], cfg: TrainingConfig,
                 ps: ParallelState, zero1: bool):
        self.cfg, self.ps = cfg, ps
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.zero1 = zero1 and ps.dp > 1
        self.bf16_sr = cfg.precision == "bf16-sr"
        numel = sum(p.numel() for p in self.params)
        self.start, self.shard_len, self.total = shard_geometry(numel, ps.dp if self.zero1 else 1,
                                                                ps.dp_rank if self.zero1 else 0)
        dev, dtype = ps.device, self.params[0].dtype
        self.lazy = ps.runtime.lazy
        self.pad = self.total - numel
        self.param_buf = self.grad_buf = None
        if not self.lazy:
            self.param_buf = torch.zeros(self.total, device=dev, dtype=dtype)
            self.grad_buf = torch.zeros(self.total, device=dev, dtype=dtype)
        decay = torch.zeros(self.shard_len)
        # Ranges (within the shard) held by n ranks, counted 1/n in the norm: (lo, hi, n).
        self.replicated: list[tuple[int, int, int]] = []
        # Ranges of the full flat vector holding replicated key/value heads, summed over kv_group.
        self.kv_ranges: list[tuple[int, int]] = []
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                if not self.lazy:
                    self.param_buf[offset:offset + n].copy_(p.reshape(-1))
                    p.data = self.param_buf[offset:offset + n].view_as(p)
                    p.grad = self.grad_buf[offset:offset + n].view_as(p)
                lo, hi = max(offset, self.start) - self.start, min(offset + n, self.start + self.shard_len) - self.start
                if lo < hi:
                    if p.dim() >= 2:
                        decay[lo:hi] = 1.0  # no weight decay on norms and biases
                    if getattr(p, "tp_replicated", False) and ps.tp > 1:
                        self.replicated.append((lo, hi, ps.tp))
                kv = getattr(p, "kv_replicated", None)
                if kv is not None:
                    copies, ranges = kv
                    for a, b in ranges:
                        self.kv_ranges.append((offset + a, offset + b))
                        lo, hi = max(offset + a, self.start) - self.start, min(offset + b, self.start + self.shard_len) - self.start
                        if lo < hi:
                            self.replicated.append((lo, hi, copies))
                offset += n
        self.sequence_partial = [p for p in self.params if getattr(p, "sequence_partial", False)]
        # Runs of the shard with the same weight decay, for the fused kernel's tensor lists.
        self.decay = decay.to(dev)
        flags = decay.tolist()
        self.runs: list[tuple[int, int, bool]] = []
        lo = 0
        for i in range(1, self.shard_len + 1):
            if i == self.shard_len or flags[i] != flags[lo]:
                self.runs.append((lo, i, flags[lo] == 1.0))
                lo = i
        self.exp_avg = torch.zeros(self.shard_len, device=dev)
        self.exp_avg_sq = torch.zeros(self.shard_len, device=dev)
        self.step_count = 0
        # On a lazy device (XLA) the update runs without host decisions (step_on_device): the
        # count of applied updates then lives on the device too.
        self.step_tensor = torch.zeros((), device=dev) if self.lazy else None
        # Stochastic rounding noise: a generator per copy of the values it rounds, saved with the
        # optimizer state. Copies of the same values must round alike or they drift apart: the
        # data-parallel replicas without ZeRO-1, and the tensor-parallel ranks' replicated
        # parameters (norms, replicated key/value heads: same offsets in every rank's buffer).
        # So the seed is the pipeline stage's and, with ZeRO-1, the slice's (each slice is one
        # rank's alone), never the tensor rank's, nor the data rank's without ZeRO-1. On XLA the
        # Neuron runtime rounds (NEURON_RT_STOCHASTIC_ROUNDING_EN), so the generator is a host
        # one that only keeps the state format the same across backends.
        self.gen = torch.Generator(device="cpu" if self.lazy else dev).manual_seed(
            rounding_seed(cfg.seed, ps.pp_rank, ps.dp_rank if self.zero1 else 0))

    def _shard(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.start:self.start + self.shard_len]

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One padded flat vector of the given per-parameter tensors (lazy devices)."""
        parts = [t.reshape(-1) for t in tensors]
        if self.pad:
            parts.append(torch.zeros(self.pad, dtype=parts[0].dtype, device=parts[0].device))
        return torch.cat(parts)

    def params_flat(self) -> torch.Tensor:
        return self.param_buf if not self.lazy else self._flat([p.detach() for p in self.params])

    def grads_flat(self) -> torch.Tensor:
        if not self.lazy:
            return self.grad_buf
        return self._flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])

    def zero_grad(self) -> None:
        if self.lazy:
            for p in self.params:
                p.grad = None  # autograd makes fresh ones: no in-place writes to trace
            return
        self.grad_buf.zero_()  # gradients stay views of the buffer; autograd accumulates in place

    # -- the step --------------------------------------------------------------------------

    def sync_and_norm(self) -> tuple[torch.Tensor, float]:
        """Steps 1-3: returns this rank's averaged fp32 gradient slice and the global norm."""
        grads, sq = self.sync_and_norm_sq()
        return grads, math.sqrt(max(sq.item(), 0.0))

    def sync_and_norm_sq(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-3 without leaving the device: the gradient slice and the squared global norm."""
        ps = self.ps
        for p in self.sequence_partial:
            all_reduce(p.grad, ps.tp_group)
        flat = self.grads_flat()
        grads = flat if flat.dtype == torch.float32 else flat.float()
        for lo, hi in self.kv_ranges:  # each replica saw only its own query heads' share
            all_reduce(grads[lo:hi], ps.kv_group)
        if self.zero1:
            grads = reduce_scatter_dim(grads.unsqueeze(0), 1, ps.dp_group).squeeze(0)
        else:
            all_reduce(grads, ps.dp_group)
        grads.div_(ps.dp)
        sq = sum_sq(grads)
        for lo, hi, copies in self.replicated:  # held by several TP ranks: count once
            sq -= (1.0 - 1.0 / copies) * sum_sq(grads[lo:hi])
        if self.zero1:
            all_reduce(sq, ps.dp_group)
        all_reduce(sq, ps.tp_group)
        all_reduce(sq, ps.pp_group)  # each stage holds its own layers: the global norm sums them
        return grads, sq

    def step(self, grads: torch.Tensor, grad_norm: float, lr: float) -> None:
        """Steps 4-5, given the output of sync_and_norm (call only when the norm is finite)."""
        cfg = self.cfg
        if cfg.grad_clip > 0 and grad_norm > cfg.grad_clip:
            grads.mul_(cfg.grad_clip / (grad_norm + 1e-6))
        self.step_count += 1
        shard = self._shard(self.param_buf)
        if self.bf16_sr:
            values = self._adamw_explicit(shard.float(), grads, lr)
            shard.copy_(stochastic_round_to_bf16(values, self.gen))
        else:
            self._adamw_fused(shard, grads, lr)
        if self.zero1:
            chunks = list(self.param_buf.chunk(self.ps.dp))
            dist.all_gather(chunks, shard.clone(), group=self.ps.dp_group)

    def step_on_device(self, grads: torch.Tensor, sq_norm: torch.Tensor, loss: torch.Tensor,
                       lr: torch.Tensor) -> torch.Tensor:
        """Steps 4-5 for lazy devices (XLA): clipping and the skip of a non-finite step are
        computed on the device, so the step's graph needs no host value. Returns whether the
        update was applied (a 0-d bool tensor). Same arithmetic as the eager path's explicit
        update; a skipped step leaves parameters, moments and the step count unchanged."""
        cfg = self.cfg
        b1, b2 = cfg.betas
        norm = sq_norm.clamp(min=0).sqrt()
        ok = torch.isfinite(norm) & torch.isfinite(loss)
        if cfg.grad_clip > 0:
            scale = torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0)
            grads = grads * torch.where(norm > cfg.grad_clip, scale, torch.ones_like(scale))
        grads = torch.where(ok, grads, torch.zeros_like(grads))  # NaN * 0 would stay NaN
        self.step_tensor.add_(ok.to(self.step_tensor.dtype))
        count = torch.clamp(self.step_tensor, min=1.0)
        exp_avg = self.exp_avg * b1 + grads * (1 - b1)
        exp_avg_sq = self.exp_avg_sq * b2 + grads * grads * (1 - b2)
        bias1 = 1 - b1 ** count
        bias2 = 1 - b2 ** count
        flat = self.params_flat()
        shard = self._shard(flat)
        values = shard.float()
        updated = values - values * self.decay * (lr * cfg.weight_decay)
        updated = updated - (lr / bias1) * exp_avg / ((exp_avg_sq / bias2).sqrt() + cfg.eps)
        self.exp_avg.copy_(torch.where(ok, exp_avg, self.exp_avg))
        self.exp_avg_sq.copy_(torch.where(ok, exp_avg_sq, self.exp_avg_sq))
        new_shard = torch.where(ok, updated, values).to(shard.dtype)  # bf16: the device rounds
        if self.zero1:
            chunks = [torch.empty_like(new_shard) for _ in range(self.ps.dp)]
            dist.all_gather(chunks, new_shard, group=self.ps.dp_group)
            new_flat = torch.cat(chunks)
        else:
            new_flat = new_shard
        self.last_flat = new_flat  # the updated parameters as one vector, for param_norm_sq
        offset = 0
        with torch.no_grad():
            for p in self.params:  # one copy into each parameter (see the class docstring)
                p.copy_(new_flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        return ok

    def _adamw_explicit(self, values: torch.Tensor, grads: torch.Tensor, lr: float) -> torch.Tensor:
        """The AdamW update written out, in fp32 (used for bf16-sr, which rounds afterwards)."""
        cfg = self.cfg
        b1, b2 = cfg.betas
        self.exp_avg.mul_(b1).add_(grads, alpha=1 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(grads, grads, value=1 - b2)
        bias1 = 1 - b1 ** self.step_count
        bias2 = 1 - b2 ** self.step_count
        denom = torch.div(self.exp_avg_sq, bias2).sqrt_().add_(cfg.eps)  # the one temporary
        values.addcmul_(values, self.decay, value=-lr * cfg.weight_decay)
        values.addcdiv_(self.exp_avg, denom, value=-lr / bias1)
        return values

    def _adamw_fused(self, values: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """The same update in one pass per tensor: PyTorch's fused AdamW kernel (what
        ``torch.optim.AdamW(fused=True)`` calls), over runs of the flat buffers."""
        cfg = self.cfg
        b1, b2 = cfg.betas
        step = torch.tensor(float(self.step_count), device=values.device)
        for decayed in (True, False):
            runs = [(lo, hi) for lo, hi, d in self.runs if d == decayed]
            if not runs:
                continue
            torch._fused_adamw_([values[lo:hi] for lo, hi in runs], [grads[lo:hi] for lo, hi in runs],
                                [self.exp_avg[lo:hi] for lo, hi in runs], [self.exp_avg_sq[lo:hi] for lo, hi in runs],
                                [], [step] * len(runs), lr=lr, beta1=b1, beta2=b2,
                                weight_decay=cfg.weight_decay if decayed else 0.0, eps=cfg.eps,
                                amsgrad=False, maximize=False)

    def param_norm(self) -> float:
        """Global parameter norm (replicated parameters counted once)."""
        return math.sqrt(max(self.param_norm_sq().item(), 0.0))

    def param_norm_sq(self, flat: torch.Tensor | None = None) -> torch.Tensor:
        """The squared global parameter norm, on the device (of ``flat``, the parameters as one
        vector, when the caller has it: on XLA another concatenation would cost a pass)."""
        flat = (self.params_flat() if flat is None else flat).float()
        sq = sum_sq(flat)
        offset = 0
        for p in self.params:
            if getattr(p, "tp_replicated", False) and self.ps.tp > 1:
                seg = flat[offset:offset + p.numel()]
                sq -= (1.0 - 1.0 / self.ps.tp) * sum_sq(seg)
            copies, ranges = getattr(p, "kv_replicated", (1, []))
            for a, b in ranges:
                sq -= (1.0 - 1.0 / copies) * sum_sq(flat[offset + a:offset + b])
            offset += p.numel()
        all_reduce(sq, self.ps.tp_group)
        all_reduce(sq, self.ps.pp_group)
        return sq

    # -- checkpoint state ------------------------------------------------------------------

    def _cut(self, slices: dict[int, dict], count: int) -> dict:
        """This rank's state from slices of another data-parallel layout (``count`` of them,
        ``slices`` those this rank's range overlaps, by index): laid end to end they are the
        whole flat vector (the parameters in the same order: same names, same tensor and
        pipeline rank), padded for the old degree; this rank's range is copied out of the
        ones it overlaps, padded for this layout. Exact: the same moments."""
        numel = self.total - self.pad
        first = next(iter(slices.values()))
        for i, part in slices.items():
            if part["param_names"] != self.names:
                raise ValueError("optimizer state does not match this model (other parameters: another "
                                 "tensor or pipeline layout, or another model)")
            if part["step"] != first["step"]:
                raise ValueError(f"optimizer slices at different steps ({part['step']} and {first['step']})")
            start, length, total = part["shard"]
            if start != i * length or total != length * count:
                raise ValueError(f"optimizer slice {i} covers [{start}, {start + length}) of {total}: not one of "
                                 f"{count} equal slices in order")
        old_len, old_total = first["shard"][1], first["shard"][2]
        if old_total < numel:
            raise ValueError(f"optimizer state holds {old_total} values, this model {numel}")
        mine = {}
        lo, hi = self.start, min(self.start + self.shard_len, numel)  # past numel: this layout's padding
        for key in ("exp_avg", "exp_avg_sq"):
            out = torch.zeros(self.shard_len, dtype=first[key].dtype)  # its own storage: no old slice kept
            for i in range(lo // old_len, -(-hi // old_len)) if hi > lo else ():
                if i not in slices:
                    raise ValueError(f"optimizer slice {i} of {count} is needed for [{lo}, {hi}) and was not read")
                a, b = max(lo, i * old_len), min(hi, (i + 1) * old_len)
                out[a - lo:b - lo] = slices[i][key].detach().to("cpu")[a - i * old_len:b - i * old_len]
            mine[key] = out
        # the stochastic-rounding generator (bf16-sr; fp32 does not use it): with ZeRO-1 the one
        # of the slice this rank held, else the first read (ranks change with the degree, so its
        # stream does too); without, the lowest slice's for every replica, so that the copies
        # round alike (rounding_seed)
        same = slices.get(self.ps.dp_rank, first) if self.zero1 else slices[min(slices)]
        return {**mine, "step": first["step"], "generator": same["generator"],
                "shard": [self.start, self.shard_len, self.total], "param_names": self.names, "zero1": self.zero1}

    def state_dict(self) -> dict:
        if self.lazy:  # read at a checkpoint only (a host sync there is expected)
            self.step_count = int(self.step_tensor.item())
        return {"step": self.step_count, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
                "generator": self.gen.get_state(), "shard": [self.start, self.shard_len, self.total],
                "param_names": self.names, "zero1": self.zero1}

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """This rank's state; or, from a checkpoint written at another data-parallel degree or
        ZeRO-1 setting, the old slices this rank's range needs (trainer.checkpoint.checkpointer:
        ``{"slices": {index: state}, "count": n}``; a list is all of them), from which its slice
        is cut."""
        if isinstance(state, list):
            state = {"slices": dict(enumerate(state)), "count": len(state)}
        if "slices" in state:
            state = self._cut(state["slices"], state["count"])
        if state["shard"] != [self.start, self.shard_len, self.total] or state["param_names"] != self.names:
            raise ValueError("optimizer state does not match this model and layout (another tensor or pipeline "
                             "degree: python -m trainer.checkpoint.convert reshard)")
        self.step_count = state["step"]
        if self.lazy:
            self.step_tensor.fill_(float(self.step_count))
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.gen.set_state(state["generator"])
