"""A checkpoint re-cut for other tensor and pipeline degrees:

    python -m trainer.checkpoint.convert reshard CHECKPOINT OUT_ROOT --tensor T [--pipeline P]

The model and the optimizer's moments are merged into whole tensors through the one parameter
table the Hugging Face conversion uses (trainer.model.hf ``merge_to_hf``/``shard_of``: q/k/v
and gate/up in NxD's stride layout, replicated key/value heads, norms) and cut again for the
new degrees: a moment has its parameter's shape and layout, so it travels by the same rules.
Exact: the same weights and moments, in fp32 as saved. The optimizer is written without ZeRO-1
slices (one per tensor and pipeline rank), which a run at any data-parallel degree cuts its own
slice from on load (model.optim.ShardedAdamW); the data position, step, scheduler and RNG states
are copied (the stochastic-rounding generator, bf16-sr only, is the first rank's for every new
rank). The new tag goes under OUT_ROOT (a new root): point the run's ``checkpoint.uri`` there.
Every file read is checked against the tag's records; a tag marked damaged is refused.

One process reads the whole model and its moments (at its peak about 2.4 times the state in
memory, measured at 134M by bench/reshard.py, where DCP's planner needs 1 time): a tool for a layout change
between runs, not a step of every restart. A rerun after an interrupted reshard of the same tag
(no ``done``; its ``resharding`` marker names the source) starts that tag over; a complete tag,
or one without the marker (a run's save in progress), is never touched.
"""

from __future__ import annotations

import json
import time

import torch

from trainium_api import checkpoints

from . import ckpt_store, store_write
from ..config import ConfigError, ModelConfig
from ..model import hf
from ..model.transformer import stage_layers
from .checkpointer import DIGESTS, tag_files
from .tags import _check_tensor, _fs, load_checked, read_checked, read_tag, resolve_tag


RESHARDING = "resharding"  # in a tag a reshard is writing, naming its source; removed before done


def _stage_of(name: str, cfg: ModelConfig, pipeline: int) -> int:
    """The pipeline stage holding parameter ``name`` (transformer.Decoder's split)."""
    if name.startswith("model.embed_tokens."):
        return 0
    if name.startswith("model.layers."):
        layer = int(name.split(".")[2])
        return next(p for p in range(pipeline) if layer in stage_layers(cfg.num_layers, (p, pipeline)))
    return pipeline - 1  # the final norm and the head


def _unflatten(flat: torch.Tensor, names: list[str], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name in names:
        n = shapes[name].numel()
        out[name] = flat[offset:offset + n].view(shapes[name])
        offset += n
    return out


def _old_rank(fs, tag: str, meta: dict, tp: int, model_shard: dict) -> tuple[list[str], dict, dict, dict]:
    """One old tensor-parallel rank over every pipeline stage: its parameter names in the
    optimizer's order, its two moments by name (ZeRO-1 slices laid end to end), and the first
    slice's step and generator (the moments' own copies are not kept)."""
    layout = meta["layout"]
    names, avg, sq, first = [], {}, {}, None
    for pp in range(layout.get("pipeline", 1)):
        slices = [load_checked(fs, tag, f"optim/{ckpt_store.shard_name(d, tp, pp)}", meta)
                  for d in (range(layout["data"]) if layout.get("zero1") else [0])]
        stage_names = slices[0]["param_names"]
        shapes = {n: model_shard[n].shape for n in stage_names}
        numel = sum(s.numel() for s in shapes.values())
        for key, into in (("exp_avg", avg), ("exp_avg_sq", sq)):
            into.update(_unflatten(torch.cat([s[key].float() for s in slices])[:numel], stage_names, shapes))
        names += stage_names
        first = first or {k: slices[0][k] for k in ("step", "generator")}
        del slices
    for moments in (avg, sq):  # a tied head is the embedding's parameter: its moments too
        if "lm_head.weight" in model_shard and "lm_head.weight" not in moments:
            moments["lm_head.weight"] = moments["model.embed_tokens.weight"]
    return names, avg, sq, first


def reshard(checkpoint: str, out_root: str, tensor: int, pipeline: int | None = None) -> str:
    """Write OUT_ROOT/<the tag's name> at ``tensor`` x ``pipeline`` (None: the tag's own);
    returns the new tag's URI."""
    for flag, degree in (("--tensor", tensor), ("--pipeline", pipeline)):
        if degree is not None and degree < 1:
            raise ConfigError(flag, f"must be at least 1, got {degree}")
    tag_uri = resolve_tag(checkpoint)
    meta, cfg, model_shards = read_tag(tag_uri)
    pipeline = pipeline or meta["layout"].get("pipeline", 1)
    if meta.get("weightsOnly"):
        raise ConfigError("CHECKPOINT", f"{tag_uri} holds weights only (from-hf): convert from-hf again with "
                                        f"--tensor {tensor}")
    _check_tensor(cfg, tensor)
    if cfg.num_layers % pipeline:
        raise ConfigError("--pipeline", f"{pipeline} does not divide model.numLayers ({cfg.num_layers})")
    if cfg.tie_embeddings and pipeline > 1:
        raise ConfigError("--pipeline", "a tied embedding and head live on one stage (model.tieEmbeddings)")
    src_fs, src = _fs(tag_uri)
    fs, root = _fs(out_root)
    name = src.rsplit("/", 1)[-1]
    if root.rstrip("/") == src.rsplit("/", 1)[0]:
        raise ConfigError("OUT_ROOT", f"{out_root} is the checkpoint's own root: write the resharded tag under "
                                      f"another (its step would replace {name})")
    layout = meta["layout"]
    print(f"reshard {tag_uri}: tensor={layout['tensor']} pipeline={layout.get('pipeline', 1)} -> "
          f"tensor={tensor} pipeline={pipeline}", flush=True)
    tag = f"{root}/{name}"
    if fs.exists(f"{tag}/{checkpoints.DONE}"):
        raise ConfigError("OUT_ROOT", f"{out_root}/{name} exists: write the resharded tag under a new root")
    if fs.exists(tag):
        # a reshard of this tag interrupted (a drain, out of memory) is started over; anything
        # else without done (a run's save in progress, another writer's) is not ours to delete
        try:
            ours = fs.cat_file(f"{tag}/{RESHARDING}").decode(errors="replace") == tag_uri
        except FileNotFoundError:
            ours = False
        if not ours:
            raise ConfigError("OUT_ROOT", f"{out_root}/{name} exists without {checkpoints.DONE} and is not an "
                                          f"unfinished reshard of {tag_uri} (a save in progress, another writer's): "
                                          f"write the resharded tag under a new root")
        print(f"  {out_root}/{name} is an unfinished reshard (no {checkpoints.DONE}): removing it", flush=True)
        fs.rm(tag, recursive=True)
    olds = [_old_rank(src_fs, src, meta, r, shard) for r, shard in enumerate(model_shards)]
    order, first_state = olds[0][0], olds[0][3]  # every parameter in model order: the optimizer's
    dtypes = {k: v.dtype for k, v in model_shards[0].items()}  # as saved: bf16 weights stay bf16
    whole = {"model": hf.merge_to_hf(model_shards, cfg),
             "exp_avg": hf.merge_to_hf([o[1] for o in olds], cfg),
             "exp_avg_sq": hf.merge_to_hf([o[2] for o in olds], cfg)}
    del model_shards, olds  # merged: the old shards' memory goes
    fs.makedirs(f"{tag}/model", exist_ok=True)
    fs.makedirs(f"{tag}/optim", exist_ok=True)
    store_write.write_bytes(fs, f"{tag}/{RESHARDING}", tag_uri.encode())
    store_write.write_bytes(fs, f"{tag}/{checkpoints.BEGIN}", b"")
    records: dict = {}
    for r in range(tensor):
        ours = {k: hf.shard_of(v, cfg, tensor, r) for k, v in whole.items()}
        for p in range(pipeline):
            keys = [n for n in ours["model"] if _stage_of(n, cfg, pipeline) == p]
            names = [n for n in order if _stage_of(n, cfg, pipeline) == p]
            model_path = f"model/{ckpt_store.shard_name(0, r, p)}"
            records[model_path] = store_write.save_torch(fs, f"{tag}/{model_path}", {
                k: ours["model"][k].to(dtypes[k]) for k in keys})
            flat = {k: torch.cat([ours[k][n].reshape(-1) for n in names]) for k in ("exp_avg", "exp_avg_sq")}
            total = flat["exp_avg"].numel()
            optim = {"step": first_state["step"], **flat, "generator": first_state["generator"],
                     "shard": [0, total, total], "param_names": names, "zero1": False}
            optim_path = f"optim/{ckpt_store.shard_name(0, r, p)}"
            records[optim_path] = store_write.save_torch(fs, f"{tag}/{optim_path}", optim)
            print(f"  wrote tensor rank {r + 1}/{tensor}, stage {p + 1}/{pipeline}", flush=True)
    for small in ("scheduler.pt", "user_content.pt"):
        data = read_checked(src_fs, src, small, meta)  # checked against its record before it is carried
        store_write.write_bytes(fs, f"{tag}/{small}", data)
        records[small] = store_write.record_of(data)
    new_layout = {"tensor": tensor, "pipeline": pipeline, "data": 1, "zero1": False}
    # not the old gang's: no writer (a fence in OUT_ROOT would take this tag for a late one and
    # retention would delete it), no save id (no memory copy is of it), its own files and time
    new_meta = {k: v for k, v in meta.items() if k not in ("saveId", "writer", DIGESTS)}
    now = time.time()
    new_meta.update(layout=new_layout, files=tag_files(new_layout), time=now,
                    reshardedFrom={"tag": tag_uri, "layout": layout, "time": now})
    new_meta[DIGESTS] = records
    store_write.write_bytes(fs, f"{tag}/{checkpoints.META}", json.dumps(new_meta, indent=1).encode())
    fs.rm(f"{tag}/{RESHARDING}")
    store_write.write_bytes(fs, f"{tag}/{checkpoints.DONE}", b"")
    return fs.unstrip_protocol(tag) if "://" in out_root else tag
