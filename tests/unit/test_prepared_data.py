"""Prepared (pre-tokenized) data: trainer.data.prepare, trainer.data.prepared and trainer.data.indexed.

The reference for every prepared row is the raw-text reader on the same corpus and tokenizer:
the two must give bitwise the same global batches, so preparing data changes nothing a run
learns. Per-rank reads are checked by what each rank actually read (requests and bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config import ConfigError, from_dict
from trainer.data.packed import PackedDataset
from trainer.data.indexed import decode_index, encode_index
from trainer.data.prepare import main as prepare_main
from trainer.data.prepared import MANIFEST


def config(sources, tokenizer, **data):
    return from_dict({"data": {"sources": sources, "tokenizer": tokenizer, **data}}).data


def mixed(tiny, kind: str) -> list[dict]:
    suffix = "_prepared" if kind == "prepared" else ""
    return [{"uri": tiny["stories" + suffix], "weight": 3}, {"uri": tiny["facts" + suffix], "weight": 1}]


def small_corpus(tmp_path: Path, tokenizer: str) -> tuple[str, str]:
    """Three short shards (one empty) so a few batches wrap several epochs; raw and prepared."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(3):
        docs = [] if i == 1 else [f"the {['cat', 'dog', 'fox'][i]} ran {j} times" * (1 + j % 3) for j in range(5)]
        (raw / f"p{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert prepare_main(["--source", str(raw), "--tokenizer", tokenizer, "--out", str(tmp_path / "prep")]) == 0
    return str(raw), str(tmp_path / "prep")


def batches(ds: PackedDataset, steps: int, rows: int, dp_rank=0, dp=1):
    return [ds.next_batch(rows, dp_rank, dp) for _ in range(steps)]


@pytest.mark.parametrize("packing", [True, False])
def test_prepared_rows_equal_raw_rows_bitwise_across_epochs(tmp_path, tiny_data, packing):
    raw, prep = small_corpus(tmp_path, tiny_data["tokenizer"])
    mix = [{"uri": tiny_data["stories"], "weight": 2}]
    a = PackedDataset(config([{"uri": raw}, *mix], tiny_data["tokenizer"], packing=packing), 16, 3, 512)
    b = PackedDataset(config([{"uri": prep}, *mix], tiny_data["tokenizer"], packing=packing), 16, 3, 512)
    for x, y in zip(batches(a, 12, 8), batches(b, 12, 8)):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    assert a.sources[0].pos.epoch >= 2  # the small source wrapped, with new shard orders


def test_the_global_batch_is_the_same_at_dp_1_2_4_and_each_rank_reads_its_share(tiny_data):
    cfg = config(mixed(tiny_data, "prepared"), tiny_data["tokenizer"])
    whole = PackedDataset(cfg, 64, 7, 512)
    ref = batches(whole, 6, 16)
    for dp in (2, 4):
        ranks = [PackedDataset(cfg, 64, 7, 512) for _ in range(dp)]
        for step, (x, y) in enumerate(ref):
            parts = [r.next_batch(16, i, dp) for i, r in enumerate(ranks)]
            assert torch.equal(torch.cat([p[0] for p in parts]), x), (dp, step)
            assert torch.equal(torch.cat([p[1] for p in parts]), y)
        for r in ranks:
            read = sum(s.bytes_read for s in r.sources)
            assert read == 6 * (16 // dp) * 65 * 2  # its rows' uint16 tokens, nothing more
            assert r.state() == whole.state()  # every rank's position is the global one
    assert sum(s.bytes_read for s in whole.sources) == 6 * 16 * 65 * 2
    # one ranged read per source and step (the rows of a source in a slice are neighbours)
    assert sum(s.requests for s in whole.sources) <= 6 * 2 + 2


def test_raw_text_gives_the_same_global_batch_at_any_dp(tiny_data):
    cfg = config(mixed(tiny_data, "raw"), tiny_data["tokenizer"])
    x, y = PackedDataset(cfg, 64, 7, 512).next_batch(8)
    parts = [PackedDataset(cfg, 64, 7, 512).next_batch(8, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)


@pytest.mark.parametrize("packing", [True, False])
def test_a_prepared_position_resumes_exactly(tiny_data, packing):
    cfg = config(mixed(tiny_data, "prepared"), tiny_data["tokenizer"], packing=packing)
    a = PackedDataset(cfg, 64, 7, 512)
    batches(a, 5, 8)
    state = json.loads(json.dumps(a.state()))
    expected = batches(a, 4, 8, 1, 2)
    b = PackedDataset(cfg, 64, 7, 512)
    b.load_state(state)
    for x, y in zip(batches(b, 4, 8, 1, 2), expected):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_a_position_of_the_other_kind_is_refused_naming_the_source(tiny_data):
    """A checkpoint's position for a source means nothing to a source of the other kind: resume
    refuses it (its meta records the kinds) and loading one anyway names the source."""
    from trainer.loop.train import changed_data
    raw = PackedDataset(config(mixed(tiny_data, "raw"), tiny_data["tokenizer"]), 64, 7, 512)
    prep = PackedDataset(config(mixed(tiny_data, "prepared"), tiny_data["tokenizer"]), 64, 7, 512)
    with pytest.raises(ConfigError) as err:
        prep.load_state(raw.state())
    assert err.value.field == "data.sources[0].uri" and "not a prepared source's position" in str(err.value)
    with pytest.raises(ConfigError, match="data.sources\\[0\\].uri.*not a raw-text position"):
        raw.load_state(prep.state())
    # a directory prepared in place keeps its URI: the kinds saved in the meta tell them apart
    meta = {"dataSources": [{"uri": s.uri} for s in prep.cfg.sources], "dataSourceKinds": raw.kinds}
    field, then, now = changed_data(meta, prep.cfg, prep.kinds)
    assert field == "data.sources" and '"raw"' in then and '"prepared"' in now
    assert changed_data({**meta, "dataSourceKinds": prep.kinds}, prep.cfg, prep.kinds) is None


def test_a_packed_prepared_position_is_a_token_offset_so_another_seq_len_goes_on_like_raw_text(tiny_data):
    """Resuming with another training.seqLen: raw text goes on at the token it stopped at, and
    so does a prepared source (its position counts tokens, not rows)."""
    streams = []
    for kind in ("raw", "prepared"):
        cfg = config(mixed(tiny_data, kind), tiny_data["tokenizer"])
        a = PackedDataset(cfg, 64, 7, 512)
        batches(a, 5, 16)
        b = PackedDataset(cfg, 128, 7, 512)
        b.load_state(json.loads(json.dumps(a.state())))
        streams.append(batches(b, 3, 8))
    for x, y in zip(*streams):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_megatron_reads_our_shards_and_we_read_megatrons(tmp_path, tiny_data):
    """The format is Megatron's own: its IndexedDataset reads our shards document by document,
    and an index its builder wrote decodes to the same documents here."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    prefix = f"{tiny_data['stories_prepared']}/part-00000"
    ours = decode_index(Path(prefix + ".idx").read_bytes(), "ours")
    tokens = np.fromfile(prefix + ".bin", dtype=np.uint16)
    theirs = IndexedDataset(prefix)
    assert len(theirs) == ours.documents
    for d in (0, 1, ours.documents - 1):
        start, length = int(ours.starts[d]), int(ours.lengths[d])
        assert np.array_equal(theirs[d], tokens[start:start + length])

    docs = [np.array([5, 6, 7], dtype=np.int32), np.array([], dtype=np.int32), np.array([9] * 70000, dtype=np.int32)]
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    for doc in docs:
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    read = decode_index((tmp_path / "m.idx").read_bytes(), "m.idx")
    assert read.dtype == np.int32 and list(read.lengths) == [3, 0, 70000] and list(read.starts) == [0, 3, 3]
    assert (tmp_path / "m.idx").read_bytes() == encode_index(np.array([3, 0, 70000]), np.int32)


def test_another_tokenizer_or_end_token_is_refused_naming_the_field(tmp_path, tiny_data):
    other = tmp_path / "other.json"
    other.write_text(Path(tiny_data["tokenizer"]).read_text() + " ")  # the same words, another file
    with pytest.raises(ConfigError) as err:
        PackedDataset(config(mixed(tiny_data, "prepared"), str(other)), 64, 7, 512)
    assert err.value.field == "data.tokenizer" and "another tokenizer" in str(err.value)
    with pytest.raises(ConfigError) as err:
        PackedDataset(config(mixed(tiny_data, "prepared"), tiny_data["tokenizer"], eosToken="<pad>"), 64, 7, 512)
    assert err.value.field == "data.eosToken"


def copy_prepared(src: str, dst: Path) -> str:
    import shutil
    shutil.copytree(src, dst)
    return str(dst)


@pytest.mark.parametrize("damage", ["short-bin", "garbage-idx", "garbage-manifest", "empty", "escaping-name",
                                    "miscounted", "foreign-tokens", "count-types"])
def test_damaged_prepared_data_is_named_not_read(tmp_path, tiny_data, damage):
    root = Path(copy_prepared(tiny_data["facts_prepared"], tmp_path / "facts"))
    manifest = json.loads((root / MANIFEST).read_text())
    if damage == "short-bin":
        data = (root / "part-00000.bin").read_bytes()
        (root / "part-00000.bin").write_bytes(data[:len(data) // 2])
    elif damage == "garbage-idx":
        (root / "part-00001.idx").write_bytes(b"MMIDIDX\x00\x00" + b"\xff" * 40)
    elif damage == "garbage-manifest":
        (root / MANIFEST).write_text('{"format": "megatron-indexed", "version": 1, "shards": 3}')
    elif damage == "empty":
        manifest["shards"] = []
        (root / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "escaping-name":  # a manifest naming another directory's files
        manifest["shards"][0]["name"] = "../stories/part-00000"
        (root / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "miscounted":  # tokens the manifest does not count would be read as others
        manifest["shards"][1]["tokens"] -= 10
        (root / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "foreign-tokens":  # the right size, another vocabulary's ids
        size = (root / "part-00001.bin").stat().st_size
        (root / "part-00001.bin").write_bytes(np.full(size // 2, 60000, dtype=np.uint16).tobytes())
    else:
        manifest["shards"][0]["documents"] = True
        (root / MANIFEST).write_text(json.dumps(manifest))
    cfg = config([{"uri": str(root)}], tiny_data["tokenizer"], packing=damage != "garbage-idx")
    with pytest.raises(ConfigError) as err:
        ds = PackedDataset(cfg, 64, 7, 512)
        batches(ds, 200, 16)  # the damaged shard is reached within two epochs
    assert err.value.field == "data.sources[0].uri", str(err.value)
    if damage in ("short-bin", "miscounted"):
        assert "torn or replaced" in str(err.value)


def test_held_out_sources_are_named_as_held_out(tmp_path, tiny_data):
    from dataclasses import replace

    from trainer.data.packed import heldout_batches
    root = Path(copy_prepared(tiny_data["facts_prepared"], tmp_path / "facts"))
    (root / "part-00000.bin").write_bytes(b"")
    data = replace(config(mixed(tiny_data, "prepared"), tiny_data["tokenizer"]),
                   held_out=config(["x"], tiny_data["tokenizer"], heldOut=[str(root)]).held_out)
    with pytest.raises(ConfigError) as err:
        heldout_batches(data, 64, 7, 512, 8, 1)
    assert err.value.field == "data.heldOut[0].uri"


def test_a_failing_store_is_retried_then_exits_retryable_not_a_verdict_on_the_data(tiny_data, monkeypatch):
    """s3fs raises OSError (EIO) once its own retries of a 5xx or a SlowDown are spent: the read
    is retried (trainer.store.errors), and a store that stays down ends the process RETRYABLE
    (75), never as a fatal data error."""
    import errno

    from trainer.store import errors as store_errors
    from trainium_api import exitcodes
    monkeypatch.setattr(store_errors, "RETRY", store_errors.Backoff(tries=3, first_seconds=0.01, max_seconds=0.02,
                                                                     total_seconds=5, denied_tries=2))
    ds = PackedDataset(config(mixed(tiny_data, "prepared"), tiny_data["tokenizer"]), 64, 7, 512)
    calls = []

    def throttled(*args, **kwargs):  # stands in for the object store, which the test does not own
        calls.append(args)
        raise OSError(errno.EIO, "SlowDown: Please reduce your request rate")
    monkeypatch.setattr(ds.sources[0].fs, "cat_ranges", throttled)
    with pytest.raises(store_errors.StoreUnavailable) as err:
        batches(ds, 4, 16)
    assert err.value.code == exitcodes.RETRYABLE and len(calls) == 3
    assert "failed 3 times" in str(err.value) and "retryable" in str(err.value)


def test_a_source_still_being_prepared_says_so(tmp_path, tiny_data, capsys):
    out = tmp_path / "half"
    assert prepare_main(["--source", tiny_data["stories"], "--tokenizer", tiny_data["tokenizer"], "--out", str(out),
                         "--parts", "4", "--index", "3"]) == 0
    assert "3 of 4 shards are still missing" in capsys.readouterr().out
    with pytest.raises(ConfigError) as err:
        PackedDataset(config([{"uri": str(out)}], tiny_data["tokenizer"]), 64, 7, 512)
    assert err.value.field == "data.sources[0].uri" and "is being prepared" in str(err.value)


def test_prepare_resumes_shares_work_between_parts_and_refuses_mixing(tmp_path, tiny_data, capsys):
    out = tmp_path / "out"
    args = ["--source", tiny_data["stories"], "--tokenizer", tiny_data["tokenizer"], "--out", str(out), "--parts", "2"]
    assert prepare_main([*args, "--index", "0"]) == 0
    assert not (out / MANIFEST).exists()  # part 1's shards are missing: no manifest yet
    assert "this part is done" in capsys.readouterr().out
    (out / "part-00000.bin").write_bytes(b"torn")  # a pod killed mid-write, then restarted
    assert prepare_main([*args, "--index", "1"]) == 0
    assert not (out / MANIFEST).exists()  # part 0's first shard is torn
    assert prepare_main([*args, "--index", "0"]) == 0
    printed = capsys.readouterr().out
    assert "part-00000 tokenized" in printed and "part-00002 already prepared" in printed
    assert (out / MANIFEST).exists()
    assert (out / "part-00000.bin").read_bytes() == \
        (Path(tiny_data["stories_prepared"]) / "part-00000.bin").read_bytes()
    assert json.loads((out / MANIFEST).read_text()) == json.loads(
        (Path(tiny_data["stories_prepared"]) / MANIFEST).read_text())
    # the same directory with another source is refused, naming --out
    assert prepare_main(["--source", tiny_data["facts"], "--tokenizer", tiny_data["tokenizer"],
                         "--out", str(out)]) == 2
    assert "--out" in capsys.readouterr().err
    assert prepare_main([*args, "--index", "2"]) == 2
    # an output inside the source would be read back as raw shards
    assert prepare_main(["--source", str(tmp_path), "--tokenizer", tiny_data["tokenizer"],
                         "--out", str(tmp_path / "inside")]) == 2
    assert "--out" in capsys.readouterr().err and not (tmp_path / "inside").exists()
    assert prepare_main(["--source", tiny_data["stories"], "--tokenizer", str(tmp_path / "nope.json"),
                         "--out", str(tmp_path / "o2")]) == 2
    assert "error: --tokenizer:" in capsys.readouterr().err

