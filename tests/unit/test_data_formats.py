"""The raw-text shard formats (trainer.data.formats) users bring: compressed JSON lines, Parquet,
Arrow, and folders datasets.save_to_disk wrote, read by the trainer and by trainer.data.prepare.

The reference for every format is plain JSON lines holding the same documents: each format,
read at data-parallel degree 2, gives bitwise the same rows on each rank, and prepares into
the same tokens. The writers are the libraries users write with (gzip, pyarrow, datasets);
nothing is mocked. A shard that is malformed, or a folder the trainer cannot read, is a
configuration error naming the source and the file.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trainer.config import ConfigError, from_dict
from trainer.data import formats
from trainer.data.packed import PackedDataset
from trainer.data.prepare import main as prepare_main
from trainer.loop.train import changed_data, source_list

DOCS = [f"document {i}: the {['cat', 'dog', 'fox', 'owl'][i % 4]} sat " * (1 + i % 3) for i in range(40)]
SHARDS = [DOCS[:25], DOCS[25:]]  # two shards of unequal length


def config(sources, tokenizer, **data):
    return from_dict({"data": {"sources": sources, "tokenizer": tokenizer, **data}}).data


def _jsonl(docs, field="text") -> bytes:
    return "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


def _table(docs, field="text"):
    return pa.table({"id": list(range(len(docs))), field: docs})


def write_format(root: Path, kind: str, field: str = "text") -> str:
    """The corpus as ``kind`` under root; the URI a source names."""
    root.mkdir(parents=True)
    for k, docs in enumerate(SHARDS):
        base = root / f"part-{k}"
        if kind == "jsonl":
            base.with_suffix(".jsonl").write_bytes(_jsonl(docs, field))
        elif kind == "jsonl.gz":
            base.with_suffix(".jsonl.gz").write_bytes(gzip.compress(_jsonl(docs, field)))
        elif kind == "jsonl.zst":
            with pa.CompressedOutputStream(str(base.with_suffix(".jsonl.zst")), "zstd") as out:
                out.write(_jsonl(docs, field))
        elif kind == "parquet":
            pq.write_table(_table(docs, field), base.with_suffix(".parquet"))
        elif kind == "arrow-file":
            with pa.ipc.new_file(str(base.with_suffix(".arrow")), _table(docs, field).schema) as w:
                w.write_table(_table(docs, field))
        elif kind == "arrow-stream":
            with pa.ipc.new_stream(str(base.with_suffix(".arrow")), _table(docs, field).schema) as w:
                w.write_table(_table(docs, field))
    if kind == "save_to_disk":
        datasets = pytest.importorskip("datasets")  # the test extra installs it: a skip here is a broken venv
        datasets.Dataset.from_dict({"id": list(range(len(DOCS))), field: DOCS}).save_to_disk(
            str(root / "ds"), num_shards=2)
        return str(root / "ds")
    return str(root)


KINDS = ["jsonl.gz", "jsonl.zst", "parquet", "arrow-file", "arrow-stream", "save_to_disk"]


def rows(uri, tokenizer, dp_rank, steps=14, **data):
    ds = PackedDataset(config([{"uri": uri, **data.pop("source", {})}], tokenizer, shuffle=False, **data),
                       16, 7, 512)
    return [ds.next_batch(8, dp_rank, 2) for _ in range(steps)]


@pytest.mark.parametrize("kind", KINDS)
def test_each_format_gives_the_rows_of_plain_json_lines_at_dp_2(tmp_path, tiny_data, kind):
    reference = write_format(tmp_path / "jsonl", "jsonl")
    uri = write_format(tmp_path / kind, kind)
    for rank in (0, 1):
        for (x, y), (rx, ry) in zip(rows(uri, tiny_data["tokenizer"], rank), rows(reference, tiny_data["tokenizer"], rank)):
            assert torch.equal(x, rx) and torch.equal(y, ry)
    # the stream wrapped past both shards, so every document of both was read in order
    ds = PackedDataset(config([{"uri": uri}], tiny_data["tokenizer"], shuffle=False), 16, 7, 512)
    for _ in range(14):
        ds.next_batch(8)
    assert ds.sources[0].pos.epoch >= 1


@pytest.mark.parametrize("kind", KINDS)
def test_each_format_prepares_into_the_tokens_plain_json_lines_make(tmp_path, tiny_data, kind):
    tok = tiny_data["tokenizer"]
    outs = {}
    for k in ("jsonl", kind):
        src = write_format(tmp_path / f"src-{k}", k)
        assert prepare_main(["--source", src, "--tokenizer", tok, "--out", str(tmp_path / f"prep-{k}")]) == 0
        outs[k] = b"".join(p.read_bytes() for p in sorted((tmp_path / f"prep-{k}").glob("part-*.bin")))
    assert outs[kind] == outs["jsonl"] and outs[kind]


def test_a_text_field_per_source(tmp_path, tiny_data):
    tok = tiny_data["tokenizer"]
    reference = write_format(tmp_path / "ref", "jsonl")
    content = write_format(tmp_path / "content", "parquet", field="content")
    mine = rows(content, tok, 0, source={"textField": "content"})
    assert all(torch.equal(a[0], b[0]) for a, b in zip(mine, rows(reference, tok, 0)))
    # the run-wide default still applies to sources without their own
    assert all(torch.equal(a[0], b[0]) for a, b in zip(rows(content, tok, 1, textField="content"),
                                                     rows(reference, tok, 1)))


def test_a_raw_folder_listing_other_files_at_resume_is_refused_naming_the_source(tmp_path, tiny_data):
    """A raw source's position counts files of its listing: a file added (or one the listing rules
    now skip, or read) would make the same position name other documents, or none (a crash
    loop). The checkpoint records the listing; another is refused like a changed source (and
    data.allowChangedSources starts the source over). A position from before the record loads."""
    tok = tiny_data["tokenizer"]
    a = write_format(tmp_path / "a", "jsonl")
    cfg = config([{"uri": a}], tok)
    data = PackedDataset(cfg, 16, 7, 512)
    data.next_batch(4)
    meta = {"dataSources": source_list(cfg), "textField": cfg.text_field, "data": data.state()}
    assert changed_data(meta, cfg, data.kinds, data.listings) is None
    (Path(a) / "zz-new.jsonl").write_text('{"text": "late"}\n')
    later = PackedDataset(cfg, 16, 7, 512)
    field, then, now = changed_data(meta, cfg, later.kinds, later.listings)
    files = len(data.sources[0].shards)
    assert field == "data.sources[0].uri" and then.startswith(f"{files} files") and now.startswith(f"{files + 1} files")
    # the same files elsewhere (another mount, another working directory): the same listing
    moved = tmp_path / "moved"
    shutil.copytree(a, moved)
    (moved / "zz-new.jsonl").unlink()
    there = PackedDataset(config([{"uri": str(moved)}], tok), 16, 7, 512)
    assert there.listings == data.listings
    # a checkpoint from before the record: its position loads as it is
    old = {k: v for k, v in data.state()["sources"][0].items() if k not in ("files", "listing")}
    assert changed_data({**meta, "data": {"row": 4, "sources": [old]}}, cfg, later.kinds, later.listings) is None
    later.load_state({"row": 4, "sources": [old]})
    later.load_state(data.state())  # the recorded listing is not part of the position
    assert vars(later.sources[0].pos) == vars(data.sources[0].pos)


def test_a_changed_text_field_of_one_source_is_refused_at_resume(tmp_path, tiny_data):
    tok = tiny_data["tokenizer"]
    a, b = write_format(tmp_path / "a", "jsonl"), write_format(tmp_path / "b", "jsonl")
    before = config([{"uri": a}, {"uri": b}], tok)
    meta = {"dataSources": source_list(before), "textField": before.text_field}
    assert changed_data(meta, before) is None
    after = config([{"uri": a}, {"uri": b, "textField": "body"}], tok)
    assert changed_data(meta, after) == ("data.sources[1].textField", '"text"', '"body"')
    # a checkpoint from before per-source fields: its data.textField stood for every source
    old = {"dataSources": [{"uri": a, "weight": 1.0}, {"uri": b, "weight": 1.0}], "textField": "text"}
    assert changed_data(old, before) is None
    assert changed_data(old, config([{"uri": a}, {"uri": b}], tok, textField="body"))[0] == "data.textField"


def _first_read_error(uri, tok, **data) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        ds = PackedDataset(config([{"uri": uri}], tok, shuffle=False, **data), 16, 7, 512)
        ds.next_batch(8)
    return err.value


@pytest.mark.parametrize("content,expected", [
    (b'{"text": "fine"}\n{"text": "cut off\n', "line 2 is not JSON"),
    (b'{"text": "fine"}\n[1, 2]\n', "line 2 is a JSON list"),
    (b'{"text": "fine"}\n{"body": "x", "id": 3}\n', "line 2 has no 'text' field (its fields: body, id)"),
    (b'{"text": null}\n', "line 1: 'text' is a JSON null"),
    (b'\xff\xfe\n', "line 1 is not JSON"),
])
def test_a_malformed_json_lines_shard_is_a_configuration_error_naming_the_file_and_line(
        tmp_path, tiny_data, content, expected):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    err = _first_read_error(str(bad), tiny_data["tokenizer"])
    assert err.field == "data.sources[0].uri" and str(bad) in err.message and expected in err.message


def test_broken_compressed_and_columnar_shards_are_named(tmp_path, tiny_data):
    tok = tiny_data["tokenizer"]
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(_jsonl(DOCS))[:-30])
    assert "not valid gzip data" in _first_read_error(str(cut), tok).message
    fake = tmp_path / "fake.jsonl.zst"
    fake.write_bytes(b"not zstd at all")
    assert "not valid zstd data" in _first_read_error(str(fake), tok).message
    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"body": ["a"], "id": [1]}), wrong)
    err = _first_read_error(str(wrong), tok)
    assert "no 'text' column (its columns: body, id)" in err.message and "textField" in err.message
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    assert "not a string column" in _first_read_error(str(numbers), tok).message
    holes = tmp_path / "holes.parquet"
    pq.write_table(pa.table({"text": ["a", None, "c"]}), holes)
    assert "null in row 1" in _first_read_error(str(holes), tok).message
    junk = tmp_path / "junk.arrow"
    junk.write_bytes(b"ARROW1 but not really")
    assert "not a valid Arrow" in _first_read_error(str(junk), tok).message


def test_a_datasets_dict_folder_is_refused_naming_its_splits(tmp_path, tiny_data):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:30]}),
                                   "test": datasets.Dataset.from_dict({"text": DOCS[30:]})})
    splits.save_to_disk(str(tmp_path / "dd"))
    err = _first_read_error(str(tmp_path / "dd"), tiny_data["tokenizer"])
    assert "DatasetDict" in err.message and "splits test, train" in err.message
    assert f"{tmp_path}/dd/test" in err.message
    # one split's folder is a source
    ds = PackedDataset(config([{"uri": str(tmp_path / "dd" / "train")}], tiny_data["tokenizer"]), 16, 7, 512)
    assert ds.next_batch(4)[0].shape == (4, 16)


def test_files_no_format_reads_are_refused_by_name_and_metadata_is_skipped(tmp_path, tiny_data):
    tok = tiny_data["tokenizer"]
    root = Path(write_format(tmp_path / "corpus", "jsonl"))
    for name in ("README.md", "_SUCCESS", ".part-0.jsonl.crc", "LICENSE", "dataset_info.json"):
        (root / name).write_text("{}")
    PackedDataset(config([{"uri": str(root)}], tok), 16, 7, 512).next_batch(4)  # all skipped
    (root / "more.jsonl.bz2").write_bytes(b"BZh9")
    (root / "notes.txt").write_text("plain text")
    err = _first_read_error(str(root), tok)
    assert "no format the trainer reads" in err.message
    assert str(root / "more.jsonl.bz2") in err.message and str(root / "notes.txt") in err.message
    assert f"{root}/*.jsonl" in err.message  # how to name only the shards
    # a glob naming the shards reads them
    PackedDataset(config([{"uri": f"{root}/*.jsonl"}], tok), 16, 7, 512).next_batch(4)


def test_prepare_names_a_shard_that_does_not_parse(tmp_path, tiny_data, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(_jsonl(DOCS))
    (src / "b.jsonl").write_bytes(b'{"text": "x"}\nnot json\n')
    code = prepare_main(["--source", str(src), "--tokenizer", tiny_data["tokenizer"], "--out", str(tmp_path / "out")])
    assert code == 2
    assert f"{src / 'b.jsonl'} line 2 is not JSON" in capsys.readouterr().err


def test_the_format_table_is_the_one_source_of_suffixes():
    assert formats.format_of("s3://b/x/part-1.JSONL.GZ").compression == "gzip"
    assert formats.format_of("a.json").container == "jsonl"
    assert formats.format_of("a.jsonl.bz2") is None
    assert set(formats.SUFFIXES) == {s for f in formats.FORMATS for s in f.suffixes}


def test_listings_skip_what_tools_leave_beside_data_and_keep_data_with_documentation_names(tmp_path, tiny_data):
    """Review findings: hidden and underscore folders (a Hugging Face download's .cache/, Jupyter's
    .ipynb_checkpoints/, Spark's _temporary/) are skipped; a shard named like documentation is
    data; a datasets folder's cache files from a map are not."""
    from trainer.data.packed import list_shards

    root = Path(write_format(tmp_path / "corpus", "jsonl"))
    for junk in (".cache/huggingface/download/part-0.jsonl.metadata", ".ipynb_checkpoints/part-0-checkpoint.jsonl",
                 "_temporary/0/task/part-9.parquet"):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_text("{}")
    (root / "readme-qa.jsonl").write_bytes(_jsonl(["a question", "an answer"]))
    assert [p.rsplit("/", 1)[-1] for p in list_shards(str(root), "data.sources[0].uri")] == \
        ["part-0.jsonl", "part-1.jsonl", "readme-qa.jsonl"]
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": DOCS[:10]}).save_to_disk(str(saved))
    mapped = datasets.load_from_disk(str(saved)).map(lambda row: {"text": row["text"].upper()})
    assert any(f["filename"].startswith(str(saved)) for f in mapped.cache_files)  # the cache file is there
    assert [p.rsplit("/", 1)[-1] for p in list_shards(str(saved), "x")] == ["data-00000-of-00001.arrow"]
    # a state.json cut short would let the cache files read as data: refused by name; one that
    # lists a file the folder lacks (a copy cut short) too; another program's state.json is not ours
    state = saved / "state.json"
    good = state.read_text()
    state.write_text(good[:len(good) // 2])
    with pytest.raises(ConfigError, match="is not a readable datasets state.json"):
        list_shards(str(saved), "x")
    state.write_text(good.replace("data-00000-of-00001.arrow", "data-00000-of-00002.arrow"))
    with pytest.raises(ConfigError, match="lists data files that are not there: data-00000-of-00002.arrow"):
        list_shards(str(saved), "x")
    for other in ('{"step": 3}', '[{"text": "a"}]'):  # found by review: a JSON array is not a datasets state
        state.write_text(other)
        assert "data-00000-of-00001.arrow" in [p.rsplit("/", 1)[-1] for p in list_shards(str(saved), "x")]


def test_malformed_sources_found_by_review_are_named(tmp_path, tiny_data):
    tok = tiny_data["tokenizer"]
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    assert "is a JSON array, not JSON lines" in _first_read_error(str(array), tok).message
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"text": "fine"}\n{"text": "\\ud800"}\n')
    assert "line 2: 'text' is not valid Unicode" in _first_read_error(str(surrogate), tok).message
    deep = tmp_path / "deep.jsonl"  # deeper than json's parser recurses: a named error, not a crash loop
    deep.write_text('{"text": "fine"}\n{"m": ' + "[" * 200_000 + "]" * 200_000 + ', "text": "x"}\n')
    assert "line 2 is JSON nested too deeply to read" in _first_read_error(str(deep), tok).message
    empty = tmp_path / "empty"
    empty.mkdir()
    for k in range(2):
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty / f"part-{k}.parquet")
    assert "none of the 2 shards holds a document" in _first_read_error(str(empty), tok).message
    # categorical (dictionary) and string_view columns are text too
    cats = tmp_path / "cats.parquet"
    pq.write_table(pa.table({"text": pa.array(DOCS[:5]).dictionary_encode()}), cats)
    PackedDataset(config([{"uri": str(cats)}], tok), 16, 7, 512).next_batch(2)
    ndjson = tmp_path / "x.ndjson"
    ndjson.write_bytes(_jsonl(DOCS))
    PackedDataset(config([{"uri": str(ndjson)}], tok), 16, 7, 512).next_batch(2)


def test_object_store_folder_markers_are_not_files():
    """s3fs's find lists the zero-byte keys the S3 console's "Create folder" writes (``dir/``), and
    EMR writes ``dir_$folder$``: neither is a shard nor a file to refuse."""
    from trainer.data.packed import _shards_of

    found = ["bkt/data/a.jsonl", "bkt/data/empty/", "bkt/data/sub/", "bkt/data/sub/b.jsonl", "bkt/data/old_$folder$"]
    assert _shards_of(found, "s3://bkt/data", "data.sources[0].uri", root="bkt/data") == \
        ["bkt/data/a.jsonl", "bkt/data/sub/b.jsonl"]


def test_a_prepared_sources_text_field_is_not_its_position(tmp_path, tiny_data):
    """A prepared source's tokens are made: another textField on it does not move its position."""
    tok = tiny_data["tokenizer"]
    before = config([{"uri": tiny_data["stories_prepared"]}], tok)
    meta = {"dataSources": source_list(before), "textField": "text"}
    after = config([{"uri": tiny_data["stories_prepared"], "textField": "content"}], tok)
    assert changed_data(meta, after, ["prepared"]) is None
    assert changed_data(meta, after, ["raw"])[0] == "data.sources[0].textField"
