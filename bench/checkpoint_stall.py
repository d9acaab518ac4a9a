"""How long a checkpoint save blocks the training loop, three ways, on the same state.

    python -m bench.checkpoint_stall [--size 100m] [--repeats 3] [--dir /tmp/ckpt-bench]

  ours-async  trainer.checkpoint.Checkpointer with async on (host copy, background write)
  ours-sync   the same Checkpointer with async off (what NxD does without async_save)
  dcp-async   torch.distributed.checkpoint.async_save of the same state dict

The state is a model of the chosen size plus its AdamW moments (3 x parameters in fp32).
Each method saves ``--repeats`` times in a row, as a training run does; the first save of a
run allocates host buffers, later ones reuse them (ours) or DCP's own staging.
"Stall" is the time the caller is blocked; "total" adds the background write until it is
durable. Ratios compare each stall with ours-async's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from bench.common import median, run_config, single_process, table
from bench.throughput import SIZES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="100m", choices=list(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="")
    args = ap.parse_args()

    from trainer.checkpoint import Checkpointer
    from trainer.config import CheckpointConfig
    from trainer.model import Transformer
    from trainer.optim import ShardedAdamW

    model_over, seq, batch = SIZES[args.size]
    cfg = run_config(model_over, {"seqLen": seq, "globalBatchSize": batch, "microBatchSize": batch})
    ps = single_process(cfg)
    model = Transformer(cfg.model, seed=0, max_seq_len=seq)
    opt = ShardedAdamW(list(model.named_parameters()), cfg.training, ps, zero1=False)
    opt.exp_avg.normal_(), opt.exp_avg_sq.uniform_()
    model_state, optim_state = model.state_dict(), opt.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in model_state.values()) + 2 * opt.exp_avg.numel() * 4
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)  # DCP needs a process group
    import torch.distributed.checkpoint as dcp

    meta = {"step": 1, "tokens": 0, "data": {}, "configDigest": "", "layout": {"tensor": 1, "data": 1, "zero1": False}}
    results: dict[str, tuple[list, list]] = {k: ([], []) for k in ("ours-async", "ours-sync", "dcp-async")}
    # One checkpointer per mode for the whole run, as in training (it reuses its host buffers).
    checkpointers = {mode: Checkpointer(CheckpointConfig(uri=f"{root}/{mode}", interval_steps=1, keep=1,
                                                         async_save=mode == "ours-async"), ps)
                     for mode in ("ours-async", "ours-sync")}
    for rep in range(args.repeats):
        for mode, ck in checkpointers.items():
            t0 = time.perf_counter()
            res = ck.save(rep + 1, model_state, optim_state, {}, {}, meta)
            stall = time.perf_counter() - t0
            ck.finalize()
            assert res.ok, res.error
            results[mode][0].append(stall), results[mode][1].append(time.perf_counter() - t0)
        state = {"model": model_state, "optim": {"exp_avg": opt.exp_avg, "exp_avg_sq": opt.exp_avg_sq}}
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=f"{root}/dcp/{rep}")
        stall = time.perf_counter() - t0
        future.result()
        results["dcp-async"][0].append(stall), results["dcp-async"][1].append(time.perf_counter() - t0)
        print(f"round {rep + 1}/{args.repeats}: " + ", ".join(f"{k} stall {v[0][-1]:.3f}s" for k, v in results.items()),
              flush=True)
    dist.destroy_process_group()
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    base = median(results["ours-async"][0])
    sync = median(results["ours-sync"][0])
    rows = [[k, f"{median(s):.3f}", f"{median(t):.3f}", f"{median(s) / base:.1f}x", f"{median(s) / sync:.1%}"]
            for k, (s, t) in results.items()]
    print()
    print(f"Checkpoint stall, {args.size} model + AdamW state ({nbytes / 1e9:.2f} GB), local disk, "
          f"median of {args.repeats}")
    print(table(["method", "stall s", "total s", "stall vs ours-async", "stall / sync save"], rows))


if __name__ == "__main__":
    main()
