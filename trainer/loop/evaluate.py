"""Held-out perplexity of every complete checkpoint of a run, as a table (and a plot).

    python -m trainer.loop.evaluate --config run.yaml [--checkpoints URI] [--batches N]
                               [--plot perplexity.png] [--json out.json]

The run's ``data.heldOut`` is read exactly as the trainer reads it during training (the same
first ``data.evalBatches`` global batches, the same micro batches), so the figures equal the
in-training ones. One process on the CPU (or CUDA when present): each checkpoint's
tensor-parallel shards are merged, so any layout is evaluated. ``--plot`` needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from trainium_api import checkpoints

from ..model import hf
from ..config import ConfigError, load
from ..checkpoint.convert import read_tag
from ..data.packed import heldout_batches
from ..model.transformer import Transformer


def perplexity(model: torch.nn.Module, batches, micro: int, device: torch.device) -> tuple[float, float]:
    model.eval()
    losses = []
    with torch.no_grad():
        for inputs, targets in batches:
            chunks = max(1, inputs.shape[0] // micro)
            losses.append(sum(model(i.to(device), t.to(device)).float().item()
                              for i, t in zip(inputs.chunk(chunks), targets.chunk(chunks))) / chunks)
    loss = sum(losses) / len(losses)
    return loss, math.exp(min(loss, 80.0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.loop.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the run's config (its data.heldOut is evaluated)")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--checkpoints", help="checkpoint root (default: the config's checkpoint.uri)")
    ap.add_argument("--batches", type=int, help="held-out global batches (default: data.evalBatches)")
    ap.add_argument("--plot", help="write perplexity per checkpoint as an image (PNG; needs matplotlib)")
    ap.add_argument("--json", help="write the rows as JSON")
    args = ap.parse_args(argv)
    try:
        cfg = load(args.config, args.override)
        if not cfg.data.held_out:
            raise ConfigError("data.heldOut", "the config has no held-out data to evaluate on")
        root = args.checkpoints or cfg.checkpoint.uri
        tags = [t for t in checkpoints.list_tags(root) if t.complete and t.step is not None]
        if not tags:
            raise ConfigError("--checkpoints", f"no complete checkpoint under {root!r}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t = cfg.training
    batches = heldout_batches(cfg.data, t.seq_len, t.seed, cfg.model.vocab_size, t.global_batch_size,
                              args.batches or cfg.data.eval_batches)
    rows = []
    for tag in tags:
        started = time.perf_counter()
        meta, model_cfg, shards = read_tag(tag.uri)
        full = hf.shard_of(hf.merge_to_hf(shards, model_cfg), model_cfg, 1, 0)  # any TP degree -> one process
        model = Transformer(model_cfg, max_seq_len=cfg.training.seq_len)
        model.load_state_dict(full)
        loss, ppl = perplexity(model.to(device), batches, cfg.training.micro_batch_size, device)
        rows.append({"tag": tag.tag, "step": meta["step"], "tokens": meta.get("tokens", 0), "loss": loss,
                     "perplexity": ppl})
        print(f"  {tag.tag}: perplexity {ppl:.3f} ({time.perf_counter() - started:.1f}s)", file=sys.stderr, flush=True)
    print(f"Held-out perplexity per checkpoint ({len(batches)} batches of {cfg.training.global_batch_size} x "
          f"{cfg.training.seq_len} tokens)")
    print(f"| {'checkpoint':>12} | {'step':>8} | {'tokens':>14} | {'loss':>8} | {'perplexity':>10} |")
    print(f"|{'-' * 14}|{'-' * 10}|{'-' * 16}|{'-' * 10}|{'-' * 12}|")
    for r in rows:
        print(f"| {r['tag']:>12} | {r['step']:>8} | {r['tokens']:>14,} | {r['loss']:>8.4f} | {r['perplexity']:>10.3f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["tokens"] for r in rows], [r["perplexity"] for r in rows], marker="o")
        ax.set_xlabel("tokens trained")
        ax.set_ylabel("held-out perplexity")
        ax.set_title(f"{cfg.model.preset}: held-out perplexity per checkpoint")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
