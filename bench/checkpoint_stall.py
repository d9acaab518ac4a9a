"""How long a checkpoint save blocks the training loop, and when it is durable, three ways, on
the same state, on local disk and on S3.

    python -m bench.checkpoint_stall [--size 100m] [--repeats 3] [--stores local,s3] [--dir /tmp/ckpt-bench]

  ours-async  trainer.checkpoint.checkpointer.Checkpointer with async on (host copy, background write)
  ours-sync   the same Checkpointer with async off (what NxD does without async_save)
  dcp-async   torch.distributed.checkpoint.async_save of the same state dict

"Stall" is the time the caller is blocked. "Durable" is the time from the save call until the
save would survive the node: ours until its ``done`` marker is written (shards fsynced, or the
S3 objects complete; retention afterwards is not counted), DCP's until its future resolves
(files written and fsynced, metadata written). Stores: ``local`` a directory on this disk,
``s3`` moto's S3 server on loopback through s3fs (DCP through its fsspec writer).

Then, on local disk, each restores the newest save into the live model and optimizer, timed
from nothing to loaded ("restore s"): ours (``Checkpointer.select_resume`` + ``load`` +
``load_state_dict``, as ``Trainer.resume`` does) against DCP's ``load`` in place of the same
state. The files were just written, so both read from the page cache (bench/checkpoint_restore
measures restores by source, S3 included).

The state is a model of the chosen size plus its AdamW moments (3 x parameters in fp32).
Each method saves ``--repeats`` times in a row, as a training run does; the first save of a
run allocates host buffers, later ones reuse them (ours) or DCP's own staging. The previous
round's DCP save is deleted before the next (ours keeps one, by retention). The methods take
turns going first in a round.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from bench.common import free_port, loopback_s3, median, model_with_adamw, run_config, single_process, table
from bench.throughput import SIZES


METHODS = ("ours-async", "ours-sync", "dcp-async")


def _rounds(args, root: str, model, opt, results: dict) -> None:
    """``--repeats`` saves per method into ``root``; appends (stall, durable) per method."""
    import fsspec
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.config import CheckpointConfig

    meta = {"step": 1, "tokens": 0, "data": {}, "configDigest": "", "layout": {"tensor": 1, "data": 1, "zero1": False}}
    model_state, optim_state = model.state_dict(), opt.state_dict()
    ps = args.ps
    # One checkpointer per mode for the whole run, as in training (it reuses its host buffers).
    checkpointers = {mode: Checkpointer(CheckpointConfig(uri=f"{root}/{mode}", interval_steps=1, keep=1,
                                                         async_save=mode == "ours-async", memory="off"), ps)
                     for mode in ("ours-async", "ours-sync")}
    fs, _ = fsspec.core.url_to_fs(root)
    def dcp_save(rep: int) -> None:
        state = {"model": model_state, "optim": {"exp_avg": opt.exp_avg, "exp_avg_sq": opt.exp_avg_sq}}
        target = f"{root}/dcp/{rep}"
        t0 = time.perf_counter()
        future = (dcp.async_save(state, checkpoint_id=target) if root.startswith("/")
                  else dcp.async_save(state, storage_writer=FsspecWriter(target)))
        stall = time.perf_counter() - t0
        future.result()
        results["dcp-async"].append((stall, time.perf_counter() - t0))
        if rep:
            fs.rm(f"{root}/dcp/{rep - 1}", recursive=True)

    for rep in range(args.repeats):
        # the methods take turns going first: the one after another's write and deletion pays
        # for the disk's writeback of it
        for mode in METHODS[rep % 3:] + METHODS[:rep % 3]:
            if mode == "dcp-async":
                dcp_save(rep)
                continue
            ck = checkpointers[mode]
            res = ck.save(rep + 1, model_state, optim_state, {}, {}, meta)
            ck.finalize()
            assert res.ok, res.error
            results[mode].append((res.stall_seconds, res.durable_seconds))
        print(f"{args.store} round {rep + 1}/{args.repeats}: "
              + ", ".join(f"{k} stall {v[-1][0]:.3f}s durable {v[-1][1]:.3f}s" for k, v in results.items()), flush=True)


def _restores(args, root: str, model, opt) -> dict[str, list[float]]:
    """Restore the newest local saves into the live state: ours against DCP's load."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.config import CheckpointConfig
    restores: dict[str, list[float]] = {"ours": [], "dcp": []}
    layout = {"tensor": 1, "pipeline": 1, "data": 1}
    ck = Checkpointer(CheckpointConfig(uri=f"{root}/ours-sync", interval_steps=1, keep=1, memory="off"), args.ps)
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        loaded = ck.load(ck.select_resume(), layout)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optim"])
        restores["ours"].append(time.perf_counter() - t0)
        state = {"model": model.state_dict(), "optim": {"exp_avg": opt.exp_avg, "exp_avg_sq": opt.exp_avg_sq}}
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=f"{root}/dcp/{args.repeats - 1}")
        restores["dcp"].append(time.perf_counter() - t0)
        print(f"restore: ours {restores['ours'][-1]:.3f}s, dcp {restores['dcp'][-1]:.3f}s", flush=True)
    return restores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="100m", choices=list(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stores", default="local,s3", help="comma-separated: local, s3")
    ap.add_argument("--dir", default="", help="the local store's directory (default: a new temporary one)")
    args = ap.parse_args()
    stores = [x for x in args.stores.split(",") if x]
    if not stores or set(stores) - {"local", "s3"}:
        ap.error(f"--stores: local and/or s3, not {args.stores!r}")

    model_over, seq, batch = SIZES[args.size]
    cfg = run_config(model_over, {"seqLen": seq, "globalBatchSize": batch, "microBatchSize": batch})
    args.ps = single_process(cfg)
    torch.set_num_threads(1)  # the write is what is measured; a rank's loop would hold the others
    model, opt = model_with_adamw(cfg, args.ps)
    nbytes = (sum(t.numel() * t.element_size() for t in model.state_dict().values())
              + 2 * opt.exp_avg.numel() * 4)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)  # DCP needs a process group
    saves: dict[str, dict[str, list]] = {}
    restores = None
    with contextlib.ExitStack() as stack:
        for store in stores:
            args.store = store
            saves[store] = {k: [] for k in METHODS}
            if store == "s3":
                stack.enter_context(loopback_s3("bench"))
                _rounds(args, "s3://bench/stall", model, opt, saves[store])
                continue
            root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")
            if not args.dir:
                stack.callback(shutil.rmtree, root, ignore_errors=True)
            _rounds(args, root, model, opt, saves[store])
            restores = _restores(args, root, model, opt)
    dist.destroy_process_group()

    rows = []
    for store, results in saves.items():
        med = {k: (median([s for s, _ in v]), median([d for _, d in v])) for k, v in results.items()}
        for k, (stall, durable) in med.items():
            rows.append([store, k, f"{stall:.3f}", f"{durable:.3f}", f"{durable / med['dcp-async'][1]:.2f}x",
                         f"{durable / med['ours-sync'][1]:.2f}x", f"{stall / med['ours-sync'][0]:.1%}"])
    print()
    print(f"Checkpoint save, {args.size} model + AdamW state ({nbytes / 1e9:.2f} GB), median of {args.repeats}")
    print(table(["store", "method", "stall s", "durable s", "durable vs dcp-async", "durable vs ours-sync",
                 "stall / sync save"], rows))
    if restores:
        ours_r, dcp_r = median(restores["ours"]), median(restores["dcp"])
        print()
        print(f"Restore into the live model and optimizer, local disk, median of {args.repeats} (page cache warm)")
        print(table(["method", "restore s", "vs dcp load"], [["ours", f"{ours_r:.3f}", f"{ours_r / dcp_r:.2f}x"],
                                                            ["dcp load", f"{dcp_r:.3f}", "1.00x"]]))


if __name__ == "__main__":
    main()
