"""A damaged newest checkpoint: what finding it and falling back to the previous tag costs, against
the restore of an intact newest tag in the same run.

    python -m bench.damaged_restore [--size 100m] [--repeats 3] [--train-steps 20]

Part 1, restore. Two processes on gloo (data parallel, ZeRO-1: each rank reads an optimizer shard
of its own), our Checkpointer (sync, memory tier off) saves step_1 and step_2 of the same state to
a local directory. Then, ``--repeats`` times each, timed on every rank from the load call to the
state loaded into the live model and optimizer, the gang's time being its slowest rank's:

  intact            step_2 as written: every file checked against meta.json's records
  intact-unchecked  step_2 with the records taken out of its meta.json (a tag written before
                    records: trusted, read as before this release)
  truncated         rank 1's optimizer shard of step_2 cut to half: its size gives it away; both
                    ranks fall back to step_1
  changed           one byte of that shard changed (same size): its xxh3 gives it away
  deleted           the model shard of step_2 deleted (both ranks read it)

Each case works on its own copy of the store (hard links, the damaged file written anew, before
the timer starts); the page cache holds the files (they were just written), so the figures are
checking, deserialising and copying; a store's read time comes on top.

Part 2, back to training. The real trainer (python -m trainer.pod.launch, two ranks, the tiny corpus)
runs ``2 x --train-steps`` steps saving every ``--train-steps``; then a restart of the same run is
timed from its start to its first step past the newest tag: from an intact store (restore, one
step) and from one whose newest tag has a shard cut short (the fallback restore, then the steps
between the two tags again, then that step). Its losses must equal the intact restart's.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("intact", "intact-unchecked", "truncated", "changed", "deleted")


def _damage(tag: Path, case: str) -> None:
    """Damage a copy of the tag whose files are hard links of the saved ones: a file changed is
    unlinked first and written anew, so the saved store is never touched."""
    from trainer.checkpoint import ckpt_store
    from trainer.checkpoint.checkpointer import DIGESTS
    optim = tag / "optim" / ckpt_store.shard_name(1, 0)

    def rewrite(path: Path, data: bytes) -> None:
        path.unlink()
        path.write_bytes(data)
    if case == "intact-unchecked":
        meta = json.loads((tag / "meta.json").read_text())
        del meta[DIGESTS]
        rewrite(tag / "meta.json", json.dumps(meta).encode())
    elif case == "truncated":
        data = optim.read_bytes()
        rewrite(optim, data[: len(data) // 2])
    elif case == "changed":
        data = bytearray(optim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        rewrite(optim, bytes(data))
    elif case == "deleted":
        (tag / "model" / ckpt_store.shard_name(0, 0)).unlink()


def _rank(rank: int, args, port: int, work: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
    os.environ.pop("TRAINER_MEMORY_DIR", None)
    import torch
    import torch.distributed as dist

    from bench.common import model_with_adamw, run_config
    from bench.throughput import SIZES
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.config import CheckpointConfig, derive_layout
    from trainer.model.parallel import ParallelState

    torch.set_num_threads(1)
    model_over, seq, batch = SIZES[args.size]
    cfg = run_config(model_over, {"seqLen": seq, "globalBatchSize": batch * 2, "microBatchSize": batch})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    layout = derive_layout(2, cfg.model, cfg.parallelism, cfg.training, "cpu")
    ps = ParallelState(backend="cpu", device=torch.device("cpu"), rank=rank, world_size=2, local_rank=0,
                       layout=layout, tp_rank=0, dp_rank=rank, tp_group=None, dp_group=None, sequence_parallel=False)
    model, opt = model_with_adamw(cfg, ps, zero1=True)
    group = dist.new_group(backend="gloo")
    saved = f"{work}/saved"
    writer = Checkpointer(CheckpointConfig(uri=saved, interval_steps=1, keep=0, async_save=False, memory="off"),
                          ps, group, group)
    for step in (1, 2):
        meta = {"step": step, "tokens": 0, "data": {}, "configDigest": "",
                "layout": {"tensor": 1, "pipeline": 1, "data": 2, "zero1": True}}
        assert writer.save(step, model.state_dict(), opt.state_dict(), {}, {}, meta).ok
    layout_meta = {"tensor": 1, "pipeline": 1, "data": 2}
    times: dict[str, list[float]] = {case: [] for case in CASES}
    for rep in range(args.repeats):
        for case in CASES:
            store = f"{work}/{case}"
            if rank == 0:  # a fresh copy of the store, damaged, before the clock starts
                shutil.rmtree(store, ignore_errors=True)
                shutil.copytree(saved, store, copy_function=os.link)  # the same pages, no copy
                _damage(Path(store) / "step_2", case)
            dist.barrier()
            ck = Checkpointer(CheckpointConfig(uri=store, keep=0, async_save=False, memory="off"), ps, group, group)
            tag = ck.select_resume()
            t0 = time.perf_counter()
            loaded = ck.load(tag, layout_meta)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optim"])
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)  # the gang waits for its slowest rank
            expected = "step_2" if case.startswith("intact") else "step_1"
            assert loaded["tag"].tag == expected and (ck.skipped is None) == case.startswith("intact"), case
            del loaded
            times[case].append(float(took.item()))
        if rank == 0:
            print(f"round {rep + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()),
                  flush=True)
    if rank == 0:
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + 2 * opt.exp_avg.numel() * 4
        out.put((times, nbytes))
    dist.barrier()
    dist.destroy_process_group()


def restore_part(args, work: str) -> tuple[dict, int]:
    import torch.multiprocessing as mp

    from bench.common import free_port
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args, port, work, out)) for r in range(2)]
    for p in procs:
        p.start()
    while True:  # a rank that dies (out of memory) must not leave this waiting
        try:
            times, nbytes = out.get(timeout=5)
            break
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"a rank exited {dead[0]} (out of memory? try a smaller --size)")
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return times, nbytes


# -- part 2: the real trainer ----------------------------------------------------------------------

def _trainer(work: Path, tiny: dict, store: Path, steps: int, interval: int, name: str) -> tuple[float, dict]:
    """Run the trainer (2 ranks); (seconds from the start to its last step, its losses by step)."""
    root = Path(__file__).resolve().parents[1]
    losses = work / f"{name}.jsonl"
    losses.unlink(missing_ok=True)
    overrides = [f"data.sources=[{{uri: {tiny['stories']}, weight: 3}}, {{uri: {tiny['facts']}, weight: 1}}]",
                 f"data.tokenizer={tiny['tokenizer']}", f"training.steps={steps}", "training.decaySteps=100",
                 f"checkpoint.intervalSteps={interval}", f"checkpoint.uri={store}", "checkpoint.keep=0",
                 "parallelism.zero1=true", f"logging.lossesFile={losses}", "logging.interval=1"]
    cmd = [sys.executable, "-m", "trainer.pod.launch", "--standalone", "--nproc_per_node", "2", "-m", "trainer",
           "--config", str(root / "examples" / "tiny-cpu.yaml"), *sum((["--override", o] for o in overrides), [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TRAINER_MEMORY_DIR", None)
    started = time.time()
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"the trainer exited {res.returncode}: {res.stderr[-3000:]}")
    rows = {r["step"]: r for r in map(json.loads, losses.read_text().splitlines()) if "step" in r}
    return max(r["time"] for r in rows.values()) - started, rows


def training_part(args, work: Path) -> dict[str, list[float]]:
    from trainer.checkpoint import ckpt_store
    from trainer.data import tinydata
    tiny = tinydata.ensure(str(work / "data"))
    k = args.train_steps
    saved = work / "trained"
    _trainer(work, tiny, saved, 2 * k, k, "first")
    times: dict[str, list[float]] = {"intact": [], "truncated": []}
    losses = {}
    for rep in range(args.repeats):
        for case in times:
            store = work / f"train-{case}"
            shutil.rmtree(store, ignore_errors=True)
            shutil.copytree(saved, store)
            if case == "truncated":
                shard = store / f"step_{2 * k}" / "optim" / ckpt_store.shard_name(1, 0)
                shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
            seconds, rows = _trainer(work, tiny, store, 2 * k + 1, k, case)
            times[case].append(seconds)
            losses[case] = rows[2 * k + 1]["loss"]
        print(f"training round {rep + 1}/{args.repeats}: " + ", ".join(f"{c} {v[-1]:.2f}s" for c, v in times.items()),
              flush=True)
    assert losses["intact"] == losses["truncated"], losses  # the same step, bitwise, either way
    return times


def main() -> None:
    from bench.common import median, stop_cleanly_on_signals, table
    from bench.throughput import SIZES
    stop_cleanly_on_signals()  # a `timeout` still removes the work directory
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="100m", choices=list(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=20, help="steps between the two tags of part 2")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-damaged-")
    try:
        times, nbytes = restore_part(args, work)
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        trained = training_part(args, Path(work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = median(times["intact"])
    rows = [[case, f"{median(v):.3f}", f"{median(v) / base:.2f}x"] for case, v in times.items()]
    print()
    print(f"Restore ({args.size} model + AdamW, {nbytes / 1e9:.2f} GB per rank, ZeRO-1 over 2 ranks, local store, "
          f"page cache warm), median of {args.repeats}; damaged cases load step_1 after finding step_2 damaged")
    print(table(["newest tag", "restore s", "vs intact"], rows))
    base = median(trained["intact"])
    rows = [[case, f"{median(v):.2f}", f"{median(v) / base:.2f}x"] for case, v in trained.items()]
    print()
    print(f"Restart of the trainer (tiny model, 2 ranks) to its first step past the newest tag (tags "
          f"{args.train_steps} steps apart), median of {args.repeats}")
    print(table(["newest tag", "start -> step past it, s", "vs intact"], rows))


if __name__ == "__main__":
    main()
