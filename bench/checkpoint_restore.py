"""Restore time by source, on the same state: memory, a peer's memory, the store (local disk and
S3), against DCP's load of the same state from the same stores.

    python -m bench.checkpoint_restore [--size 100m] [--repeats 3]

Two processes on gloo stand for two nodes of one rank each (LOCAL_WORLD_SIZE=1), each with its
own memory directory under /dev/shm; the S3 rows run after them in one process (this machine's
memory does not hold both parts at once). Each save is ours (trainer.checkpoint.checkpointer.Checkpointer, sync,
memory tier on) and DCP's ``save``, to a local directory and to moto's S3 server on loopback
(``s3://``, through s3fs; DCP through its fsspec reader). Then, ``--repeats`` times each, on
rank 1, timed from nothing to the state loaded into the live model and optimizer:

  memory       Checkpointer.load with the node's own memory copy
  peer         the same after rank 1's memory is deleted (a replaced node): the copy comes
               from rank 0's memory over gloo (loopback TCP here; the pod network, TCP, on EKS)
  store-local  memory tier off, shards read from the local directory
  dcp-local    torch.distributed.checkpoint.load from the local directory
  store-s3     memory tier off, shards read from S3
  dcp-s3       DCP's load through its fsspec reader from S3

The page cache holds the local files (they were just written), so local figures are the
deserialising and copying; S3 adds moto's HTTP on loopback. Ratios are against dcp-local.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import shutil
import tempfile
import time

from bench.common import S3_ENV as ENV


def _rank(rank: int, args, port: int, work: str, endpoint: str, out) -> None:
    os.environ.update(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1",
                      TRAINER_MEMORY_DIR=f"/dev/shm/bench-restore-{os.getppid()}/node{rank}",
                      AWS_ENDPOINT_URL=endpoint, FSSPEC_S3_ENDPOINT_URL=endpoint)
    import fsspec
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from bench.common import model_with_adamw, run_config
    from bench.throughput import SIZES
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.config import CheckpointConfig, derive_layout
    from trainer.model.parallel import ParallelState

    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = endpoint
    torch.set_num_threads(1)
    model_over, seq, batch = SIZES[args.size]
    cfg = run_config(model_over, {"seqLen": seq, "globalBatchSize": batch * 2, "microBatchSize": batch})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    layout = derive_layout(2, cfg.model, cfg.parallelism, cfg.training, "cpu")
    ps = ParallelState(backend="cpu", device=torch.device("cpu"), rank=rank, world_size=2, local_rank=0,
                       layout=layout, tp_rank=0, dp_rank=rank, tp_group=None, dp_group=None, sequence_parallel=False)
    # ZeRO-1 over the two ranks: each rank's optimizer shard is its own in the store too
    model, opt = model_with_adamw(cfg, ps, zero1=True)
    group = dist.new_group(backend="gloo")
    meta = {"step": 1, "tokens": 0, "data": {}, "configDigest": "",
            "layout": {"tensor": 1, "pipeline": 1, "data": 2, "zero1": True}}
    cks = {memory: Checkpointer(CheckpointConfig(uri=f"{work}/ours", interval_steps=1, keep=1, async_save=False,
                                                 memory=memory), ps, group, group) for memory in ("peers", "off")}

    def state():
        return {"model": model.state_dict(), "optim": {"exp_avg": opt.exp_avg, "exp_avg_sq": opt.exp_avg_sq}}

    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + 2 * opt.exp_avg.numel() * 4
    assert cks["peers"].save(1, model.state_dict(), opt.state_dict(), {}, {}, meta).ok  # with its memory copies
    dcp.save(state(), checkpoint_id=f"{work}/dcp")
    layout_meta = {"tensor": 1, "pipeline": 1, "data": 2}

    def ours(ck) -> float:
        t0 = time.perf_counter()
        loaded = ck.load(ck.select_resume(), layout_meta)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optim"])
        return time.perf_counter() - t0

    def theirs(**where) -> float:
        t0 = time.perf_counter()
        dcp.load(state(), **where)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {k: [] for k in ("memory", "peer", "store-local", "dcp-local")}
    sources = {}
    for rep in range(args.repeats):
        ck = cks["peers"]
        times["memory"].append(ours(ck))
        sources["memory"] = ck.restore_source
        if rank == 1:  # this node was replaced: its memory is gone
            shutil.rmtree(ck.memory.base / "own", ignore_errors=True)
        dist.barrier()
        times["peer"].append(ours(ck))
        sources["peer"] = ck.restore_source
        times["store-local"].append(ours(cks["off"]))
        times["dcp-local"].append(theirs(checkpoint_id=f"{work}/dcp"))
        if rank == 1:
            print(f"round {rep + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()),
                  flush=True)
    if rank == 1:
        out.put((times, sources, nbytes))
    dist.barrier()
    shutil.rmtree(ck.memory.base, ignore_errors=True)  # before the S3 part: this machine's memory is small
    dist.destroy_process_group()


def _s3(args, work: str, endpoint: str, times: dict) -> None:
    """The store on S3, one process (the same rank's state as rank 1's, read whole)."""
    import fsspec
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from bench.common import model_with_adamw, run_config, single_process
    from bench.throughput import SIZES
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.config import CheckpointConfig

    os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint, FSSPEC_S3_ENDPOINT_URL=endpoint)
    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = endpoint
    model_over, seq, batch = SIZES[args.size]
    cfg = run_config(model_over, {"seqLen": seq, "globalBatchSize": batch, "microBatchSize": batch})
    ps = single_process(cfg)
    model, opt = model_with_adamw(cfg, ps)
    ck = Checkpointer(CheckpointConfig(uri="s3://bench/ours", interval_steps=1, keep=1, async_save=False,
                                       memory="off"), ps)
    meta = {"step": 1, "tokens": 0, "data": {}, "configDigest": "",
            "layout": {"tensor": 1, "pipeline": 1, "data": 1, "zero1": False}}
    assert ck.save(1, model.state_dict(), opt.state_dict(), {}, {}, meta).ok

    def state():
        return {"model": model.state_dict(), "optim": {"exp_avg": opt.exp_avg, "exp_avg_sq": opt.exp_avg_sq}}
    dcp.save(state(), storage_writer=FsspecWriter("s3://bench/dcp"), no_dist=True)
    times["store-s3"], times["dcp-s3"] = [], []
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        loaded = ck.load(ck.select_resume(), {"tensor": 1, "pipeline": 1, "data": 1})
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optim"])
        del loaded
        times["store-s3"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dcp.load(state(), storage_reader=FsspecReader("s3://bench/dcp"), no_dist=True)
        times["dcp-s3"].append(time.perf_counter() - t0)
        print(f"S3 round {rep + 1}/{args.repeats}: ours {times['store-s3'][-1]:.3f}s, dcp {times['dcp-s3'][-1]:.3f}s",
              flush=True)


def main() -> None:
    from bench.common import free_port, median, table
    from bench.throughput import SIZES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="100m", choices=list(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    from bench.common import loopback_s3
    work = tempfile.mkdtemp(prefix="bench-restore-")
    with contextlib.ExitStack() as stack:
        endpoint = stack.enter_context(loopback_s3("bench"))
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        stack.callback(shutil.rmtree, f"/dev/shm/bench-restore-{os.getpid()}", ignore_errors=True)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, args, port, work, endpoint, out)) for r in range(2)]
        for p in procs:
            p.start()
        while True:  # a rank that dies (out of memory) must not leave this waiting
            try:
                times, sources, nbytes = out.get(timeout=5)
                break
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"a rank exited {dead[0]} (out of memory? try a smaller --size)")
        for p in procs:
            p.join(120)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        _s3(args, work, endpoint, times)
    assert sources == {"memory": "memory", "peer": "peer"}, sources
    base = median(times["dcp-local"])
    store = median(times["store-local"])
    rows = [[k, f"{median(v):.3f}", f"{median(v) / base:.2f}x", f"{store / median(v):.1f}x"] for k, v in times.items()]
    print()
    print(f"Restore of one rank's state ({args.size} model + AdamW, {nbytes / 1e9:.2f} GB) into the live model "
          f"and optimizer, median of {args.repeats}, rank 1 of 2")
    print(table(["source", "restore s", "vs dcp-local", "store-local / this"], rows))


if __name__ == "__main__":
    main()
