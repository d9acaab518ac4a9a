"""Tokenize raw text once: ``python -m trainer.data.prepare --source RAW --tokenizer T --out DIR``.

Each raw shard (any format of trainer.data.formats: JSON lines, plain or gzip or zstd
compressed, Parquet, Arrow, a datasets.save_to_disk folder; local or s3://) becomes one Megatron ``.bin``/``.idx``
pair under DIR (trainer.data.indexed), in the raw shards' sorted order, every document followed by
the end token, exactly the tokens the trainer's raw-text reader would make. ``prepared.json``
is written last, once every shard is complete: a training run pointed at DIR (as a
``data.sources`` URI) reads token ranges with no tokenizer in the loop.

Reruns resume: a shard whose index and tokens are already complete is skipped, so a Job whose
pod was restarted goes on where it stopped. Several pods share the work as an Indexed Job:
``--parts N`` with the pod's ``JOB_COMPLETION_INDEX`` (examples/prepare-job.yaml); the pod
that finishes the last shard writes the manifest. A DIR that holds shards made with another
tokenizer, end token, text field or source is refused rather than mixed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import fsspec
import numpy as np

from ..config import ConfigError, DataConfig
from ..contract.podenv import PodEnv
from .formats import ShardError
from .packed import TOKENIZE_CHUNK, list_shards, read_texts
from .indexed import IndexFormatError, decode_index, encode_index, token_dtype
from .prepared import MANIFEST, PARAMS, Manifest, PreparedShard
from .tokenizer import read_tokenizer


def shard_name(k: int) -> str:
    return f"part-{k:05d}"


def tokenize(texts: list[str], tokenizer, eos_id: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(tokens of every document with its end token, back to back; each document's length)."""
    chunks, lengths = [], []
    for start in range(0, len(texts), TOKENIZE_CHUNK):
        for enc in tokenizer.encode_batch(texts[start:start + TOKENIZE_CHUNK]):
            chunks.append(np.asarray(enc.ids + [eos_id], dtype=dtype))
            lengths.append(len(enc.ids) + 1)
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    return tokens, np.asarray(lengths, dtype=np.int64)


class Preparer:
    def __init__(self, source: str, tokenizer: str, out: str, eos_token: str, text_field: str):
        self.source, self.out, self.text_field = source, out.rstrip("/"), text_field
        try:
            self.tokenizer, self.digest = read_tokenizer(tokenizer, eos_token)
        except ConfigError as exc:  # named as this command's flags, not a run's fields
            flag = {"data.tokenizer": "--tokenizer", "data.eosToken": "--eos-token"}.get(exc.field, exc.field)
            raise ConfigError(flag, exc.message) from None
        self.tokenizer_uri, self.eos_token = tokenizer, eos_token
        self.eos_id = self.tokenizer.token_to_id(eos_token)
        self.dtype = token_dtype(self.tokenizer.get_vocab_size())
        self.fs, self.root = fsspec.core.url_to_fs(self.out)
        _, raw_root = fsspec.core.url_to_fs(source)
        raw_root = re.split(r"[*?\[]", raw_root)[0].rstrip("/")
        if self.root == raw_root or self.root.startswith(raw_root + "/"):
            raise ConfigError("--out", f"{out} is inside --source {source}: its files would be read as raw shards. "
                              f"Prepare into a directory of its own")
        self.shards = list_shards(source, "--source")
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def _write(self, name: str, data: bytes) -> None:
        """Whole or not at all: an object store's PUT is; a local file is written aside and renamed."""
        path = self._path(name)
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def claim_directory(self) -> None:
        """Write (or check) what this directory's shards are made with."""
        params = {"source": self.source, "shards": self.shards, "tokenizerSha256": self.digest,
                  "eosToken": self.eos_token, "textField": self.text_field, "dtype": np.dtype(self.dtype).name}
        self.fs.makedirs(self.root, exist_ok=True)
        path = self._path(PARAMS)
        if self.fs.exists(path):
            try:
                before = json.loads(self.fs.cat_file(path))
            except ValueError:
                before = {}
            changed = sorted(k for k in params if not isinstance(before, dict) or before.get(k) != params[k])
            if changed:
                raise ConfigError("--out", f"{self.out} holds shards prepared with another {', '.join(changed)}; "
                                  f"prepare into a new directory (or delete this one)")
            return
        self._write(PARAMS, json.dumps(params, indent=1).encode())

    def complete(self, k: int) -> PreparedShard | None:
        """Shard k's counts if its index and tokens are both complete, else None."""
        name = shard_name(k)
        try:
            index = decode_index(self.fs.cat_file(self._path(name + ".idx")), name + ".idx")
            size = self.fs.size(self._path(name + ".bin"))
        except (FileNotFoundError, IndexFormatError):
            return None
        if index.dtype != self.dtype or size != index.tokens * index.itemsize:
            return None
        return PreparedShard(name, index.documents, index.tokens, self.shards[k])

    def prepare_shard(self, k: int) -> PreparedShard:
        try:
            texts = read_texts(self.shards[k], self.text_field)
        except ShardError as exc:  # named, not retried: rerun once the shard is mended or moved out
            raise ConfigError("--source", f"a shard does not parse: {exc}") from None
        tokens, lengths = tokenize(texts, self.tokenizer, self.eos_id, self.dtype)
        name = shard_name(k)
        # tokens first, index second: an index is only ever next to complete tokens
        self._write(name + ".bin", tokens.astype(np.dtype(self.dtype).newbyteorder("<")).tobytes())
        self._write(name + ".idx", encode_index(lengths, self.dtype))
        return PreparedShard(name, len(lengths), int(lengths.sum()), self.shards[k])

    def finish(self) -> int:
        """Write the manifest if every shard is complete (whichever part finishes last);
        returns how many shards are still missing."""
        done = [self.complete(k) for k in range(len(self.shards))]
        missing = sum(d is None for d in done)
        if missing:
            return missing
        manifest = Manifest(tokenizer_sha256=self.digest, eos_token=self.eos_token, eos_id=self.eos_id,
                            dtype=np.dtype(self.dtype).name, shards=done, tokenizer=self.tokenizer_uri,
                            text_field=self.text_field)
        self._write(MANIFEST, manifest.to_json().encode())
        return 0


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}P"


def main(argv: list[str] | None = None) -> int:
    defaults = DataConfig()
    ap = argparse.ArgumentParser(prog="python -m trainer.data.prepare", description=__doc__.split("\n")[0])
    ap.add_argument("--source", required=True, help="raw shards: a file, a directory or a glob; local or s3://")
    ap.add_argument("--tokenizer", required=True, help="the Hugging Face tokenizers JSON the run will train with")
    ap.add_argument("--out", required=True, help="directory for the token shards and prepared.json (local or s3://)")
    ap.add_argument("--eos-token", default=defaults.eos_token, help="appended after every document (data.eosToken)")
    ap.add_argument("--text-field", default=defaults.text_field, help="the text column (data.textField)")
    ap.add_argument("--parts", type=int, default=1, help="pods sharing the work (an Indexed Job's completions)")
    ap.add_argument("--index", type=int, default=PodEnv.from_environ().job_completion_index,
                    help="this pod's part, 0..parts-1 (default: $JOB_COMPLETION_INDEX, else 0)")
    args = ap.parse_args(argv)
    try:
        if args.parts < 1 or not 0 <= args.index < args.parts:
            raise ConfigError("--index", f"{args.index} is not a part of 0..{args.parts - 1}")
        prep = Preparer(args.source, args.tokenizer, args.out, args.eos_token, args.text_field)
        prep.claim_directory()
        mine = [k for k in range(len(prep.shards)) if k % args.parts == args.index]
        print(f"prepare: {len(prep.shards)} shards from {args.source} -> {args.out} "
              f"({np.dtype(prep.dtype).name} tokens); this part ({args.index} of {args.parts}): {len(mine)}",
              flush=True)
        began, tokens_done = time.monotonic(), 0
        for n, k in enumerate(mine, 1):
            started = time.monotonic()
            shard = prep.complete(k)
            verb = "already prepared"
            if shard is None:
                shard, verb = prep.prepare_shard(k), "tokenized"
            tokens_done += shard.tokens
            elapsed = time.monotonic() - began
            eta = elapsed / n * (len(mine) - n)
            print(f"  [{n}/{len(mine)}] {shard.name} {verb}: {shard.documents} documents, {_human(shard.tokens)} "
                  f"tokens in {time.monotonic() - started:.1f} s ({_human(tokens_done / max(elapsed, 1e-9))} "
                  f"tokens/s overall, about {eta:.0f} s left)  <- {prep.shards[k]}", flush=True)
        missing = prep.finish()
        if not missing:
            print(f"prepare: complete; {prep.out}/{MANIFEST} written. Use {prep.out} as a data.sources URI.",
                  flush=True)
        else:
            print(f"prepare: this part is done; {missing} of {len(prep.shards)} shards are still missing (other "
                  f"parts: --parts {args.parts}); the part that completes the last one writes the manifest",
                  flush=True)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
