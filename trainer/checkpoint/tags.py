"""Reading our checkpoint tags whole, for the offline tools (trainer.checkpoint.convert and
trainer.checkpoint.reshard): a tag's meta, model config and every tensor-parallel model shard."""

from __future__ import annotations

import io
import json

import fsspec
import torch

from trainium_api import checkpoints
from trainium_api.load import build

from . import ckpt_store
from .checkpointer import DIGESTS, Damaged, _check, _record
from .store_write import record_of
from ..config import ConfigError, ModelConfig


def _fs(uri: str):
    fs, path = fsspec.core.url_to_fs(uri.rstrip("/"))
    return fs, path.rstrip("/")


def _check_tensor(model: ModelConfig, tp: int) -> None:
    for name, value in (("numHeads", model.num_heads), ("intermediateSize", model.intermediate_size),
                        ("vocabSize", model.vocab_size)):
        if value % tp:
            raise ConfigError("--tensor", f"{tp} does not divide model.{name} ({value})")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ConfigError("--tensor", f"{tp} neither divides nor is a multiple of model.numKvHeads "
                                      f"({model.num_kv_heads})")


def resolve_tag(uri: str) -> str:
    """A complete tag: the URI itself, or the newest complete tag under a checkpoint root. A tag
    a restore marked damaged is refused (its files would be carried into what is made from it)."""
    fs, path = _fs(uri)
    if fs.exists(f"{path}/{checkpoints.DONE}"):
        if fs.exists(f"{path}/{checkpoints.DAMAGED}"):
            raise ConfigError("CHECKPOINT", f"{uri} is marked damaged ({checkpoints.DAMAGED}: "
                                            f"{fs.cat_file(f'{path}/{checkpoints.DAMAGED}')[:300]!r}); use an "
                                            f"older tag or the root (its newest complete tag)")
        return uri.rstrip("/")
    newest = checkpoints.newest_complete(uri)
    if newest is None:
        raise ConfigError("CHECKPOINT", f"{uri} is neither a complete checkpoint tag nor a root holding one")
    return newest.uri


def read_tag(tag_uri: str) -> tuple[dict, ModelConfig, list[dict[str, torch.Tensor]]]:
    """meta.json, the model config and every tensor-parallel model shard of a complete tag."""
    fs, tag = _fs(tag_uri)
    meta = json.loads(fs.cat_file(f"{tag}/{checkpoints.META}"))
    if not meta.get("model"):
        raise ConfigError("CHECKPOINT", f"{tag_uri}/meta.json has no model config (written before this "
                                        "release); re-save it with a current trainer")
    # A checkpoint records the complete shape; its preset is only a label (from-hf wrote
    # "from-hf" before this release, which is no preset), so it is not read.
    model = build(ModelConfig, {k: v for k, v in meta["model"].items() if k != "preset"}, "model")
    shards = []
    for rank in range(meta["layout"]["tensor"]):
        shard: dict = {}  # every pipeline stage's part of this tensor-parallel rank
        for stage in range(meta["layout"].get("pipeline", 1)):
            shard.update(load_checked(fs, tag, f"model/{ckpt_store.shard_name(0, rank, stage)}", meta))
        shards.append(shard)
    return meta, model, shards


def load_checked(fs, tag: str, name: str, meta: dict):
    """One file of a tag, loaded after its bytes matched meta.json's record of it (a tag written
    before records: trusted); a file that does not match is refused by name."""
    return torch.load(io.BytesIO(read_checked(fs, tag, name, meta)), map_location="cpu", weights_only=False)


def read_checked(fs, tag: str, name: str, meta: dict) -> bytes:
    """One file's bytes, read once and checked against meta.json's record (load_checked), as a
    restore checks them (trainer.checkpoint.checkpointer)."""
    data = fs.cat_file(f"{tag}/{name}")
    records = meta.get(DIGESTS)
    if isinstance(records, dict):
        try:
            _check(name, _record(records, name), record_of(data))
        except Damaged as exc:
            raise ConfigError("CHECKPOINT", f"{tag} is damaged: {exc}") from None
    return data
