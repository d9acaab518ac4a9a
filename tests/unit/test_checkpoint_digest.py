"""Damaged checkpoints: each file's size and xxh3 recorded at save (trainer.checkpoint.store_write, meta.json's
``digests``), checked at restore (trainer.checkpoint.checkpointer.Checkpointer.load), a damaged tag skipped for
the previous complete one (it stays in the store), none left exits retryable; retention keeps two
complete tags. One real process writing and reading a real local store (and fsspec's memory
file system for the read-whole path); the two-rank agreement runs in
tests/trainer/test_damaged_checkpoint.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import fsspec
import pytest
import torch
import xxhash

from trainer.checkpoint import ckpt_store, store_write
from trainer.checkpoint.checkpointer import DIGESTS, Checkpointer, NoIntactCheckpoint
from trainer.config import CheckpointConfig, ConfigError
from trainium_api import checkpoints, exitcodes
from trainium_api.progress import SkippedCheckpoint

LAYOUT = {"tensor": 1, "pipeline": 1, "data": 1, "zero1": False}
PS = SimpleNamespace(rank=0, dp_rank=0, tp_rank=0, pp_rank=0, world_size=1, is_distributed=False)
MODEL = f"model/{ckpt_store.shard_name(0, 0)}"
OPTIM = f"optim/{ckpt_store.shard_name(0, 0)}"


@pytest.fixture(autouse=True)
def _no_memory_tier(monkeypatch):
    monkeypatch.delenv("TRAINER_MEMORY_DIR", raising=False)
    monkeypatch.delenv("TRAINING_RUN", raising=False)


def _checkpointer(uri: str, **cfg) -> Checkpointer:
    return Checkpointer(CheckpointConfig(uri=uri, async_save=False, **{"keep": 0, **cfg}), PS)


def _save(ck: Checkpointer, step: int) -> None:
    model = {"w": torch.arange(1000, dtype=torch.float32) * step}
    optim = {"state": {"m": torch.full((500,), float(step))}, "zero1": False}
    result = ck.save(step, model, optim, {"last_step": step}, {"step": step}, {"step": step, "layout": LAYOUT})
    assert result.ok, result.error


def _store(tmp_path, steps=(4, 8)) -> Checkpointer:
    ck = _checkpointer(str(tmp_path / "ckpt"))
    for step in steps:
        _save(ck, step)
    return ck


def _load(ck: Checkpointer) -> dict:
    return ck.load(ck.select_resume(), {"tensor": 1, "pipeline": 1, "data": 1})


# -- recording ----------------------------------------------------------------------------------

def test_save_torch_records_exactly_the_bytes_written(tmp_path):
    fs = fsspec.filesystem("file")
    obj = {"w": torch.randn(4096), "step": 3}
    record = store_write.save_torch(fs, str(tmp_path / "a.pt"), obj)
    data = (tmp_path / "a.pt").read_bytes()
    assert record == {"size": len(data), "xxh3": xxhash.xxh3_64_hexdigest(data)}
    assert record == store_write.record_of(data) == store_write.local_record(str(tmp_path / "a.pt"))
    assert torch.equal(torch.load(tmp_path / "a.pt")["w"], obj["w"])
    # through another file system's own open (no fsync, no S3 parts): the same record
    mem = fsspec.filesystem("memory")
    assert store_write.save_torch(mem, "/digest-test/a.pt", obj)["size"] == mem.size("/digest-test/a.pt")
    assert store_write.save_torch(mem, "/digest-test/a.pt", obj) == store_write.record_of(
        mem.cat_file("/digest-test/a.pt"))
    mem.rm("/digest-test", recursive=True)


def test_mismatch_names_the_file_and_what_differs():
    good = store_write.record_of(b"abcdef")
    assert store_write.mismatch("x.pt", good, store_write.record_of(b"abcdef")) is None
    assert store_write.mismatch("x.pt", good, store_write.record_of(b"abc")) == "x.pt is 3 bytes, 6 when written"
    why = store_write.mismatch("x.pt", good, store_write.record_of(b"abcdeX"))
    assert why.startswith("x.pt has xxh3 ") and "changed since" in why


def test_meta_records_every_file_of_the_tag(tmp_path):
    _store(tmp_path, steps=(4,))
    tag = tmp_path / "ckpt" / "step_4"
    meta = json.loads((tag / checkpoints.META).read_text())
    # every file but meta.json itself (it cannot hold its own digest; a torn one does not parse)
    assert sorted(meta[DIGESTS]) == sorted(f for f in meta["files"] if f != checkpoints.META)
    for name, record in meta[DIGESTS].items():
        assert record == store_write.record_of((tag / name).read_bytes()), name


# -- verification and fallback ------------------------------------------------------------------

def _truncate(path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a tensor's bytes: the size stays, torch.load does not notice
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, file, why", [
    ("truncate", MODEL, f"{MODEL} is 100 bytes, "),
    ("delete", OPTIM, f"{OPTIM} is missing"),
    ("flip", "user_content.pt", "user_content.pt has xxh3"),
    ("truncate", checkpoints.META, "meta.json: cannot read or parse it"),
])
def test_a_damaged_newest_tag_falls_back_to_the_previous_and_stays(tmp_path, caplog, damage, file, why):
    ck = _store(tmp_path)
    path = tmp_path / "ckpt" / "step_8" / file
    {"truncate": _truncate, "delete": lambda p: p.unlink(), "flip": _flip}[damage](path)
    state = _load(ck)
    assert state["tag"].tag == "step_4" and state["meta"]["step"] == 4
    assert torch.equal(state["model"]["w"], torch.arange(1000, dtype=torch.float32) * 4)
    assert isinstance(ck.skipped, SkippedCheckpoint) and ck.skipped.tag == "step_8"
    assert why in ck.skipped.error and "\n" not in ck.skipped.error
    assert (tmp_path / "ckpt" / "step_8" / checkpoints.DONE).exists()  # not deleted
    # but marked: the next restart does not check it again, retention neither keeps nor deletes it
    marker = json.loads((tmp_path / "ckpt" / "step_8" / checkpoints.DAMAGED).read_text())
    assert why in marker["reason"]
    tags = {t.tag: t for t in checkpoints.list_tags(str(tmp_path / "ckpt"))}
    assert tags["step_8"].damaged and not tags["step_8"].complete
    assert checkpoints.newest_complete(str(tmp_path / "ckpt")).tag == "step_4"
    assert ckpt_store.retention_victims(list(tags.values()), 1) == []
    assert any("checkpoint step_8 is damaged" in r.message and "falling back to step_4" in r.message
               for r in caplog.records)


def test_an_intact_newest_tag_loads_and_skips_nothing(tmp_path):
    ck = _store(tmp_path)
    state = _load(ck)
    assert state["tag"].tag == "step_8" and ck.skipped is None
    assert state["scheduler"] == {"last_step": 8} and state["optim"]["state"]["m"][0] == 8.0


def test_a_tag_written_before_records_is_trusted(tmp_path):
    ck = _store(tmp_path)
    meta_path = tmp_path / "ckpt" / "step_8" / checkpoints.META
    meta = json.loads(meta_path.read_text())
    del meta[DIGESTS]
    meta_path.write_text(json.dumps(meta))
    _flip(tmp_path / "ckpt" / "step_8" / MODEL)  # unnoticed without a record: loaded as it is
    state = _load(ck)
    assert state["tag"].tag == "step_8" and ck.skipped is None
    assert not torch.equal(state["model"]["w"], torch.arange(1000, dtype=torch.float32) * 8)
    _truncate(tmp_path / "ckpt" / "step_8" / MODEL)  # but a file that does not parse is damage
    assert _load(ck)["tag"].tag == "step_4" and "cannot read or parse" in ck.skipped.error


def test_a_record_missing_from_a_tag_with_records_is_damage(tmp_path):
    ck = _store(tmp_path)
    meta_path = tmp_path / "ckpt" / "step_8" / checkpoints.META
    meta = json.loads(meta_path.read_text())
    del meta[DIGESTS][OPTIM]
    meta_path.write_text(json.dumps(meta))
    assert _load(ck)["tag"].tag == "step_4"
    assert ck.skipped.error == f"meta.json has no record of {OPTIM}"


def test_every_complete_tag_damaged_exits_retryable_and_deletes_nothing(tmp_path):
    ck = _store(tmp_path, steps=(4, 8, 12))
    for step in (4, 8, 12):
        (tmp_path / "ckpt" / f"step_{step}" / MODEL).unlink()
    with pytest.raises(NoIntactCheckpoint) as err:
        _load(ck)
    assert err.value.code == exitcodes.RETRYABLE
    assert str(err.value).startswith(f"no complete checkpoint under {tmp_path / 'ckpt'} loads: step_12 (")
    assert "step_8 (" in str(err.value) and "step_4 (" in str(err.value)
    assert ck.skipped.tag == "step_12"
    tags = checkpoints.list_tags(str(tmp_path / "ckpt"))
    assert [t.tag for t in tags if t.damaged] == ["step_4", "step_8", "step_12"]
    assert all((tmp_path / "ckpt" / t.tag / checkpoints.DONE).exists() for t in tags)
    # the next restart does not start from step 0 over them either
    with pytest.raises(NoIntactCheckpoint, match="was found damaged by an earlier restore"):
        ck.select_resume()


def test_a_tag_named_in_resume_is_not_replaced_by_an_older_one(tmp_path):
    _store(tmp_path)
    (tmp_path / "ckpt" / "step_8" / MODEL).unlink()
    ck = _checkpointer(str(tmp_path / "ckpt"), resume="step_8")
    with pytest.raises(NoIntactCheckpoint, match=f"step_8 \\(.*{MODEL} is missing"):
        _load(ck)


def test_the_fallback_obeys_the_fencing_rules(tmp_path):
    """A tag a fenced gang completed after the fence is never resumed from, nor fallen back to."""
    root = tmp_path / "ckpt"

    def gang(epoch):
        return Checkpointer(CheckpointConfig(uri=str(root), async_save=False, keep=0), PS, epoch=epoch)
    _save(gang((5, 1)), 4)
    new = gang((5, 2))
    assert new.select_resume().tag == "step_4"  # attempt 2's fence lists step_4
    _save(gang(None), 6)  # attempt 1, cut off, completes step_6 after the fence (its writer set below)
    meta_path = root / "step_6" / checkpoints.META
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "writer": [5, 1]}))
    _save(new, 8)
    (root / "step_8" / MODEL).unlink()
    assert checkpoints.complete_before(str(root), 8).tag == "step_4"
    assert checkpoints.complete_before(str(root), 4) is None
    assert new.load(checkpoints.newest_complete(str(root)), {"tensor": 1, "pipeline": 1, "data": 1})["tag"].tag \
        == "step_4"


def test_a_layout_change_is_still_a_config_error_not_damage(tmp_path):
    ck = _store(tmp_path)
    with pytest.raises(ConfigError, match="parallelism.tensor"):
        ck.load(ck.select_resume(), {"tensor": 2, "pipeline": 1, "data": 1})


def test_init_from_a_damaged_tag_is_refused_by_name(tmp_path):
    from trainer.config import ModelConfig
    _store(tmp_path)
    _truncate(tmp_path / "ckpt" / "step_8" / MODEL)
    with pytest.raises(ConfigError, match=f"init.from: .*step_8 is damaged: {MODEL} is 100 bytes"):
        Checkpointer.read_model_shard(str(tmp_path / "ckpt" / "step_8"), ModelConfig(), 1, 0)


def test_read_whole_stores_are_checked_too(tmp_path):
    """A store that is not a local file system (S3's path): each file is read whole, then checked."""
    mem = fsspec.filesystem("memory")
    _store(tmp_path)
    mem.put(str(tmp_path / "ckpt"), "/digest-store/ckpt", recursive=True)
    try:
        mem.pipe_file("/digest-store/ckpt/step_8/" + MODEL, mem.cat_file("/digest-store/ckpt/step_8/" + MODEL)[:-1])
        remote = _checkpointer("memory://digest-store/ckpt")
        assert not store_write.is_local(remote.fs)
        assert _load(remote)["tag"].tag == "step_4"
        size = (tmp_path / "ckpt" / "step_8" / MODEL).stat().st_size
        assert remote.skipped.error == f"{MODEL} is {size - 1} bytes, {size} when written"
    finally:
        mem.rm("/digest-store", recursive=True)


# -- retention ------------------------------------------------------------------------------------

def test_retention_keeps_two_complete_tags_whatever_keep_says():
    T = checkpoints.TagInfo
    tags = [T(f"step_{s}", "", s, True) for s in (1, 2, 3, 4)]
    assert [t.tag for t in ckpt_store.retention_victims(tags, keep=1)] == ["step_1", "step_2"]
    assert [t.tag for t in ckpt_store.retention_victims(tags, keep=2)] == ["step_1", "step_2"]
    assert [t.tag for t in ckpt_store.retention_victims(tags, keep=3)] == ["step_1"]
    assert ckpt_store.retention_victims(tags[:2], keep=1) == []
    assert ckpt_store.retention_victims(tags, keep=0) == []  # keep all


def test_a_save_with_keep_1_leaves_the_previous_complete_tag_to_fall_back_to(tmp_path):
    ck = _checkpointer(str(tmp_path / "ckpt"), keep=1)
    for step in (2, 4, 6):
        _save(ck, step)
    assert [t.tag for t in checkpoints.list_tags(str(tmp_path / "ckpt"))] == ["step_4", "step_6"]
    (tmp_path / "ckpt" / "step_6" / MODEL).unlink()
    assert _load(ck)["tag"].tag == "step_4"
