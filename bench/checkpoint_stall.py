"""How long a checkpoint save blocks the training loop, three ways, on the same state.

    python -m bench.checkpoint_stall [--size 100m] [--repeats 3] [--dir /tmp/ckpt-bench]

  ours-async  trainer.checkpoint.Checkpointer with async on (host copy, background write)
  ours-sync   the same Checkpointer with async off (what NxD does without async_save)
  dcp-async   torch.distributed.checkpoint.async_save of the same state dict

Then each restores the newest save into the live model and optimizer, timed from nothing to
loaded ("restore s"): ours (``Checkpointer.select_resume`` + ``load`` + ``load_state_dict``,
as ``Trainer.resume`` does) against DCP's ``load`` in place of the same state. The files were
just written, so both read from the page cache: the figure is the deserialising and copying,
the store's read speed comes on top.

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

from bench.common import median, model_with_adamw, run_config, single_process, table
from bench.throughput import SIZES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="100m", choices=list(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="")
    args = ap.parse_args()

    from trainer.checkpoint import Checkpointer
    from trainer.config import CheckpointConfig

    model_over, seq, batch = SIZES[args.size]
    cfg = run_config(model_over, {"seqLen": seq, "globalBatchSize": batch, "microBatchSize": batch})
    ps = single_process(cfg)
    model, opt = model_with_adamw(cfg, ps)
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
    # restores: the newest save of each, into the live state
    restores: dict[str, list[float]] = {"ours": [], "dcp": []}
    layout = {"tensor": 1, "pipeline": 1, "data": 1}
    for _ in range(args.repeats):
        ck = checkpointers["ours-sync"]
        t0 = time.perf_counter()
        tag = ck.select_resume()
        loaded = ck.load(tag, layout)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optim"])
        restores["ours"].append(time.perf_counter() - t0)
        state = {"model": model.state_dict(), "optim": {"exp_avg": opt.exp_avg, "exp_avg_sq": opt.exp_avg_sq}}
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=f"{root}/dcp/{args.repeats - 1}")
        restores["dcp"].append(time.perf_counter() - t0)
        print(f"restore: ours {restores['ours'][-1]:.3f}s, dcp {restores['dcp'][-1]:.3f}s", flush=True)
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
    ours_r, dcp_r = median(restores["ours"]), median(restores["dcp"])
    print()
    print(f"Restore into the live model and optimizer, median of {args.repeats} (page cache warm)")
    print(table(["method", "restore s", "vs dcp load"], [["ours", f"{ours_r:.3f}", f"{ours_r / dcp_r:.2f}x"],
                                                        ["dcp load", f"{dcp_r:.3f}", "1.00x"]]))


if __name__ == "__main__":
    main()
