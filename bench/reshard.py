"""Resharding a checkpoint to another tensor-parallel degree: ours against DCP's resharding
planner, on the same state (the model and its AdamW moments), from tensor parallel 2 to 1.

    python -m bench.reshard [--size 100m] [--repeats 3] [--dir /tmp/reshard-bench]

  ours        python -m trainer.checkpoint.convert reshard SRC OUT --tensor 1: reads the tag,
              merges the shards, writes a complete tag of our layout at TP 1 (model, moments,
              scheduler, data position; records, done)
  dcp-load    torch.distributed.checkpoint.load of the same state saved by DCP from 2 processes
              as DTensors (torchtitan's placements: q, k, v, gate, up, the embedding and the head
              split by rows, o and down by columns, the norms replicated) into full tensors in
              one process (no_dist): DCP's planner reshards on load
  dcp         dcp-load, then dcp.save of the full state to a new checkpoint: the same work as ours

The source is the real trainer's checkpoint after one step at TP 2 (its own files, written by
its own checkpointer); DCP's source holds the same tensors (the trainer's shards merged, then
cut as DCP's placements say). Each method runs as its own process (so its peak resident memory,
VmHWM, is its own, Python and torch included); the methods take turns; the files were just
written, so every read comes from the page cache. After the rounds, the state each produced is
checked equal, bitwise.

NxD's own converter (neuronx_distributed/scripts/checkpoint_converter.py) is not run: it
converts model weights only (no optimizer state) and expects NxD's module names; like ours it
holds the full state in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import median, table
from bench.throughput import SIZES

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("ours", "dcp-load", "dcp")


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "api"), str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")])}


def train_source(size: str, work: Path) -> Path:
    """The trainer's own checkpoint of ``size`` after one step at TP 2 (2 processes)."""
    from trainer.data import tinydata

    data = tinydata.ensure(str(work / "data"))
    model, seq, _ = SIZES[size]
    ckpt = work / "source"
    overrides = [f"model={json.dumps(model)}", "parallelism.tensor=2", "parallelism.zero1=false",
                 f"training.seqLen={seq}", "training.globalBatchSize=2", "training.microBatchSize=2",
                 "training.steps=1", "training.warmupSteps=1",
                 f"data.sources=[{{uri: {data['stories']}, weight: 1}}]", f"data.tokenizer={data['tokenizer']}",
                 f"checkpoint.uri={ckpt}", "checkpoint.intervalSteps=1", "checkpoint.keep=0", "checkpoint.memory=off"]
    cmd = [sys.executable, "-m", "trainer.pod.launch", "--standalone", "--nproc_per_node", "2",
           "-m", "trainer", "--config", str(ROOT / "examples" / "tiny-cpu.yaml")]
    for o in overrides:
        cmd += ["--override", o]
    print(f"[bench] training one step of the {size} model at TP 2 for the source checkpoint", flush=True)
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1800)
    if res.returncode:
        raise SystemExit(f"the trainer failed:\n{res.stderr[-3000:]}")
    return ckpt / "step_1"


def _full_state(tag: str) -> tuple[dict, dict]:
    """(Hugging Face-named full tensors of the model and both moments, their kinds by name)."""
    from trainer.checkpoint import reshard
    from trainer.checkpoint.tags import _fs, read_tag
    from trainer.model import hf

    meta, cfg, shards = read_tag(tag)
    fs, path = _fs(tag)
    olds = [reshard._old_rank(fs, path, meta, r, s) for r, s in enumerate(shards)]
    state = {"model": hf.merge_to_hf(shards, cfg), "exp_avg": hf.merge_to_hf([o[1] for o in olds], cfg),
             "exp_avg_sq": hf.merge_to_hf([o[2] for o in olds], cfg)}
    kinds = {n: s.kind for s in hf.param_map(cfg).values() for n in s.names}
    return state, kinds


def _dcp_save_rank(rank: int, tag: str, out: str, port: int) -> None:
    """One of the 2 processes that save the source as DCP: its DTensor shards."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    full, kinds = _full_state(tag)
    placement = {"rows": Shard(0), "blocks": Shard(0), "cols": Shard(1), "full": Replicate()}

    def local(t, kind):
        if kind == "full":
            return t.clone()
        return t.chunk(2, dim=0 if kind in ("rows", "blocks") else 1)[rank].contiguous()
    state = {part: {n: DTensor.from_local(local(t, kinds[n]), mesh, [placement[kinds[n]]], run_check=False)
                    for n, t in tensors.items()} for part, tensors in full.items()}
    dcp.save(state, checkpoint_id=out)
    dist.destroy_process_group()


def dcp_source(tag: Path, out: Path) -> None:
    import torch.multiprocessing as mp

    from bench.common import free_port
    print("[bench] saving the same state with DCP from 2 processes", flush=True)
    mp.spawn(_dcp_save_rank, args=(str(tag), str(out), free_port()), nprocs=2, join=True)


def child_dcp(src: str, out: str | None) -> None:
    """DCP's reshard to TP 1: full tensors allocated as its metadata says, loaded (its planner
    maps the saved shards onto them), then saved again when ``out`` is given."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    began = time.perf_counter()
    metadata = FileSystemReader(src).read_metadata()
    state: dict = {}
    for fqn, md in metadata.state_dict_metadata.items():
        part, name = fqn.split(".", 1)
        state.setdefault(part, {})[name] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(state, checkpoint_id=src, no_dist=True)
    loaded = time.perf_counter()
    if out:
        dcp.save(state, checkpoint_id=out, no_dist=True)
    print(json.dumps({"load": loaded - began, "save": time.perf_counter() - loaded}))


PEAK = "peak-rss-kib"


def child_run(argv: list[str]) -> None:
    """``python -m MODULE ARGS...`` in this process, then its peak resident memory (VmHWM, since
    this process began: the parent's pages a fork copied are not counted, as they would be in
    wait4's ru_maxrss) on stderr's last line."""
    import runpy
    sys.argv = argv
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    finally:
        status = Path("/proc/self/status").read_text()
        peak = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))
        print(f"{PEAK} {peak}", file=sys.stderr, flush=True)


def _run(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak resident MiB) of ``python -m`` cmd as a child process."""
    began = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "bench.reshard", "--child-run", *cmd], cwd=ROOT, env=_env(),
                         capture_output=True, text=True)
    wall = time.perf_counter() - began
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{res.stderr[-3000:]}")
    peak = next(line.split()[1] for line in reversed(res.stderr.splitlines()) if line.startswith(PEAK))
    return wall, int(peak) / 1024


def measure(method: str, src: Path, dcp_src: Path, work: Path) -> tuple[float, float]:
    out = work / f"out-{method}"
    shutil.rmtree(out, ignore_errors=True)
    if method == "ours":
        cmd = ["trainer.checkpoint.convert", "reshard", str(src), str(out), "--tensor", "1"]
    else:
        cmd = ["bench.reshard", "--child-dcp", str(dcp_src)] + (["--child-out", str(out)] if method == "dcp" else [])
    return _run(cmd)


def check_equal(src: Path, work: Path) -> None:
    """Our TP 1 tag, merged, against what DCP loaded and saved: the same tensors, bitwise."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    ours, _ = _full_state(str(work / "out-ours" / src.name))
    metadata = FileSystemReader(str(work / "out-dcp")).read_metadata()
    theirs: dict = {}
    for fqn, md in metadata.state_dict_metadata.items():
        part, name = fqn.split(".", 1)
        theirs.setdefault(part, {})[name] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(theirs, checkpoint_id=str(work / "out-dcp"), no_dist=True)
    for part in ours:
        assert ours[part].keys() == theirs[part].keys(), part
        for name, t in ours[part].items():
            assert torch.equal(t.to(theirs[part][name].dtype), theirs[part][name]), (part, name)
    print("[bench] checked: our TP 1 tag and DCP's resharded state hold the same tensors, bitwise", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--child-run"]:
        return child_run(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="100m", choices=sorted(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed after)")
    ap.add_argument("--child-dcp", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_dcp:
        return child_dcp(args.child_dcp, args.child_out)
    work = Path(args.dir or tempfile.mkdtemp(prefix="reshard-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        src = train_source(args.size, work)
        dcp_src = work / "dcp-source"
        shutil.rmtree(dcp_src, ignore_errors=True)
        dcp_source(src, dcp_src)
        sizes = {m: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20
                 for m, p in (("ours", src), ("dcp", dcp_src))}
        print(f"[bench] sources: ours {sizes['ours']:.0f} MiB, DCP {sizes['dcp']:.0f} MiB", flush=True)
        results: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
        for r in range(args.repeats):
            order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]  # taking turns going first
            for m in order:
                results[m].append(measure(m, src, dcp_src, work))
                print(f"[bench] round {r + 1}/{args.repeats} {m}: {results[m][-1][0]:.2f} s, "
                      f"peak {results[m][-1][1]:.0f} MiB", flush=True)
        check_equal(src, work)
        ours_s, ours_mib = median([w for w, _ in results["ours"]]), max(m for _, m in results["ours"])
        rows = []
        for m in METHODS:
            wall, mib = median([w for w, _ in results[m]]), max(x for _, x in results[m])
            rows.append([m, f"{wall:.2f}", f"{mib:.0f}", f"{ours_s / wall:.2f}", f"{ours_mib / mib:.2f}"])
        print(f"\nreshard TP 2 -> TP 1, {args.size} model + AdamW moments, median of {args.repeats} "
              f"(peak: the largest of the rounds)")
        print(table(["method", "wall s", "peak RSS MiB", "ours/this time", "ours/this memory"], rows))
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
