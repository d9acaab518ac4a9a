"""Convert between Hugging Face model directories and our checkpoints, any tensor-parallel degree.

    python -m trainer.checkpoint.convert from-hf HF_DIR OUT_ROOT [--tensor N]
    python -m trainer.checkpoint.convert to-hf CHECKPOINT OUT_DIR [--tokenizer PATH]
    python -m trainer.checkpoint.convert reshard CHECKPOINT OUT_ROOT --tensor T [--pipeline P]

``from-hf`` writes ``OUT_ROOT/step_0``: a checkpoint tag of ours holding only the model, split
for tensor-parallel degree N, with the tokenizer; give it to a run as ``init.from`` (keep it out
of the run's own ``checkpoint.uri``). ``to-hf`` reads a complete tag (or the newest complete
tag under a checkpoint root), merges its tensor-parallel shards and writes ``model.safetensors``
(split with an index above 4 GiB), ``config.json``, the tokenizer the run read
(``tokenizer.json``, or SentencePiece's ``tokenizer.model``) and ``tokenizer_config.json``: ``transformers`` loads the directory as it is. Paths are local or
any fsspec URL (s3://).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time

import torch

from trainium_api import checkpoints

from . import ckpt_store
from .tags import _check_tensor, _fs, read_tag, resolve_tag
from ..data import tokenizer as tokenizer_files
from ..model import hf
from ..config import ConfigError, ModelConfig, to_dict

SHARD_BYTES = 4 << 30


def from_hf(hf_dir: str, out_root: str, tensor: int = 1) -> str:
    """Write OUT_ROOT/step_0 from a Hugging Face directory; returns the tag's URI."""
    model = ModelConfig(**hf.model_fields(hf.read_config(hf_dir)))
    model.validate()
    _check_tensor(model, tensor)
    src = hf.SafetensorsDir(hf_dir)
    fs, root = _fs(out_root)
    tag = f"{root}/{checkpoints.tag_for_step(0)}"
    fs.makedirs(f"{tag}/model", exist_ok=True)
    fs.pipe_file(f"{tag}/{checkpoints.BEGIN}", b"")
    files = []
    for rank in range(tensor):
        buf = io.BytesIO()
        torch.save(hf.read_shard(src, model, tensor, rank), buf)
        name = f"model/{ckpt_store.shard_name(0, rank)}"
        fs.pipe_file(f"{tag}/{name}", buf.getvalue())
        files.append(name)
        print(f"  wrote {name} (tensor-parallel rank {rank + 1}/{tensor})", flush=True)
    tokenizer = ""
    # the tokenizer the run will read (trainer.data.tokenizer): tokenizer.json, else SentencePiece's
    # tokenizer.model; its tokenizer_config.json travels with it (add_bos_token)
    try:
        found, data = tokenizer_files.find(hf_dir)
    except FileNotFoundError:
        found = None  # a model without a tokenizer: the run names its own
    if found is not None:
        name = found.rsplit("/", 1)[-1]
        carried = {name: data, tokenizer_files.CONFIG_NAME: tokenizer_files.config_beside(found)}
        for part, content in carried.items():
            if content is not None:
                fs.pipe_file(f"{tag}/{part}", content)
                files.append(part)
        tokenizer = fs.unstrip_protocol(f"{tag}/{name}") if "://" in out_root else f"{tag}/{name}"
    # The shape is complete without a preset name (none fits a converted model): leave it out.
    shape = {k: v for k, v in to_dict(model).items() if k != "preset"}
    meta = {"step": 0, "tokens": 0, "weightsOnly": True, "source": hf_dir, "model": shape,
            "tokenizer": tokenizer, "layout": {"tensor": tensor, "data": 1, "pipeline": 1, "zero1": False},
            "files": files + [checkpoints.META], "time": time.time()}
    fs.pipe_file(f"{tag}/{checkpoints.META}", json.dumps(meta, indent=1).encode())
    fs.pipe_file(f"{tag}/{checkpoints.DONE}", b"")
    return fs.unstrip_protocol(tag) if "://" in out_root else tag


def to_hf(checkpoint: str, out_dir: str, tokenizer: str | None = None) -> str:
    from safetensors.torch import save as save_safetensors

    tag_uri = resolve_tag(checkpoint)
    meta, model, shards = read_tag(tag_uri)
    tensors = hf.merge_to_hf(shards, model)
    fs, out = _fs(out_dir)
    fs.makedirs(out, exist_ok=True)
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    if len(groups) == 1:
        fs.pipe_file(f"{out}/{hf.SINGLE}", save_safetensors(groups[0], metadata={"format": "pt"}))
    else:
        weight_map = {}
        for i, group in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            fs.pipe_file(f"{out}/{file}", save_safetensors(group, metadata={"format": "pt"}))
            weight_map.update({name: file for name in group})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        fs.pipe_file(f"{out}/{hf.INDEX}", json.dumps({"metadata": {"total_size": total},
                                                      "weight_map": weight_map}, indent=1).encode())
    config = hf.hf_config(model)
    config["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    tok = tokenizer or meta.get("tokenizer")
    if tok:
        try:  # what the run read: a directory's (or init.from's tokenizer.json's) SentencePiece model too
            tok_path, data = tokenizer_files.find(tok)
        except FileNotFoundError as exc:
            flag = "--tokenizer" if tokenizer else "the checkpoint's tokenizer"
            raise ConfigError(flag, f"{exc}; pass --tokenizer with the file the run trained with") from None
        eos = meta.get("eosToken", "</s>")
        if tokenizer_files.is_sentencepiece(tok_path, data):  # transformers reads it as a LlamaTokenizer
            fs.pipe_file(f"{out}/{tokenizer_files.SENTENCEPIECE_NAME}", data)
            eos_id = tokenizer_files.SentencePieceTokenizer(data).token_to_id(eos)
            tok_config = tokenizer_files.config_beside(tok_path) or json.dumps(
                {"tokenizer_class": "LlamaTokenizer", "eos_token": eos, "add_bos_token": True,
                 "add_eos_token": False}, indent=1).encode()  # LlamaTokenizer's own defaults
            fs.pipe_file(f"{out}/{tokenizer_files.CONFIG_NAME}", tok_config)
            if eos_id is not None:
                config["eos_token_id"] = eos_id
        else:
            fs.pipe_file(f"{out}/{tokenizer_files.JSON_NAME}", data)
            fs.pipe_file(f"{out}/{tokenizer_files.CONFIG_NAME}", json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}, indent=1).encode())
            vocab = json.loads(data).get("model", {}).get("vocab", {})
            if isinstance(vocab, dict) and eos in vocab:
                config["eos_token_id"] = vocab[eos]
    else:
        print("  no tokenizer recorded in the checkpoint and none given (--tokenizer): writing the model only",
              file=sys.stderr)
    fs.pipe_file(f"{out}/{hf.CONFIG}", json.dumps(config, indent=1).encode())
    return tag_uri


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.checkpoint.convert", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("from-hf", help="Hugging Face directory -> OUT_ROOT/step_0 (for init.from)")
    a.add_argument("hf_dir")
    a.add_argument("out_root")
    a.add_argument("--tensor", type=int, default=1, help="tensor-parallel degree of the shards (default 1)")
    b = sub.add_parser("to-hf", help="checkpoint tag (or root: its newest complete tag) -> Hugging Face directory")
    b.add_argument("checkpoint")
    b.add_argument("out_dir")
    b.add_argument("--tokenizer", help="tokenizer.json or SentencePiece tokenizer.model to include (default: the one the run "
                   "trained with)")
    c = sub.add_parser("reshard", help="checkpoint tag (or root: its newest complete tag) -> OUT_ROOT/<tag> at "
                                       "other tensor and pipeline degrees (any data-parallel degree resumes from it)")
    c.add_argument("checkpoint")
    c.add_argument("out_root")
    c.add_argument("--tensor", type=int, required=True, help="the new tensor-parallel degree")
    c.add_argument("--pipeline", type=int, help="the new pipeline degree (default: the checkpoint's)")
    args = ap.parse_args(argv)
    try:
        started = time.perf_counter()
        if args.cmd == "reshard":
            from .reshard import reshard
            tag = reshard(args.checkpoint, args.out_root, args.tensor, args.pipeline)
            print(f"wrote {tag} ({time.perf_counter() - started:.1f}s); resume from it: checkpoint.uri: "
                  f"{args.out_root}")
        elif args.cmd == "from-hf":
            tag = from_hf(args.hf_dir, args.out_root, args.tensor)
            print(f"wrote {tag} ({time.perf_counter() - started:.1f}s); use it as init.from")
        else:
            tag = to_hf(args.checkpoint, args.out_dir, args.tokenizer)
            print(f"wrote {args.out_dir} from {tag} ({time.perf_counter() - started:.1f}s)")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
