import json

import pyarrow as pa
import pytest

from trainer.config import ConfigError, DataConfig, DataSource, from_dict
from trainer.data.packed import PackedDataset, list_shards, read_texts


def dataset(tiny, **kw):
    cfg = from_dict({"data": {"sources": [{"uri": tiny["stories"], "weight": 3}, {"uri": tiny["facts"], "weight": 1}],
                              "tokenizer": tiny["tokenizer"], **kw}})
    return PackedDataset(cfg.data, seq_len=64, seed=7, vocab_size=512)


def test_rows_are_full_and_shifted(tiny_data):
    ds = dataset(tiny_data)
    x, y = ds.next_batch(8)
    assert x.shape == y.shape == (8, 64)
    assert (x[:, 1:] == y[:, :-1]).all()
    assert int(x.max()) < 512


def test_resume_continues_exactly(tiny_data):
    a = dataset(tiny_data)
    a.next_batch(50)
    state = json.loads(json.dumps(a.state()))  # must survive JSON (meta.json)
    expected = a.next_batch(40)
    b = dataset(tiny_data)
    b.load_state(state)
    got = b.next_batch(40)
    assert (got[0] == expected[0]).all() and (got[1] == expected[1]).all()


def test_same_seed_same_stream_and_mixing_weights(tiny_data):
    a, b = dataset(tiny_data), dataset(tiny_data)
    assert (a.next_batch(16)[0] == b.next_batch(16)[0]).all()
    picks = [a._pick_source(n).index for n in range(4000)]
    share = picks.count(0) / len(picks)
    assert 0.72 < share < 0.78  # weight 3:1


def test_epochs_wrap_around_with_a_new_shard_order(tmp_path, tiny_data):
    for i in range(3):
        (tmp_path / f"p{i}.jsonl").write_text("".join(f'{{"text": "doc {i} {j}"}}\n' for j in range(3)))
    cfg = DataConfig(sources=[DataSource(uri=str(tmp_path))], tokenizer=tiny_data["tokenizer"])
    ds = PackedDataset(cfg, 8, 0, 512)
    ds.next_batch(40)
    src = ds.sources[0]
    assert src.pos.epoch >= 2
    assert any(src._order(e) != src._order(0) for e in range(1, 6))


def test_no_packing_pads_and_masks(tiny_data):
    ds = dataset(tiny_data, packing=False)
    x, y = ds.next_batch(4)
    assert (y == -100).any()


def test_a_data_parallel_rank_gets_its_contiguous_slice(tiny_data):
    x, y = dataset(tiny_data).next_batch(8)
    parts = [dataset(tiny_data).next_batch(8, r, 4)[0] for r in range(4)]
    assert all(p.shape[0] == 2 for p in parts)
    assert (parts[1] == x[2:4]).all()


def test_readers_jsonl_parquet_arrow(tmp_path):
    table = pa.table({"text": ["a b", "c d"]})
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    (tmp_path / "f.jsonl").write_text('{"text": "a b"}\n{"text": "c d"}\n')
    assert read_texts(str(tmp_path / "f.arrow"), "text") == ["a b", "c d"]
    assert read_texts(str(tmp_path / "f.jsonl"), "text") == ["a b", "c d"]
    assert list_shards(str(tmp_path / "*.arrow"), "x") == [str(tmp_path / "f.arrow")]


def test_missing_path_and_tokenizer_are_named(tmp_path, tiny_data):
    with pytest.raises(ConfigError) as err:
        list_shards(str(tmp_path / "nothing"), "data.sources[1].uri")
    assert err.value.field == "data.sources[1].uri"
    cfg = DataConfig(sources=[DataSource(uri=tiny_data["stories"])], tokenizer=str(tmp_path / "tok.json"))
    with pytest.raises(ConfigError) as err:
        PackedDataset(cfg, 16, 0, 512)
    assert err.value.field == "data.tokenizer"
    (tmp_path / "tok.json").write_text("{not json")
    with pytest.raises(ConfigError, match="data.tokenizer: cannot read"):
        PackedDataset(cfg, 16, 0, 512)
    cfg = DataConfig(sources=[DataSource(uri=tiny_data["stories"])], tokenizer=tiny_data["tokenizer"])
    with pytest.raises(ConfigError) as err:
        PackedDataset(cfg, 16, 0, 100)
    assert err.value.field == "model.vocabSize"
