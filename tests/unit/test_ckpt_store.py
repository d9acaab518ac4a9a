import json
import os
import time

from trainer.checkpoint import ckpt_store
from trainium_api import checkpoints


def make_tag(root, step, done=True, meta=True):
    d = root / f"step_{step}"
    (d / "model").mkdir(parents=True)
    (d / "checkpoint").write_text("")
    (d / "model" / ckpt_store.shard_name(0, 0)).write_bytes(b"x")
    if meta:
        (d / "meta.json").write_text(json.dumps({"step": step, "tokens": step * 10}))
    if done:
        (d / "done").write_text("")
        t = 1_700_000_000 + step
        os.utime(d / "done", (t, t))
    return d


def test_newest_complete_ignores_tags_without_done(tmp_path):
    make_tag(tmp_path, 2)
    make_tag(tmp_path, 4)
    make_tag(tmp_path, 6, done=False)
    (tmp_path / "unrelated").mkdir()
    newest = checkpoints.newest_complete(str(tmp_path))
    assert newest.tag == "step_4" and newest.step == 4 and newest.meta["tokens"] == 40
    assert [t.tag for t in checkpoints.list_tags(str(tmp_path))] == ["step_2", "step_4", "step_6"]


def test_no_checkpoints(tmp_path):
    assert checkpoints.newest_complete(str(tmp_path)) is None
    assert checkpoints.newest_complete(str(tmp_path / "absent")) is None


def test_retention_never_deletes_newest_complete(tmp_path):
    for s in (2, 4, 6, 8):
        make_tag(tmp_path, s)
    make_tag(tmp_path, 10, done=False)  # in flight: must survive
    deleted = ckpt_store.apply_retention(str(tmp_path), keep=2)
    assert deleted == ["step_2", "step_4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_6", "step_8"]
    # keep=1 keeps the newest two complete (a damaged newest falls back to the one before:
    # ckpt_store.MIN_KEEP); an older torn tag is cleaned.
    make_tag(tmp_path, 7, done=False)
    ckpt_store.apply_retention(str(tmp_path), keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_6", "step_8"]
    make_tag(tmp_path, 12)
    assert ckpt_store.apply_retention(str(tmp_path), keep=1) == ["step_6", "step_10"]  # (10: torn)


def test_retention_victims_pure():
    T = checkpoints.TagInfo
    tags = [T("step_1", "", 1, True), T("step_2", "", 2, False), T("step_3", "", 3, True)]
    assert [t.tag for t in ckpt_store.retention_victims(tags, keep=1)] == ["step_2"]  # two complete stay
    tags.append(T("step_4", "", 4, True))
    assert [t.tag for t in ckpt_store.retention_victims(tags, keep=1)] == ["step_1", "step_2"]
    assert ckpt_store.retention_victims(tags, keep=0) == [tags[1]]  # keep all complete
    assert ckpt_store.retention_victims([T("step_5", "", 5, False)], keep=1) == []


def test_delete_removes_done_first(tmp_path, monkeypatch):
    make_tag(tmp_path, 3)
    order = []
    import fsspec.implementations.local as local
    real_rm_file = local.LocalFileSystem.rm_file
    monkeypatch.setattr(local.LocalFileSystem, "rm_file",
                        lambda self, p: (order.append(os.path.basename(p)), real_rm_file(self, p))[1])
    ckpt_store.delete_tag(str(tmp_path), "step_3")
    assert order[0] == "done" and not (tmp_path / "step_3").exists()


def test_store_imports_no_torch():
    import subprocess
    import sys
    code = "import sys, trainer.checkpoint.ckpt_store, trainer.config, trainer.contract.progress; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def make_nxd_tag(root, name, done_time=None, done=True):
    """A tag as NxD's save_checkpoint leaves it (no meta.json); ``done_time`` sets its marker's mtime."""
    d = root / name
    (d / "model").mkdir(parents=True)
    (d / "checkpoint").write_text("")
    (d / "model" / ckpt_store.shard_name(0, 0)).write_bytes(b"x")
    (d / "user_content.pt").write_bytes(b"x")
    if done:
        (d / "done").write_text("")
        os.utime(d / "done", (done_time, done_time))
    os.utime(d, (done_time or 1_800_000_000, done_time or 1_800_000_000))
    return d


def test_nxd_layout_takes_the_newest_done_marker_and_never_a_torn_tag(tmp_path):
    make_nxd_tag(tmp_path, "step_100", 1_700_000_100)
    make_nxd_tag(tmp_path, "step_200", 1_700_000_300)  # its `done` written last (async: at the next save)
    make_nxd_tag(tmp_path, "step_300", 1_700_000_200)
    make_nxd_tag(tmp_path, "step_400", done=False)  # torn: newest and highest, no `done`
    make_nxd_tag(tmp_path, "pretrained_weight", done=False)
    newest = checkpoints.newest_complete(str(tmp_path), "nxd")
    assert (newest.tag, newest.step) == ("step_200", 200)  # what nxd.load_checkpoint(tag=None) loads
    make_nxd_tag(tmp_path, "my_tag", 1_700_000_400)  # a name without a step still counts, as for NxD
    newest = checkpoints.newest_complete(str(tmp_path), "nxd")
    assert (newest.tag, newest.step) == ("my_tag", None)


def test_nxdt_layout_takes_the_highest_complete_step_and_never_a_torn_checkpoint(tmp_path):
    make_nxd_tag(tmp_path, "hf_llama--step=10-consumed_samples=10240.0.ckpt", 1_700_000_010)
    make_nxd_tag(tmp_path, "hf_llama--step=20-consumed_samples=20480.0.ckpt", 1_700_000_020)
    # torn: the newest .ckpt by mtime, which NxDT's own resume would pick
    make_nxd_tag(tmp_path, "hf_llama--step=30-consumed_samples=30720.0.ckpt", done=False)
    (tmp_path / "hf_llama--step=30-consumed_samples=30720.0.ckpt").touch()
    make_nxd_tag(tmp_path, "step_40", 1_700_000_040)  # not an NxDT checkpoint name
    newest = checkpoints.newest_complete(str(tmp_path), "nxdt")
    assert (newest.tag, newest.step) == ("hf_llama--step=20-consumed_samples=20480.0.ckpt", 20)
    assert newest.uri == str(tmp_path / newest.tag)
    tags = checkpoints.list_tags(str(tmp_path), layout="nxdt")
    assert [(t.step, t.complete) for t in tags] == [(10, True), (20, True), (30, False)]


def test_unknown_layout_is_refused(tmp_path):
    import pytest
    with pytest.raises(ValueError, match="unknown checkpoint layout"):
        checkpoints.newest_complete(str(tmp_path), "megatron")


# -- fencing across attempts ------------------------------------------------------------------

def _tag_of(root, step, writer):
    d = make_tag(root, step)
    (d / "meta.json").write_text(json.dumps({"step": step, "writer": list(writer)}))


def test_a_tag_a_fenced_gang_completed_after_the_fence_is_neither_resumed_nor_kept(tmp_path):
    root, run = str(tmp_path), 1_800_000_000
    _tag_of(tmp_path, 10, (run, 1))
    complete = [t for t in checkpoints.list_tags(root) if t.complete]
    checkpoints.raise_fence(root, (run, 2), complete)  # attempt 2's gang starts: it saw step_10
    checkpoints.raise_fence(root, (run, 2), [])  # never rewritten
    assert checkpoints.fences(root) == [(run, 2)]
    _tag_of(tmp_path, 20, (run, 1))  # attempt 1, cut off, completed step 20 after the fence
    assert checkpoints.newer_fence(root, (run, 1)) == (run, 2) and checkpoints.newer_fence(root, (run, 2)) is None
    assert checkpoints.newest_complete(root).tag == "step_10"  # whatever the files' clocks say
    _tag_of(tmp_path, 30, (run, 2))  # attempt 2's own, complete
    assert checkpoints.newest_complete(root).tag == "step_30"
    # retention counts the late tag as a torn save: kept while newer than every complete one
    # (above), deleted once older; the newest complete is never deleted, nor the one before it
    assert ckpt_store.apply_retention(root, keep=1) == ["step_20"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoints.FENCE, "step_10", "step_30"]


def test_a_run_created_again_on_the_same_store_fences_every_gang_of_the_old_one(tmp_path):
    root, old_run, new_run = str(tmp_path), 1_800_000_000, 1_800_000_500
    _tag_of(tmp_path, 10, (old_run, 7))
    checkpoints.raise_fence(root, (old_run, 7), [])
    checkpoints.raise_fence(root, (new_run, 1), [t for t in checkpoints.list_tags(root) if t.complete])
    assert checkpoints.newer_fence(root, (old_run, 7)) == (new_run, 1)  # the old run's gang stops
    assert checkpoints.newer_fence(root, (new_run, 1)) is None  # the new run's attempt 1 is not fenced by 7
    assert checkpoints.newest_complete(root).tag == "step_10"  # and resumes from the old run's checkpoint


def test_an_unreadable_fence_makes_no_good_checkpoint_look_late(tmp_path):
    root = str(tmp_path)
    _tag_of(tmp_path, 10, (1, 1))
    (tmp_path / checkpoints.FENCE).mkdir()
    (tmp_path / checkpoints.FENCE / "run_1_attempt_2").write_text("garbage")
    assert checkpoints.newest_complete(root).tag == "step_10"
    assert ckpt_store.apply_retention(root, keep=1) == []


def test_a_gang_fenced_by_a_newer_attempt_writes_and_deletes_nothing_and_stops(tmp_path):
    """The trainer's writer (trainer.checkpoint.checkpointer.Checkpointer, one process): attempt 1 saves;
    attempt 2 starts (raises its fence, resumes from step 20); attempt 1's next save begins
    nothing, completes nothing, deletes nothing, and asks the loop to stop. Attempt 2 rewriting
    a tag that has a done removes it before writing anything."""
    import threading
    from types import SimpleNamespace

    import torch

    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.config import CheckpointConfig
    ps = SimpleNamespace(rank=0, dp_rank=0, tp_rank=0, pp_rank=0, is_distributed=False)
    root = tmp_path / "ckpt"
    cfg = CheckpointConfig(uri=str(root), keep=1, async_save=True)
    layout = {"tensor": 1, "pipeline": 1, "data": 1, "zero1": False}

    def save(ck, step):
        ck.save(step, {"w": torch.full((2,), float(step))}, {"state": {}}, {}, {}, {"step": step, "layout": layout})
        ck.wait()
        return ck.results[-1]
    stopped = threading.Event()
    old = Checkpointer(cfg, ps, epoch=(5, 1), on_fenced=stopped.set)
    assert old.select_resume() is None and checkpoints.fences(str(root)) == [(5, 1)]
    assert save(old, 10).ok and save(old, 20).ok  # keep=1 keeps two complete tags (ckpt_store.MIN_KEEP)
    new = Checkpointer(cfg, ps, epoch=(5, 2))
    assert new.select_resume().tag == "step_20"
    late = save(old, 30)
    assert not late.ok and late.error == "fenced by attempt 2" and stopped.is_set() and old.fenced_by == (5, 2)
    assert not (root / "step_30").exists()  # not even a begin marker
    assert sorted(p.name for p in root.iterdir()) == [checkpoints.FENCE, "step_10", "step_20"]  # nothing deleted
    # attempt 2 rewrites step_20 (say it resumed from an older tag): done goes first
    new.fault_delay = 3.0  # every write waits between the begin marker and the shards
    new.save(20, {"w": torch.zeros(2)}, {"state": {}}, {}, {}, {"step": 20, "layout": layout})
    def begun_by():  # (the old writer's marker until the new one is written, whole: no torn read)
        try:
            return json.loads((root / "step_20" / checkpoints.BEGIN).read_text())
        except (OSError, ValueError):
            return None
    deadline = time.monotonic() + 30
    while begun_by() != {"writer": [5, 2]} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (root / "step_20" / checkpoints.DONE).exists()  # in flight: step_20 does not count
    assert begun_by() == {"writer": [5, 2]}
    new.wait()
    assert new.results[-1].ok and checkpoints.newest_complete(str(root)).writer == (5, 2)
