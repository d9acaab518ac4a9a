"""Prepared (pre-tokenized) sources: a directory that ``python -m trainer.prepare`` wrote.

A prepared directory holds one Megatron ``.bin``/``.idx`` pair per raw shard
(trainer.indexed) and ``prepared.json``, written last, so its presence means every shard is
complete. The manifest says which tokenizer (by content digest) and end-of-document token made
the tokens, and each shard's document and token counts, in the raw shards' order.

Rows are found by arithmetic, not by reading: a source's stream is its shards in the per-epoch
order (the same seeded order raw text uses), each document followed by its end token. With
packing, the source's row j is tokens [j*n, (j+1)*n) of that endless stream (n = seqLen + 1);
without, it is document j, truncated to n. So a source's position is one number (rows handed
out) and a rank reads only the byte ranges of its own rows: the manifest's token counts locate
packed rows with no index read at all; unpacked rows read the index of the shards they touch.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import fsspec
import numpy as np

from .config import ConfigError
from .indexed import IndexFormatError, ShardIndex, decode_index, decode_tokens

MANIFEST = "prepared.json"
PARAMS = "prepare-params.json"  # written first by trainer.prepare: a directory being prepared
SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}")
FORMAT = "megatron-indexed"
FORMAT_VERSION = 1


def tokenizer_digest(text: str) -> str:
    """What identifies a tokenizer: the sha256 of its JSON, so a renamed copy still matches."""
    return hashlib.sha256(text.encode()).hexdigest()


def shard_order(seed: int, source_index: int, epoch: int, shards: int, shuffle: bool) -> list[int]:
    """Shard order of one epoch of one source, from the seed alone (raw and prepared alike)."""
    import random

    order = list(range(shards))
    if shuffle:
        random.Random(seed * 1_000_003 + source_index * 7919 + epoch).shuffle(order)
    return order


@dataclass
class PreparedShard:
    name: str  # the .bin/.idx pair's common prefix, relative to the directory
    documents: int
    tokens: int
    source: str = ""  # the raw shard it was made from


@dataclass
class Manifest:
    tokenizer_sha256: str
    eos_token: str
    eos_id: int
    dtype: str  # numpy name of the token dtype: uint16 or int32
    shards: list[PreparedShard] = field(default_factory=list)
    tokenizer: str = ""  # where the tokenizer was read from, for people
    text_field: str = "text"
    format: str = FORMAT
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str, field_path: str) -> "Manifest":
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT or raw.get("version") != FORMAT_VERSION:
                raise ValueError(f"format {raw.get('format')!r} version {raw.get('version')!r}, "
                                 f"expected {FORMAT!r} version {FORMAT_VERSION}")
            shards = [PreparedShard(**s) for s in raw.pop("shards")]
            manifest = cls(shards=shards, **raw)
            if manifest.dtype not in ("uint16", "int32"):
                raise ValueError(f"token dtype {manifest.dtype!r}")
            if any(s.documents < 0 or s.tokens < 0 for s in shards):
                raise ValueError("negative counts")
            bad = [s.name for s in shards if not isinstance(s.name, str) or not SHARD_NAME.fullmatch(s.name)]
            if bad:  # names are paths under the directory: never another directory's files
                raise ValueError(f"shard names {bad[:3]} are not plain file names")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ConfigError(field_path, f"{where} is not a manifest this trainer can read: {exc}") from None
        return manifest


def manifest_uri(root: str) -> str:
    return root.rstrip("/") + "/" + MANIFEST


def is_prepared(uri: str) -> bool:
    """Whether a data source URI names a prepared directory (its manifest exists)."""
    if any(c in uri for c in "*?["):
        return False
    fs, path = fsspec.core.url_to_fs(manifest_uri(uri))
    try:
        return fs.isfile(path)
    except (OSError, PermissionError):
        return False


def is_being_prepared(uri: str) -> bool:
    """A directory trainer.prepare began but has not finished (no manifest yet)."""
    fs, path = fsspec.core.url_to_fs(uri.rstrip("/") + "/" + PARAMS)
    try:
        return fs.isfile(path)
    except (OSError, PermissionError):
        return False


class PreparedSource:
    """One prepared source: rows by arithmetic, bytes by ranged reads of this rank's rows only."""

    random_access = True

    def __init__(self, index: int, uri: str, *, seed: int, shuffle: bool, tokenizer_sha256: str, eos_token: str,
                 tokenizer_uri: str):
        self.index, self.seed, self.shuffle = index, seed, shuffle
        self.field_path = f"data.sources[{index}].uri"
        self.fs, self.root = fsspec.core.url_to_fs(uri.rstrip("/"))
        where = manifest_uri(uri)
        try:
            text = self.fs.cat_file(manifest_uri(self.root)).decode()
        except (OSError, PermissionError) as exc:
            raise ConfigError(self.field_path, f"cannot read {where}: {exc}") from None
        self.manifest = m = Manifest.from_json(text, where, self.field_path)
        if m.tokenizer_sha256 != tokenizer_sha256:
            raise ConfigError("data.tokenizer", f"{uri} was prepared with another tokenizer ({m.tokenizer or '?'}, "
                              f"sha256 {m.tokenizer_sha256[:12]}) than {tokenizer_uri} (sha256 "
                              f"{tokenizer_sha256[:12]}): its token ids would mean other words. Prepare it again "
                              f"with this tokenizer, or train with that one")
        if m.eos_token != eos_token:
            raise ConfigError("data.eosToken", f"{uri} was prepared with end token {m.eos_token!r}, the config "
                              f"says {eos_token!r}")
        self.dtype = np.dtype(m.dtype)
        self.tokens_per_epoch = sum(s.tokens for s in m.shards)
        self.docs_per_epoch = sum(s.documents for s in m.shards)
        if not self.tokens_per_epoch:
            raise ConfigError(self.field_path, f"{uri} holds no tokens ({len(m.shards)} shards)")
        self.rows = 0  # rows handed out so far: the whole position
        self.requests = 0  # ranged reads made, for the data benchmark
        self.bytes_read = 0

    # -- position ---------------------------------------------------------------------------------

    def claim(self) -> int:
        """The next row's number (every rank claims every row, reading only its own)."""
        self.rows += 1
        return self.rows - 1

    def state(self) -> dict:
        return {"rows": self.rows}

    def load_state(self, state: dict) -> None:
        if set(state) != {"rows"}:
            raise ConfigError(self.field_path, "the checkpoint's position for this source is a raw-text position; "
                              "this source is now prepared shards. Resume with the raw source, or set "
                              "data.allowChangedSources: true to start this source from its beginning")
        self.rows = int(state["rows"])

    # -- where a row lies -------------------------------------------------------------------------

    @lru_cache(maxsize=4)
    def _epoch(self, epoch: int) -> tuple[list[int], list[int], list[int]]:
        """(shard order, cumulative tokens, cumulative documents) of one epoch."""
        order = shard_order(self.seed, self.index, epoch, len(self.manifest.shards), self.shuffle)
        tok, doc, t, d = [0], [0], 0, 0
        for k in order:
            t += self.manifest.shards[k].tokens
            d += self.manifest.shards[k].documents
            tok.append(t)
            doc.append(d)
        return order, tok, doc

    @lru_cache(maxsize=8)
    def _index(self, shard: int) -> ShardIndex:
        name = self.manifest.shards[shard].name
        path = f"{self.root}/{name}.idx"
        try:
            data = self.fs.cat_file(path)
        except (OSError, PermissionError) as exc:
            raise ConfigError(self.field_path, f"cannot read {name}.idx: {exc}") from None
        self.requests += 1
        self.bytes_read += len(data)
        try:
            index = decode_index(data, path)
        except IndexFormatError as exc:
            raise ConfigError(self.field_path, str(exc)) from None
        if index.documents != self.manifest.shards[shard].documents:
            raise ConfigError(self.field_path, f"{name}.idx has {index.documents} documents, the manifest says "
                              f"{self.manifest.shards[shard].documents}")
        return index

    def _packed_ranges(self, row: int, n: int) -> list[tuple[int, int, int]]:
        """(shard, first token, end token) pieces of packed row ``row``: n tokens of the stream."""
        offset, out = row * n, []
        while n:
            epoch, within = divmod(offset, self.tokens_per_epoch)
            order, cum, _ = self._epoch(epoch)
            pos = bisect.bisect_right(cum, within) - 1  # cum[pos] <= within < cum[pos + 1]
            start = within - cum[pos]
            take = min(n, cum[pos + 1] - within)
            out.append((order[pos], start, start + take))
            offset, n = offset + take, n - take
        return out

    def _document_range(self, row: int, n: int) -> tuple[int, int, int]:
        """Document ``row`` of the stream, truncated to n tokens."""
        epoch, within = divmod(row, self.docs_per_epoch)
        order, _, cum = self._epoch(epoch)
        pos = bisect.bisect_right(cum, within) - 1
        shard = order[pos]
        index = self._index(shard)
        doc = within - cum[pos]
        first = int(index.starts[doc])
        return shard, first, first + min(n, int(index.lengths[doc]))

    def read(self, rows: list[int], n: int, packing: bool) -> list[np.ndarray]:
        """The tokens of these rows: neighbouring pieces of one shard are read in one ranged
        GET, and every GET of the batch is issued together (s3fs runs them concurrently)."""
        if not packing and not self.docs_per_epoch:
            raise ConfigError(self.field_path, "holds no documents")
        pieces = [self._packed_ranges(r, n) if packing else [self._document_range(r, n)] for r in rows]
        spans: dict[int, list[list[int]]] = {}
        for shard, lo, hi in sorted({p for row in pieces for p in row}):
            runs = spans.setdefault(shard, [])
            # a gap of up to one row is read through: unpacked rows are truncated documents,
            # and one GET for neighbours costs less than a request each
            if runs and lo <= runs[-1][1] + n:
                runs[-1][1] = max(runs[-1][1], hi)
            else:
                runs.append([lo, hi])
        size = self.dtype.itemsize
        reads = [(shard, lo, hi) for shard, runs in spans.items() for lo, hi in runs]
        paths = [f"{self.root}/{self.manifest.shards[s].name}.bin" for s, _, _ in reads]
        try:
            blobs = self.fs.cat_ranges(paths, [lo * size for _, lo, _ in reads], [hi * size for _, _, hi in reads],
                                       on_error="raise")
        except (OSError, PermissionError) as exc:
            raise ConfigError(self.field_path, f"cannot read token shards under {self.root}: {exc}") from None
        self.requests += len(reads)
        self.bytes_read += sum(len(b) for b in blobs)
        starts: dict[int, list[int]] = {}
        tokens: dict[tuple[int, int], np.ndarray] = {}
        for (shard, lo, hi), blob in zip(reads, blobs):
            if len(blob) != (hi - lo) * size:
                raise ConfigError(self.field_path, f"{self.manifest.shards[shard].name}.bin is shorter than its "
                                  f"index says (a torn or replaced shard): prepare the source again")
            starts.setdefault(shard, []).append(lo)  # reads are in ascending order per shard
            tokens[shard, lo] = decode_tokens(blob, self.dtype)
        out = []
        for row in pieces:
            parts = []
            for shard, lo, hi in row:
                run = starts[shard][bisect.bisect_right(starts[shard], lo) - 1]
                parts.append(tokens[shard, run][lo - run:hi - run])
            out.append(np.concatenate(parts) if len(parts) > 1 else parts[0])
        return out
