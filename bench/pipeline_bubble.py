"""Pipeline bubble of the trainer's schedule against the 1F1B bound (p - 1) / (m + p - 1).

    python -m bench.pipeline_bubble [--configs 2x2,2x8,4x4,4x16,8x8,8x32] [--forward-ms 20] [--steps 3]

Each configuration ``PxM`` runs P real processes (one per stage, gloo, as trainer.model.pipeline runs
them) through ``torch.distributed.pipelining``'s Schedule1F1B (the trainer's) and, as the peer
in the same run, ScheduleGPipe, over M micro-batches. A stage's compute is a stand-in: forward
sleeps ``--forward-ms`` and backward twice that (the usual 1:2 ratio), inside autograd, so P
stages are not P processes competing for this machine's two cores and the time a stage waits
for its neighbours is all that is measured. Activations are real tensors sent between the
processes.

    ideal  = M x (forward + backward)          one stage's own work for the step
    bubble = 1 - ideal / measured step time    the share of the step a stage is idle
    bound  = (P - 1) / (M + P - 1)             1F1B's (and GPipe's) idle share with zero-cost
                                               communication

The ratio measured / bound near 1 says the schedule adds nothing beyond the bubble inherent to
P stages and M micro-batches; what is above it is send/receive and scheduling overhead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.pipelining import ScheduleGPipe

from bench.common import free_port, table
from trainer.model.pipeline import _Stage

HIDDEN = 64


class _Busy(torch.autograd.Function):
    """A stand-in for a stage's compute: sleeps in forward and (twice as long) in backward."""

    @staticmethod
    def forward(ctx, x, w, seconds):
        ctx.seconds = seconds
        ctx.save_for_backward(x, w)
        time.sleep(seconds)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        time.sleep(2 * ctx.seconds)
        return g * w, (g * x).sum(0), None


class _SleepStage(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.w = nn.Parameter(torch.ones(HIDDEN))
        self.seconds = seconds

    def forward(self, x):
        return _Busy.apply(x, self.w, self.seconds)


def _worker(rank: int, world: int, port: int, micro: int, seconds: float, steps: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.pipelining import Schedule1F1B
        results = {}
        for name, cls in (("1F1B", Schedule1F1B), ("GPipe", ScheduleGPipe)):
            stage = _Stage(_SleepStage(seconds), rank, world, torch.device("cpu"))
            schedule = cls(stage, micro, loss_fn=lambda out, target: ((out - target) ** 2).mean())
            batch = torch.ones(micro, HIDDEN)
            times = []
            for step in range(steps + 1):  # the first step infers shapes: not timed
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    schedule.step(batch)
                elif rank == world - 1:
                    schedule.step(target=torch.zeros(micro, HIDDEN))
                else:
                    schedule.step()
                dist.barrier()
                if step:
                    times.append(time.perf_counter() - t0)
            results[name] = statistics.median(times)
        if rank == 0:
            out.put(results)
    finally:
        dist.destroy_process_group()


def measure(stages: int, micro: int, seconds: float, steps: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_worker, args=(stages, free_port(), micro, seconds, steps, out), nprocs=stages,
                       join=True, start_method="spawn")
    return out.get(timeout=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="2x2,2x8,4x4,4x16,8x8,8x32",
                    help="comma-separated STAGESxMICROBATCHES")
    ap.add_argument("--forward-ms", type=float, default=20.0, help="stand-in forward time per micro-batch")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration (median)")
    args = ap.parse_args(argv)
    seconds = args.forward_ms / 1000
    rows = []
    for item in args.configs.split(","):
        p, m = (int(v) for v in item.lower().split("x"))
        if m < p:
            raise SystemExit(f"{item}: 1F1B needs at least as many micro-batches as stages")
        print(f"[bench] {p} stages x {m} micro-batches ...", flush=True)
        got = measure(p, m, seconds, args.steps)
        ideal = m * 3 * seconds
        bound = (p - 1) / (m + p - 1)
        b1, bg = 1 - ideal / got["1F1B"], 1 - ideal / got["GPipe"]
        rows.append([p, m, f"{got['1F1B']:.3f}", f"{ideal:.3f}", f"{b1:.3f}", f"{bound:.3f}",
                     f"{b1 / bound:.2f}", f"{bg:.3f}", f"{b1 / bg:.2f}"])
    print(table(["stages", "micro", "1F1B s/step", "ideal s", "1F1B bubble", "bound", "bubble/bound",
                 "GPipe bubble", "1F1B/GPipe"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
