"""trainer.checkpoint.memtier's checks in one process: a memory copy is loaded only for the store's tag,
written by the same save, for this rank's place in the layout, intact, and of this run; else
the store is read. (Peers and bitwise-equal resumes: tests/trainer/test_memory_tier.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import memtier
from trainer.checkpoint.memtier import MANIFEST, STATE, MemoryTier
from trainer.model.parallel import ParallelState
from trainium_api.layout import Layout


def _ps() -> ParallelState:
    layout = Layout(world_size=1, tensor=1, pipeline=1, data=1, grad_accum_steps=1, tokens_per_step=1)
    return ParallelState(backend="cpu", device=torch.device("cpu"), rank=0, world_size=1, local_rank=0, layout=layout,
                         tp_rank=0, dp_rank=0, tp_group=None, dp_group=None, sequence_parallel=False)


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 64, generator=g)}, "optim": {"exp_avg": torch.randn(4096, generator=g),
                                                                         "zero1": False}}


@pytest.fixture
def tier(tmp_path):
    return MemoryTier("auto", str(tmp_path / "store"), _ps(), root=tmp_path / "shm")


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and \
        torch.equal(a["optim"]["exp_avg"], b["optim"]["exp_avg"])


def test_the_same_save_is_restored_from_memory_bitwise(tier):
    state = _state()
    tier.keep("step_6", 6, "[1,2,6]", state)
    got = tier.restore("step_6", 6, "[1,2,6]", False)
    assert (got.source, got.gang_source) == ("memory", "memory")
    assert _equal(got.state, state)


@pytest.mark.parametrize("what, tag, step, save_id", [
    ("another tag (the store's newest complete is older than memory's)", "step_3", 3, "[1,2,3]"),
    ("the same step saved again by another attempt", "step_6", 6, "[1,3,6]"),
    ("a tag written before save ids existed", "step_6", 6, None),
])
def test_a_stale_copy_is_skipped(tier, what, tag, step, save_id):
    tier.keep("step_6", 6, "[1,2,6]", _state())
    got = tier.restore(tag, step, save_id, False)
    assert (got.state, got.source) == (None, "store"), what


def test_a_torn_copy_is_skipped(tier):
    tier.keep("step_6", 6, "[1,2,6]", _state())
    path = tier.own_dir() / STATE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, another digest
    path.write_bytes(bytes(data))
    assert tier.restore("step_6", 6, "[1,2,6]", False).state is None
    path.write_bytes(bytes(data[: len(data) // 2]))  # cut short
    assert tier.restore("step_6", 6, "[1,2,6]", False).state is None


def test_a_write_cut_before_its_manifest_leaves_no_copy(tier):
    tier.keep("step_6", 6, "[1,2,6]", _state())
    (tier.own_dir() / MANIFEST).unlink()  # the manifest is written last: this is a torn write
    assert tier.restore("step_6", 6, "[1,2,6]", False).state is None


def test_a_copy_of_another_rank_or_layout_is_skipped(tier):
    tier.keep("step_6", 6, "[1,2,6]", _state())
    manifest = json.loads((tier.own_dir() / MANIFEST).read_text())
    manifest["coordinates"]["layout"] = [2, 1, 1]  # written under tensor=2
    (tier.own_dir() / MANIFEST).write_text(json.dumps(manifest))
    assert tier.restore("step_6", 6, "[1,2,6]", False).state is None


def test_another_runs_copies_are_never_read(tmp_path, monkeypatch):
    mine = MemoryTier("auto", str(tmp_path / "store"), _ps(), root=tmp_path / "shm")
    mine.keep("step_6", 6, "[1,2,6]", _state())
    other_store = MemoryTier("auto", str(tmp_path / "other-store"), _ps(), root=tmp_path / "shm")
    assert other_store.restore("step_6", 6, "[1,2,6]", False).state is None
    monkeypatch.setenv("TRAINING_RUN", "someone-else")  # same store URI, another run's name
    assert MemoryTier("auto", str(tmp_path / "store"), _ps(), root=tmp_path / "shm").restore(
        "step_6", 6, "[1,2,6]", False).state is None


def test_a_new_save_replaces_the_copy_and_off_keeps_nothing(tmp_path):
    tier = MemoryTier("auto", str(tmp_path / "store"), _ps(), root=tmp_path / "shm")
    tier.keep("step_3", 3, "[1,2,3]", _state(1))
    tier.keep("step_6", 6, "[1,2,6]", _state(2))
    assert tier.restore("step_3", 3, "[1,2,3]", False).state is None  # only the newest is kept
    assert _equal(tier.restore("step_6", 6, "[1,2,6]", False).state, _state(2))
    off = MemoryTier("off", str(tmp_path / "store2"), _ps(), root=tmp_path / "shm2")
    off.keep("step_6", 6, "[1,2,6]", _state())
    assert not (tmp_path / "shm2").exists() and off.restore("step_6", 6, "[1,2,6]", False).source == "store"


def test_a_copy_that_does_not_fit_is_not_kept(tier, monkeypatch, caplog):
    monkeypatch.setattr(memtier, "_mem_available", lambda: 1000)  # 1 kB free: the state does not fit
    tier.keep("step_6", 6, "[1,2,6]", _state())
    assert not (tier.own_dir() / MANIFEST).exists()
    assert "memory tier off for this save" in caplog.text
    assert tier.restore("step_6", 6, "[1,2,6]", False).state is None


def test_outside_a_pod_the_tier_needs_a_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(memtier.DIR_ENV, raising=False)
    monkeypatch.delenv("TRAINING_RUN", raising=False)
    assert not MemoryTier("auto", str(tmp_path / "store"), _ps()).on  # nothing left in a shared /dev/shm
    monkeypatch.setenv("TRAINING_RUN", "r")
    assert MemoryTier("auto", str(tmp_path / "store"), _ps()).base.parent == memtier.Path(memtier.POD_DIR)


def test_a_save_that_does_not_fit_still_removes_the_older_copy(tier, monkeypatch):
    tier.keep("step_3", 3, "a", _state(1))
    monkeypatch.setattr(memtier, "_mem_available", lambda: 1000)
    tier.keep("step_6", 6, "b", _state(2))  # not kept, and step_3's copy is gone too
    assert not tier.own_dir().exists()


def test_a_copy_that_is_not_plain_tensors_is_not_unpickled(tier):
    """The memory directory is writable by anything in the pod: a copy is loaded with
    weights_only, so a crafted pickle runs nothing and that rank reads the store."""
    import pickle

    class Boom:
        def __reduce__(self):
            return (exec, ("open('/tmp/memtier-pwned', 'w').write('x')",))
    tier.keep("step_6", 6, "a", _state())
    state = tier.own_dir() / STATE
    torch.save({"model": {"w": torch.zeros(1)}, "optim": Boom()}, state, pickle_module=pickle)
    manifest = json.loads((tier.own_dir() / MANIFEST).read_text())
    manifest.update(size=state.stat().st_size, xxh3=memtier.digest_of(state))  # the attacker rewrote both
    (tier.own_dir() / MANIFEST).write_text(json.dumps(manifest))
    got = tier.restore("step_6", 6, "a", False)
    assert (got.state, got.source) == (None, "store")
    assert not Path("/tmp/memtier-pwned").exists()


def test_without_zero1_a_data_rank_above_0_keeps_nothing(tmp_path):
    ps = _ps()
    ps.dp_rank = 1  # its optimizer state is not what the store holds for it (data rank 0's)
    tier = MemoryTier("auto", str(tmp_path / "store"), ps, root=tmp_path / "shm")
    tier.keep("step_6", 6, "a", _state())
    assert not (tier.own_dir() / MANIFEST).exists()
    zero1 = _state()
    zero1["optim"]["zero1"] = True
    tier.keep("step_6", 6, "a", zero1)
    assert tier.restore("step_6", 6, "a", True).source == "memory"
