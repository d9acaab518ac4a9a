"""Prepared (pre-tokenized) sources: a directory that ``python -m trainer.data.prepare`` wrote.

A prepared directory holds one Megatron ``.bin``/``.idx`` pair per raw shard
(trainer.data.indexed) and ``prepared.json``, written last, so its presence means every shard is
complete. The manifest says which tokenizer (by content digest) and end-of-document token made
the tokens, and each shard's document and token counts, in the raw shards' order.

Rows are found by arithmetic, not by reading: a source's stream is its shards in the per-epoch
order (the same seeded order raw text uses), each document followed by its end token. With
packing, a row is the next n tokens of that endless stream (n = seqLen + 1); without, the next
document, truncated to n. So a source's position is one number (a token offset, or a document
number) and a rank reads only the byte ranges of its own rows: the manifest's token counts
locate packed rows with no index read at all; unpacked rows read the index of the shards they
touch.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field

import fsspec
import numpy as np

from ..store import node_reads
from ..config import ConfigError
from .indexed import IndexFormatError, ShardIndex, decode_index, decode_tokens
from ..store.errors import StoreConfigError, retry

MANIFEST = "prepared.json"
PARAMS = "prepare-params.json"  # written first by trainer.data.prepare: a directory being prepared
SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}")
FORMAT = "megatron-indexed"
FORMAT_VERSION = 1


def tokenizer_digest(content: str | bytes) -> str:
    """What identifies a tokenizer: the sha256 of its JSON text (or a SentencePiece model's
    bytes), so a renamed copy still matches."""
    return hashlib.sha256(content.encode() if isinstance(content, str) else content).hexdigest()


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
            shards = [PreparedShard(**sh) for sh in raw.pop("shards")]
            manifest = cls(shards=shards, **raw)
            if manifest.dtype not in ("uint16", "int32"):
                raise ValueError(f"token dtype {manifest.dtype!r}")
            counts = [v for sh in shards for v in (sh.documents, sh.tokens)] + [manifest.eos_id, manifest.version]
            if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in counts):
                raise ValueError("counts must be whole numbers, not negative")
            texts = [manifest.tokenizer_sha256, manifest.eos_token, manifest.tokenizer, manifest.text_field,
                     *(sh.source for sh in shards)]
            if any(not isinstance(v, str) for v in texts):
                raise ValueError("names and digests must be strings")
            bad = [s.name for s in shards if not isinstance(s.name, str) or not SHARD_NAME.fullmatch(s.name)]
            if bad:  # names are paths under the directory: never another directory's files
                raise ValueError(f"shard names {bad[:3]} are not plain file names")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ConfigError(field_path, f"{where} is not a manifest this trainer can read: {exc}") from None
        return manifest


def manifest_uri(root: str) -> str:
    return root.rstrip("/") + "/" + MANIFEST


def _exists(uri: str) -> bool:
    """Whether the object exists, asked once per node. Only "not there" (or refused for good: not
    ours to read) is False, and the source is then read as raw text, whose listing names the
    field; a throttled or failing store is retried (trainer.store.errors), never read as "not
    prepared"."""
    try:
        return node_reads.exists(uri)
    except StoreConfigError:
        return False


def is_prepared(uri: str) -> bool:
    """Whether a data source URI names a prepared directory (its manifest exists)."""
    return not any(c in uri for c in "*?[") and _exists(manifest_uri(uri))


def is_being_prepared(uri: str) -> bool:
    """A directory trainer.data.prepare began but has not finished (no manifest yet)."""
    return not any(c in uri for c in "*?[") and _exists(uri.rstrip("/") + "/" + PARAMS)


class PreparedSource:
    """One prepared source: rows by arithmetic, bytes by ranged reads of this rank's rows only.

    The position is where the next row begins: a token offset in the source's endless stream
    with packing (so a resume with another seqLen goes on where the last run stopped, as raw
    text does), a document number without."""

    random_access = True
    INDEX_CACHE = 16  # shard indexes kept (unpacked rows): a rank's rows stay in a few shards

    def __init__(self, index: int, uri: str, *, seed: int, shuffle: bool, tokenizer_sha256: str, eos_token: str,
                 tokenizer_uri: str, packing: bool, vocab_size: int, field: str = "data.sources"):
        self.index, self.seed, self.shuffle, self.packing, self.vocab_size = index, seed, shuffle, packing, vocab_size
        self.field_path = f"{field}[{index}].uri"
        self.uri = uri.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.uri)
        where = manifest_uri(uri)
        try:
            text = node_reads.read_object(where).decode()  # once per node: every rank reads it
        except (OSError, UnicodeDecodeError) as exc:  # OSError: what retrying cannot mend
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
        if not (self.tokens_per_epoch if packing else self.docs_per_epoch):
            raise ConfigError(self.field_path, f"{uri} holds no {'tokens' if packing else 'documents'} "
                              f"({len(m.shards)} shards)")
        self._check_sizes()
        self.next = 0  # where the next row begins: a token offset (packing) or a document number
        self.requests = 0  # reads made, for the data benchmark
        self.bytes_read = 0
        self._epochs: dict[int, tuple[list[int], list[int], list[int]]] = {}
        self._indexes: dict[int, ShardIndex] = {}

    def _check_sizes(self) -> None:
        """Every .bin holds the tokens the manifest counts: a torn or replaced shard is named at
        the start, not hours later when a rank's rows reach it. One listing of the directory."""
        def listing() -> dict[str, int]:
            return {entry["name"].rsplit("/", 1)[-1]: entry["size"] for entry in self.fs.ls(self.root, detail=True)}
        try:
            sizes = node_reads.query(self.uri, "list the files of", listing)  # once per node, retried
        except OSError as exc:  # what retrying cannot mend (trainer.store.errors)
            raise ConfigError(self.field_path, f"cannot list {self.root}: {exc}") from None
        for shard in self.manifest.shards:
            want = shard.tokens * self.dtype.itemsize
            if sizes.get(shard.name + ".bin") != want:
                raise ConfigError(self.field_path, f"{shard.name}.bin holds {sizes.get(shard.name + '.bin')} bytes, "
                                  f"the manifest counts {shard.tokens} tokens ({want} bytes): a torn or replaced "
                                  f"shard. Prepare the source again")

    # -- position ---------------------------------------------------------------------------------

    @property
    def unit(self) -> str:
        return "tokens" if self.packing else "documents"

    def claim(self, n: int) -> int:
        """Where the next row (n tokens) begins; every rank claims every row, reading only its own."""
        at = self.next
        self.next += n if self.packing else 1
        return at

    def state(self) -> dict:
        return {self.unit: self.next}

    def load_state(self, state: dict) -> None:
        value = state.get(self.unit) if isinstance(state, dict) and len(state) == 1 else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(self.field_path, f"the checkpoint's position for this source ({json.dumps(state)}) is "
                              f"not a prepared source's position in {self.unit}")
        self.next = value

    # -- where a row lies -------------------------------------------------------------------------

    def _epoch(self, epoch: int) -> tuple[list[int], list[int], list[int]]:
        """(shard order, cumulative tokens, cumulative documents) of one epoch."""
        if epoch not in self._epochs:
            order = shard_order(self.seed, self.index, epoch, len(self.manifest.shards), self.shuffle)
            tok, doc, t, d = [0], [0], 0, 0
            for k in order:
                t += self.manifest.shards[k].tokens
                d += self.manifest.shards[k].documents
                tok.append(t)
                doc.append(d)
            if len(self._epochs) >= 4:
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (order, tok, doc)
        return self._epochs[epoch]

    def _index(self, shard: int) -> ShardIndex:
        if shard in self._indexes:
            return self._indexes[shard]
        name = self.manifest.shards[shard].name
        path = f"{self.root}/{name}.idx"
        try:
            data = retry(lambda: self.fs.cat_file(path), f"read {self.uri}/{name}.idx")
        except OSError as exc:  # what retrying cannot mend (trainer.store.errors)
            raise ConfigError(self.field_path, f"cannot read {name}.idx: {exc}") from None
        self.requests += 1
        self.bytes_read += len(data)
        try:
            index = decode_index(data, path)
        except IndexFormatError as exc:
            raise ConfigError(self.field_path, str(exc)) from None
        shard_info = self.manifest.shards[shard]
        if index.documents != shard_info.documents or index.tokens != shard_info.tokens \
                or np.dtype(index.dtype) != self.dtype:
            raise ConfigError(self.field_path, f"{name}.idx ({index.documents} documents, {index.tokens} "
                              f"{np.dtype(index.dtype).name} tokens) does not match the manifest "
                              f"({shard_info.documents}, {shard_info.tokens} {self.dtype.name})")
        if len(self._indexes) >= self.INDEX_CACHE:
            self._indexes.pop(next(iter(self._indexes)))  # the oldest
        self._indexes[shard] = index
        return index

    def _packed_ranges(self, offset: int, n: int) -> list[tuple[int, int, int]]:
        """(shard, first token, end token) pieces of the n tokens at ``offset`` in the stream."""
        out = []
        while n:
            epoch, within = divmod(offset, self.tokens_per_epoch)
            order, cum, _ = self._epoch(epoch)
            pos = bisect.bisect_right(cum, within) - 1  # cum[pos] <= within < cum[pos + 1]
            start = within - cum[pos]
            take = min(n, cum[pos + 1] - within)
            out.append((order[pos], start, start + take))
            offset, n = offset + take, n - take
        return out

    def _document_range(self, doc: int, n: int) -> tuple[int, int, int]:
        """Document ``doc`` of the stream, truncated to n tokens."""
        epoch, within = divmod(doc, self.docs_per_epoch)
        order, _, cum = self._epoch(epoch)
        pos = bisect.bisect_right(cum, within) - 1
        shard = order[pos]
        index = self._index(shard)
        k = within - cum[pos]
        first = int(index.starts[k])
        return shard, first, first + min(n, int(index.lengths[k]))

    def read(self, rows: list[int], n: int) -> list[np.ndarray]:
        """The tokens of the rows beginning at these positions: neighbouring pieces of one shard
        are read in one ranged GET, and every GET of the batch is issued together (s3fs runs
        them concurrently). A store that fails or throttles is retried, then ends the process
        retryable (trainer.store.errors); only missing, refused or short data is the source's fault."""
        pieces = [self._packed_ranges(r, n) if self.packing else [self._document_range(r, n)] for r in rows]
        spans: dict[int, list[list[int]]] = {}
        for shard, lo, hi in sorted({p for row in pieces for p in row if p[2] > p[1]}):
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
        firsts, ends = [lo * size for _, lo, _ in reads], [hi * size for _, _, hi in reads]
        try:
            blobs = retry(lambda: self.fs.cat_ranges(paths, firsts, ends, on_error="raise"),
                          f"read token shards under {self.uri}") if reads else []
        except OSError as exc:  # what retrying cannot mend (trainer.store.errors)
            raise ConfigError(self.field_path, f"cannot read token shards under {self.root}: {exc}") from None
        self.requests += len(reads)
        self.bytes_read += sum(len(b) for b in blobs)
        starts: dict[int, list[int]] = {}
        tokens: dict[tuple[int, int], np.ndarray] = {}
        for (shard, lo, hi), blob in zip(reads, blobs):
            name = self.manifest.shards[shard].name
            if len(blob) != (hi - lo) * size:
                raise ConfigError(self.field_path, f"{name}.bin is shorter than its manifest says (a torn or "
                                  f"replaced shard): prepare the source again")
            toks = decode_tokens(blob, self.dtype)
            if len(toks) and (int(toks.min()) < 0 or int(toks.max()) >= self.vocab_size):
                raise ConfigError(self.field_path, f"{name}.bin holds token ids outside 0..{self.vocab_size - 1} "
                                  f"(model.vocabSize): not this tokenizer's tokens. Prepare the source again")
            starts.setdefault(shard, []).append(lo)  # reads are in ascending order per shard
            tokens[shard, lo] = toks
        out = []
        for row in pieces:
            parts = []
            for shard, lo, hi in row:
                if hi == lo:
                    continue
                run = starts[shard][bisect.bisect_right(starts[shard], lo) - 1]
                parts.append(tokens[shard, run][lo - run:hi - run])
            out.append(np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros(0, np.int64))
        return out
