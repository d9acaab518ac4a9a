"""Token shards in Megatron's indexed-dataset format (a ``.bin`` of tokens, a ``.idx`` index).

The format is Megatron-LM's and NeMo's (``megatron.core.datasets.indexed_dataset``): the
``.bin`` is every document's tokens back to back, little-endian, one dtype; the ``.idx`` is a
header (``MMIDIDX\\0\\0``, version 1, the dtype's code, the sequence and document counts)
followed by each sequence's length (int32), its byte offset in the ``.bin`` (int64) and the
document boundaries (int64, sequence indices, starting at 0). We write one sequence per
document, so Megatron's ``IndexedDataset`` reads our shards and we read shards its builder
wrote (tests/unit/test_prepared_data.py checks both ways).

Why this format: a document's or a token range's bytes are found by arithmetic on the index,
so a rank reads only its rows with one ranged GET per run of consecutive rows (s3fs
``cat_ranges``), and no tokenizer runs at training time. See docs/data.md for the comparison
with MDS, litdata and Hugging Face ``datasets``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# Megatron's DType codes (megatron.core.datasets.indexed_dataset.DType)
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
TOKEN_DTYPES = (np.uint16, np.int32)  # what we write: uint16 when the vocabulary fits, else int32
_FIXED = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, two counts


class IndexFormatError(ValueError):
    """A .idx that is not a Megatron index (or one we cannot read): the message names the file."""


def token_dtype(vocab_size: int) -> type:
    """Megatron's choice too (``best_fitting_dtype``): two bytes a token while ids fit."""
    return np.uint16 if vocab_size <= 65536 else np.int32


def dtype_code(dtype) -> int:
    return next(code for code, d in DTYPE_CODES.items() if d == np.dtype(dtype).type)


def encode_index(lengths: np.ndarray, dtype) -> bytes:
    """The .idx bytes for documents of these lengths (one sequence per document)."""
    lengths = np.asarray(lengths, dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    documents = np.arange(len(lengths) + 1, dtype=np.int64)
    head = INDEX_HEADER + struct.pack("<QBQQ", INDEX_VERSION, dtype_code(dtype), len(lengths), len(documents))
    return head + lengths.tobytes() + pointers.tobytes() + documents.tobytes()


@dataclass
class ShardIndex:
    """One shard's index: where each document's tokens lie in its .bin."""

    dtype: type
    starts: np.ndarray  # int64, each document's first token (token offsets, not bytes)
    lengths: np.ndarray  # int64, each document's tokens

    @property
    def documents(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize


def decode_index(data: bytes, name: str) -> ShardIndex:
    """Parse a .idx. Documents made of several sequences (Megatron allows it) are read as one
    run of tokens from their first sequence to their last, which is how packing reads them."""
    if len(data) < _FIXED or data[:len(INDEX_HEADER)] != INDEX_HEADER:
        raise IndexFormatError(f"{name} is not a Megatron indexed-dataset index (no MMIDIDX header)")
    version, code, seqs, docs = struct.unpack_from("<QBQQ", data, len(INDEX_HEADER))
    if version != INDEX_VERSION or code not in DTYPE_CODES:
        raise IndexFormatError(f"{name}: unsupported index version {version} or dtype code {code}")
    dtype = DTYPE_CODES[code]
    if np.dtype(dtype).kind not in "iu":
        raise IndexFormatError(f"{name}: tokens of dtype {np.dtype(dtype).name} are not token ids")
    need = _FIXED + seqs * 4 + seqs * 8 + docs * 8
    if len(data) < need or docs < 1:
        raise IndexFormatError(f"{name} is truncated ({len(data)} bytes, the header promises {need})")
    offset = _FIXED
    seq_lengths = np.frombuffer(data, dtype=np.int32, count=seqs, offset=offset).astype(np.int64)
    offset += seqs * 4
    pointers = np.frombuffer(data, dtype=np.int64, count=seqs, offset=offset)
    offset += seqs * 8
    bounds = np.frombuffer(data, dtype=np.int64, count=docs, offset=offset)
    itemsize = np.dtype(dtype).itemsize
    if seqs and (np.any(seq_lengths < 0) or np.any(pointers < 0) or np.any(pointers % itemsize)
                 or np.any(np.diff(bounds) < 0) or bounds[0] != 0 or bounds[-1] != seqs):
        raise IndexFormatError(f"{name}: inconsistent index (negative lengths or pointers, unaligned pointers or "
                          f"document bounds out of order)")
    first, last = bounds[:-1], bounds[1:] - 1
    nonempty = last >= first
    starts = np.zeros(docs - 1, dtype=np.int64)
    lengths = np.zeros(docs - 1, dtype=np.int64)
    if seqs:
        starts[nonempty] = pointers[first[nonempty]] // itemsize
        ends = pointers[last[nonempty]] // itemsize + seq_lengths[last[nonempty]]
        lengths[nonempty] = ends - starts[nonempty]
    return ShardIndex(dtype, starts, lengths)


def decode_tokens(data: bytes, dtype) -> np.ndarray:
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).astype(np.int64)
