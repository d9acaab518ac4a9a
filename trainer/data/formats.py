"""The raw-text shard formats a data source may hold, declared once.

A format is a container (JSON lines, Parquet, Arrow) and, for JSON lines, a compression (gzip,
zstd). Compressed streams are opened with pyarrow's codecs (the reader the Parquet and Arrow
files already use), so no second decompression library is needed. A shard that does not parse
raises ``ShardError``: it names the file and what is wrong, and it is never retried (the bytes
were read; reading them again gives the same bytes).

What a listing skips rather than refuses is written here too (``ignorable``): metadata that
``datasets.save_to_disk`` and ``trainer.data.prepare`` write beside their data, hidden and
underscore files (``.crc`` checksums, Spark's ``_SUCCESS``), and documentation. Any other file
with a suffix we do not read is refused by name (``trainer.data.packed.list_shards``): a
``.jsonl.bz2`` or ``.txt`` shard silently left out would be training data lost.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass


class ShardError(ValueError):
    """A shard whose bytes do not parse as its format says, or lack the text field."""


@dataclass(frozen=True)
class ShardFormat:
    name: str
    suffixes: tuple[str, ...]
    container: str  # "jsonl", "parquet" or "arrow"
    compression: str | None = None  # a pyarrow codec name


FORMATS: tuple[ShardFormat, ...] = (
    ShardFormat("JSON lines", (".jsonl", ".json", ".ndjson"), "jsonl"),
    ShardFormat("gzip JSON lines", (".jsonl.gz", ".json.gz"), "jsonl", "gzip"),
    ShardFormat("zstd JSON lines", (".jsonl.zst", ".json.zst", ".jsonl.zstd"), "jsonl", "zstd"),
    ShardFormat("Parquet", (".parquet",), "parquet"),
    ShardFormat("Arrow (IPC file or stream; datasets.save_to_disk)", (".arrow",), "arrow"),
)
SUFFIXES: tuple[str, ...] = tuple(s for f in FORMATS for s in f.suffixes)

# datasets.save_to_disk's metadata beside its .arrow files (a DatasetDict adds dataset_dict.json)
DATASETS_METADATA = frozenset({"state.json", "dataset_info.json", "dataset_dict.json"})
DATASET_DICT, DATASETS_STATE = "dataset_dict.json", "state.json"
_DOCUMENTATION = (".md", ".rst")
_DOCUMENTATION_NAMES = ("README", "LICENSE", "LICENCE", "NOTICE", "COPYING")


def format_of(path: str) -> ShardFormat | None:
    """The format a file's name says, None when it is none we read."""
    lower = path.lower()
    for fmt in FORMATS:
        if lower.endswith(fmt.suffixes):
            return fmt
    return None


def ignorable(relative: str) -> bool:
    """A listed path (relative to the source's root) a listing skips without reading: an object
    store's folder marker (``dir/``, EMR's ``dir_$folder$``), anything under or named with a
    leading ``.`` or ``_`` (``.cache/`` of a Hugging Face download, ``.ipynb_checkpoints/``,
    Spark's ``_temporary/`` and ``_SUCCESS``, ``.crc`` files), ``datasets``' metadata, and
    documentation that is in no readable format (``README.md``; ``readme-qa.jsonl`` is data)."""
    if relative.endswith("/") or relative.endswith("_$folder$"):
        return True
    parts = [part for part in relative.split("/") if part]
    if not parts or any(part.startswith((".", "_")) for part in parts):
        return True
    name = parts[-1]
    if name in DATASETS_METADATA:
        return True
    return format_of(name) is None and (name.lower().endswith(_DOCUMENTATION)
                                        or name.upper().startswith(_DOCUMENTATION_NAMES))


def _decompressed(data: bytes, fmt: ShardFormat, name: str) -> bytes:
    if fmt.compression is None:
        return data
    import pyarrow as pa

    try:
        return pa.CompressedInputStream(pa.BufferReader(data), fmt.compression).read()
    except (OSError, pa.ArrowException) as exc:
        raise ShardError(f"{name} is not valid {fmt.compression} data ({exc})") from None


def _jsonl_texts(data: bytes, text_field: str, name: str) -> list[str]:
    texts = []
    if data.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"[":
        raise ShardError(f"{name} is a JSON array, not JSON lines (one object a line): convert it, e.g. "
                         f"jq -c '.[]' < file > file.jsonl")
    for number, line in enumerate(io.BytesIO(data), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise ShardError(f"{name} line {number} is not JSON ({exc})") from None
        except RecursionError:  # nested deeper than the parser goes: a named error, not a crash loop
            raise ShardError(f"{name} line {number} is JSON nested too deeply to read") from None
        if not isinstance(row, dict):
            raise ShardError(f"{name} line {number} is a JSON {type(row).__name__}, not an object with "
                             f"{text_field!r}")
        if text_field not in row:
            raise ShardError(f"{name} line {number} has no {text_field!r} field (its fields: "
                             f"{', '.join(sorted(row)[:8]) or 'none'}); set the source's textField")
        text = row[text_field]
        if not isinstance(text, str):
            raise ShardError(f"{name} line {number}: {text_field!r} is a JSON "
                             f"{'null' if text is None else type(text).__name__}, not a string")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate (\ud800) the tokenizer cannot take
            raise ShardError(f"{name} line {number}: {text_field!r} is not valid Unicode ({exc.reason})") from None
        texts.append(text)
    return texts


def _arrow_table(data: bytes, fmt: ShardFormat, text_field: str, name: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if fmt.container == "parquet":  # only the text column is decoded
            shard = pq.ParquetFile(pa.BufferReader(data))
            if text_field not in shard.schema_arrow.names:
                return shard.schema_arrow.empty_table()  # its column names go into the error
            return shard.read(columns=[text_field])
        try:
            return pa.ipc.open_file(pa.py_buffer(data)).read_all()
        except pa.ArrowInvalid:  # datasets.save_to_disk writes the stream format
            return pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except (OSError, pa.ArrowException) as exc:
        raise ShardError(f"{name} is not a valid {fmt.name} file ({exc})") from None


def _stringlike(tp) -> bool:
    import pyarrow as pa

    return pa.types.is_string(tp) or pa.types.is_large_string(tp) or \
        (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(tp))


def _column_texts(table, text_field: str, name: str) -> list[str]:
    import pyarrow as pa

    if text_field not in table.column_names:
        raise ShardError(f"{name} has no {text_field!r} column (its columns: "
                         f"{', '.join(table.column_names[:8]) or 'none'}); set the source's textField")
    column = table.column(text_field)
    if pa.types.is_dictionary(column.type) and _stringlike(column.type.value_type):  # pandas categoricals
        column = column.cast(column.type.value_type)
    if not _stringlike(column.type):
        raise ShardError(f"{name}: column {text_field!r} is {column.type}, not a string column")
    column = column.cast(pa.large_string())  # string_view (Polars) and string alike
    if column.null_count:
        first = column.is_null().to_pylist().index(True)
        raise ShardError(f"{name}: column {text_field!r} is null in row {first} ({column.null_count} null rows)")
    return column.to_pylist()


def parse_texts(data: bytes, fmt: ShardFormat, text_field: str, name: str) -> list[str]:
    """Every document's text in one shard's bytes, in order; ShardError when they do not parse."""
    data = _decompressed(data, fmt, name)
    if fmt.container == "jsonl":
        return _jsonl_texts(data, text_field, name)
    return _column_texts(_arrow_table(data, fmt, text_field, name), text_field, name)
