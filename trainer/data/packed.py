"""Data sources -> packed, mixed rows, with a position that resumes exactly.

The global stream of rows is the same on every rank and for every parallel layout: row n is
drawn from a source chosen by a counter-based hash of (seed, n) with the configured weights,
and a global batch is the next ``globalBatchSize`` rows. A data-parallel rank keeps its
contiguous slice of each global batch. So a single process sees the same global batches as
any TP x DP run, and a run resumed on another number of nodes sees the same data.

Two kinds of source:

- **prepared** (a directory ``python -m trainer.data.prepare`` wrote; trainer.data.prepared): token shards
  found by arithmetic. Every rank advances every source's row counter for the whole batch (no
  I/O) but reads only the byte ranges of its own rows; no tokenizer runs. For real runs.
- **raw text**: shards of any format of trainer.data.formats (JSON lines, one {"text": ...}
  object a line, plain, gzip or zstd compressed; Parquet; Arrow IPC file or stream, so a
  datasets.save_to_disk folder) under a directory, a glob or one path. Documents must be tokenized in order
  to know where rows begin, so every rank reads and tokenizes the whole stream and keeps its
  rows. For small runs and tests.

Both read through fsspec (local, s3://), and both give the same rows for the same corpus and
tokenizer. The position (the row counter plus each source's position: a token offset, or a
document number, for a prepared source; epoch/file/document/offset for raw text) is a small
dict saved in every checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, replace

import fsspec
import torch

from ..store import node_reads
from . import formats
from .tokenizer import read_tokenizer
from ..config import ConfigError, DataConfig
from .prepared import MANIFEST, PARAMS, PreparedSource, is_being_prepared, is_prepared, shard_order
from ..store.errors import retry

TOKENIZE_CHUNK = 256  # documents per encode_batch call


def _find(fs, path: str) -> list[str]:
    """Every file a source URI names (a glob's files, a directory's tree, or one file), [] when none."""
    if any(c in path for c in "*?["):
        return [p for p, info in fs.glob(path, detail=True).items() if info.get("type") != "directory"]
    if fs.isdir(path):
        return fs.find(path)
    return [path] if fs.exists(path) else []


def _folder(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _listing_root(path: str) -> str:
    """The folder a listing's paths are relative to: a glob's folder before its first wildcard,
    else the path itself (a folder; a single file's own name is then its whole relative path)."""
    if any(c in path for c in "*?["):
        return _folder(re.split(r"[*?\[]", path, maxsplit=1)[0])
    return path.rstrip("/")


def _relative(path: str, root: str) -> str:
    return path[len(root) + 1:] if path.startswith(root + "/") else path.rsplit("/", 1)[-1]


def _shards_of(found: list[str], uri: str, field_path: str, shown=lambda p: p, root: str = "",
               saved_files: dict[str, set[str]] | None = None) -> list[str]:
    """The readable shards among a listing, sorted; what no format reads is refused by name
    (``shown``: a listed path as the user writes it, with its protocol; ``root``: the folder the
    paths are relative to; ``saved_files``: for a datasets.save_to_disk folder, the data files
    its state.json lists; its other files, such as ``cache-*.arrow`` from a map, are skipped)."""
    saved_files = saved_files or {}
    dataset_dicts = sorted(_folder(p) for p in found if p.rsplit("/", 1)[-1] == formats.DATASET_DICT)
    if dataset_dicts:
        top = dataset_dicts[0]
        splits = sorted({p[len(top) + 1:].split("/", 1)[0] for p in found
                         if p.startswith(top + "/") and p.endswith("/state.json")})
        example = shown(f"{top}/{splits[0] if splits else '<split>'}")
        raise ConfigError(field_path, f"{uri} holds a datasets DatasetDict ({shown(top)}: splits "
                          f"{', '.join(splits) or 'none found'}): name one split's folder as the source, "
                          f"e.g. {example}")
    # a prepared directory's own files are never text (a raw source above one must not read them)
    prepared = {_folder(p) for p in found if p.rsplit("/", 1)[-1] in (MANIFEST, PARAMS)}
    shards, unreadable = [], []
    for p in sorted(found):
        if _folder(p) in prepared or formats.ignorable(_relative(p, root)):
            continue
        listed = saved_files.get(_folder(p))
        if listed is not None and p.rsplit("/", 1)[-1] not in listed:
            continue  # beside a save_to_disk folder's data: a map's or filter's cache file
        (shards if formats.format_of(p) else unreadable).append(p)
    if unreadable:
        more = f" and {len(unreadable) - 3} more" if len(unreadable) > 3 else ""
        raise ConfigError(field_path, f"{uri} holds files in no format the trainer reads: "
                          f"{', '.join(map(shown, unreadable[:3]))}{more}. Readable: {', '.join(formats.SUFFIXES)} "
                          f"(JSON lines: one object a line with the text field). Convert them, move them "
                          f"out, or name the shards with a glob (e.g. {uri.rstrip('/')}/*.jsonl)")
    if not shards:
        raise ConfigError(field_path, f"no {'/'.join(formats.SUFFIXES)} shards found at {uri}")
    return shards


def list_shards(uri: str, field_path: str) -> list[str]:
    """The raw-text shards under a source URI: listed once per node, retried while the store's
    errors are transient; a store that answered and holds none, or holds files no format reads,
    names ``field_path``."""
    fs, path = fsspec.core.url_to_fs(uri)
    try:
        found = node_reads.query(uri, "list the shards of", lambda: _find(fs, path))
    except OSError as exc:  # only what retrying cannot mend reaches here (trainer.store.errors)
        raise ConfigError(field_path, f"cannot list {uri}: {exc}") from None
    shown = fs.unstrip_protocol if "://" in uri else (lambda p: p)
    root = _listing_root(path)
    saved = {_folder(p): files for p in found if p.rsplit("/", 1)[-1] == formats.DATASETS_STATE
             if (files := _saved_files(fs, p, uri, field_path, shown)) is not None}
    present = set(found)
    for folder, files in saved.items():  # what it lists and the listing lacks: a copy cut short
        missing = sorted(f for f in files if f"{folder}/{f}" not in present)
        if missing:
            raise ConfigError(field_path, f"{shown(folder)}'s state.json lists data files that are not there: "
                              f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    return [shown(p) for p in _shards_of(found, uri, field_path, shown, root, saved)]


def _saved_files(fs, state_path: str, uri: str, field_path: str, shown) -> set[str] | None:
    """The data files a datasets.save_to_disk folder's state.json lists; None for JSON that is not
    an object with ``_data_files`` (a state.json of something else: the folder's files are taken
    by the general rule). One cut short or garbled is refused by name: taken by the general rule,
    the folder's cache files (a map's, a filter's) would be read as data too."""
    try:
        state = json.loads(retry(lambda: fs.cat_file(state_path), f"read {state_path} of {uri}"))
    except OSError as exc:  # only what retrying cannot mend reaches here (trainer.store.errors)
        raise ConfigError(field_path, f"cannot read {shown(state_path)}: {exc}") from None
    except (ValueError, RecursionError):
        state = None  # not JSON: a datasets state.json cut short
    else:
        if not isinstance(state, dict) or "_data_files" not in state:
            return None
    entries = state.get("_data_files") if isinstance(state, dict) else None
    files = [e.get("filename") for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    if not files or len(files) != len(entries) or not all(isinstance(f, str) for f in files):
        raise ConfigError(field_path, f"{shown(state_path)} is not a readable datasets state.json (its "
                          f"_data_files list of {{filename}}): save the dataset again with save_to_disk")
    return set(files)


def read_texts(uri: str, text_field: str) -> list[str]:
    """All documents of one shard (shards are meant to be tens to hundreds of MB). The bytes are
    read whole, retried while the store's errors are transient, and parsed after: a shard that
    does not parse raises formats.ShardError, never retried."""
    fmt = formats.format_of(uri)
    if fmt is None:
        raise formats.ShardError(f"{uri}: no format the trainer reads ({', '.join(formats.SUFFIXES)})")
    fs, path = fsspec.core.url_to_fs(uri)
    data = retry(lambda: fs.cat_file(path), f"read {uri}")
    return formats.parse_texts(data, fmt, text_field, uri)


@dataclass
class SourcePosition:
    epoch: int = 0
    file: int = 0
    doc: int = 0
    offset: int = 0  # tokens of the current document already consumed


class DocumentSource:
    """Reads one raw-text source's shards in a seeded per-epoch order and hands out tokens."""

    random_access = False

    def __init__(self, index: int, uri: str, cfg: DataConfig, tokenizer, eos_id: int, seed: int,
                 field: str, text_field: str):
        self.index, self.cfg, self.tokenizer, self.eos_id, self.seed = index, cfg, tokenizer, eos_id, seed
        self.text_field = text_field  # DataConfig.text_field_of: the source's, else data.textField
        self.field_path = f"{field}[{index}].uri"
        if is_being_prepared(uri):  # said plainly, rather than "no readable shards"
            raise ConfigError(self.field_path, f"{uri} is being prepared: python -m trainer.data.prepare has not "
                              f"finished there (no {MANIFEST} yet). Wait for it (or run it again to finish) "
                              f"and restart")
        self.shards = list_shards(uri, self.field_path)
        # what the position's file index counts in: the shards listed, by number and digest of
        # their names below the source's common folder (the same data read through another
        # mount or working directory has the same listing); a position is only valid in the
        # same listing (trainer.loop.train.changed_data)
        common = len(os.path.commonprefix(self.shards).rpartition("/")[0])
        names = "\n".join(s[common:] for s in self.shards)
        self.listing = {"files": len(self.shards), "listing": hashlib.sha256(names.encode()).hexdigest()[:16]}
        self.pos = SourcePosition()
        self._loaded: tuple[int, int] | None = None  # (epoch, file) whose texts are cached
        self._texts: list[str] = []
        self._tokens: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        return shard_order(self.seed, self.index, epoch, len(self.shards), self.cfg.shuffle)

    def _ensure_loaded(self) -> None:
        key = (self.pos.epoch, self.pos.file)
        if self._loaded != key:
            uri = self.shards[self._order(self.pos.epoch)[self.pos.file]]
            try:
                self._texts = read_texts(uri, self.text_field)
            except OSError as exc:  # listed, then gone or refused for good (trainer.store.errors)
                raise ConfigError(self.field_path, f"cannot read {uri}: {exc}") from None
            except formats.ShardError as exc:  # the bytes are what they are: fatal, named
                raise ConfigError(self.field_path, f"a shard does not parse: {exc}") from None
            self._tokens = {}
            self._loaded = key

    def _doc_tokens(self, doc: int) -> list[int]:
        if doc not in self._tokens:
            start = doc - doc % TOKENIZE_CHUNK
            batch = self._texts[start:start + TOKENIZE_CHUNK]
            for i, enc in enumerate(self.tokenizer.encode_batch(batch)):
                self._tokens[start + i] = enc.ids + [self.eos_id]
        return self._tokens[doc]

    def _advance_doc(self) -> None:
        self.pos.doc += 1
        self.pos.offset = 0
        if self.pos.doc >= len(self._texts):
            self.pos.doc = 0
            self.pos.file += 1
            if self.pos.file >= len(self.shards):
                self.pos.file = 0
                self.pos.epoch += 1

    def _current(self) -> list[int]:
        empty = 0
        while True:
            self._ensure_loaded()
            if self._texts:
                return self._doc_tokens(self.pos.doc)
            empty += 1
            if empty > len(self.shards):  # a whole epoch without a document: it would loop for ever
                raise ConfigError(self.field_path, f"none of the {len(self.shards)} shards holds a document")
            self._advance_doc()  # empty shard

    def take(self, n: int) -> list[int]:
        """The next n tokens, documents back to back (packing)."""
        out: list[int] = []
        while len(out) < n:
            toks = self._current()
            piece = toks[self.pos.offset:self.pos.offset + n - len(out)]
            out.extend(piece)
            self.pos.offset += len(piece)
            if self.pos.offset >= len(toks):
                self._advance_doc()
        return out

    def take_document(self, n: int) -> list[int]:
        """The next document, truncated to n tokens (no packing)."""
        toks = self._current()[:n]
        self._advance_doc()
        return toks

    def next_row(self, n: int, packing: bool) -> list[int]:
        return self.take(n) if packing else self.take_document(n)

    def state(self) -> dict:
        return {**vars(self.pos), **self.listing}

    def load_state(self, state: dict) -> None:
        try:
            self.pos = SourcePosition(**{k: v for k, v in state.items() if k not in self.listing})
        except TypeError:
            raise ConfigError(self.field_path, f"the checkpoint's position for this source ({json.dumps(state)}) is "
                              f"not a raw-text position") from None


def _mix_uniform(seed: int, row: int) -> float:
    """A uniform draw in [0, 1) from (seed, row) alone: splitmix64, so no RNG state to save."""
    x = (seed * 0x9E3779B97F4A7C15 + row + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return ((x ^ (x >> 31)) >> 11) / float(1 << 53)


class PackedDataset:
    """The global stream of [seq_len + 1]-token rows; inputs are row[:-1], targets row[1:]."""

    IGNORE = -100

    def __init__(self, cfg: DataConfig, seq_len: int, seed: int, vocab_size: int, field: str = "data.sources"):
        self.cfg, self.seq_len, self.seed = cfg, seq_len, seed
        self.tokenizer, digest = read_tokenizer(cfg.tokenizer, cfg.eos_token)
        self.tokenizer_digest = digest  # saved with the position: raw text's tokens depend on it
        if self.tokenizer.get_vocab_size() > vocab_size:
            raise ConfigError("model.vocabSize", f"{vocab_size} is smaller than the tokenizer's vocabulary "
                              f"({self.tokenizer.get_vocab_size()}, {cfg.tokenizer})")
        eos = self.tokenizer.token_to_id(cfg.eos_token)
        self.pad_id = eos
        self.sources = [
            PreparedSource(i, s.uri, seed=seed, shuffle=cfg.shuffle, tokenizer_sha256=digest, eos_token=cfg.eos_token,
                           tokenizer_uri=cfg.tokenizer, packing=cfg.packing, vocab_size=vocab_size, field=field)
            if is_prepared(s.uri) else DocumentSource(i, s.uri, cfg, self.tokenizer, eos, seed, field, cfg.text_field_of(s))
            for i, s in enumerate(cfg.sources)]
        total = sum(s.weight for s in cfg.sources)
        acc, self.cumulative = 0.0, []
        for s in cfg.sources:
            acc += s.weight / total
            self.cumulative.append(acc)
        self.row = 0

    @property
    def kinds(self) -> list[str]:
        """Each source's kind, saved with its position: a position of one kind means nothing to the other."""
        return ["prepared" if src.random_access else "raw" for src in self.sources]

    @property
    def listings(self) -> list[dict | None]:
        """Each raw source's listing (DocumentSource.listing), None for a prepared one."""
        return [None if src.random_access else src.listing for src in self.sources]

    @property
    def reads_all_rows(self) -> bool:
        """Whether a raw-text source makes every rank read and tokenize the whole stream."""
        return not all(src.random_access for src in self.sources)

    def _pick_source(self, row: int):
        u = _mix_uniform(self.seed, row)
        for src, edge in zip(self.sources, self.cumulative):
            if u < edge:
                return src
        return self.sources[-1]

    def _pair(self, toks) -> tuple[list[int], list[int]]:
        toks = [int(t) for t in toks]
        if self.cfg.packing:
            return toks[:-1], toks[1:]
        pad = self.seq_len + 1 - len(toks)
        return (toks + [self.pad_id] * pad)[:-1], toks[1:] + [self.IGNORE] * pad

    def next_batch(self, rows: int, dp_rank: int = 0, dp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Data-parallel rank ``dp_rank``'s contiguous slice (rows // dp of them) of the next
        global batch of ``rows``. Every rank advances the stream by the whole batch; prepared
        sources are read only for the kept rows."""
        n, keep = self.seq_len + 1, rows // dp
        lo = dp_rank * keep
        found: list = [None] * keep
        wanted: dict[int, list[tuple[int, int]]] = {}  # source -> (slot, source row)
        for i in range(rows):
            src = self._pick_source(self.row)
            self.row += 1
            mine = lo <= i < lo + keep
            if src.random_access:
                j = src.claim(n)
                if mine:
                    wanted.setdefault(src.index, []).append((i - lo, j))
            else:
                toks = src.next_row(n, self.cfg.packing)  # raw text: read in order, kept or not
                if mine:
                    found[i - lo] = toks
        for index, items in wanted.items():
            rows_toks = self.sources[index].read([j for _, j in items], n)
            for (slot, _), toks in zip(items, rows_toks):
                found[slot] = toks
        pairs = [self._pair(t) for t in found]
        return (torch.tensor([p[0] for p in pairs], dtype=torch.long),
                torch.tensor([p[1] for p in pairs], dtype=torch.long))

    def state(self) -> dict:
        return {"row": self.row, "sources": [s.state() for s in self.sources]}

    def load_state(self, state: dict) -> None:
        if len(state["sources"]) != len(self.sources):
            raise ConfigError("data.sources", f"the checkpoint has {len(state['sources'])} sources, "
                              f"the config {len(self.sources)}")
        self.row = state["row"]
        for src, pos in zip(self.sources, state["sources"]):
            src.load_state(pos)


def heldout_batches(data: DataConfig, seq_len: int, seed: int, vocab_size: int, global_batch: int,
                    batches: int, dp_rank: int = 0, dp: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's slices of the first ``batches`` global batches of
    ``data.held_out``: the same ones at every evaluation, in training and in
    ``trainer.loop.evaluate``, so perplexities compare. Prepared held-out data is read per rank."""
    held = replace(data, sources=data.held_out, held_out=[])
    stream = PackedDataset(held, seq_len, seed, vocab_size, field="data.heldOut")
    return [stream.next_batch(global_batch, dp_rank, dp) for _ in range(batches)]

