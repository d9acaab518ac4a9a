"""The pre-flight check's hang finder (trainer.liveness.find_hung) on real heartbeat files, and a
real Heartbeat's records: which of a pod's ranks hangs, and which only waits for a peer."""

from __future__ import annotations

import json
import os
import time

from trainer import liveness

STALE, LOCAL = liveness.budgets(60)


def record(directory, pid: int, stage: str, since: float, beat: float, local_rank: int = 0) -> None:
    (directory / f"{pid}.json").write_text(json.dumps({"localRank": local_rank, "stage": stage, "since": since,
                                                       "beat": beat}))


def test_budgets_sit_inside_the_checks_timeout():
    for timeout in (30, 60, 300, 3600):
        stale, local = liveness.budgets(timeout)
        assert 0 < stale < timeout and 0 < local < timeout and stale <= 30


def test_a_stale_beat_is_a_hang_in_any_stage(tmp_path):
    now = 1000.0
    record(tmp_path, 11, "gang all-reduce", now - 50, now - STALE - 1, local_rank=1)
    hung = liveness.find_hung(tmp_path, {11: now - 60}, now, STALE, LOCAL)
    assert hung and hung.pid == 11 and hung.local_rank == 1
    assert hung.reason.startswith("local rank 1 stopped responding (no heartbeat for 16s) in the check's gang all-reduce")


def test_a_rank_waiting_on_its_peers_is_never_blamed_however_long(tmp_path):
    now = 1000.0
    record(tmp_path, 11, "gang all-reduce", now - 10 * LOCAL, now - 0.5)
    record(tmp_path, 12, "waiting", now - 10 * LOCAL, now - 0.5)
    assert liveness.find_hung(tmp_path, {11: 0.0, 12: 0.0}, now, STALE, LOCAL) is None


def test_too_long_in_a_stage_that_waits_on_nobody_is_a_hang(tmp_path):
    now = 1000.0
    record(tmp_path, 11, "compute", now - LOCAL + 1, now)
    assert liveness.find_hung(tmp_path, {11: 0.0}, now, STALE, LOCAL) is None
    record(tmp_path, 11, "devices", now - LOCAL - 1, now)
    hung = liveness.find_hung(tmp_path, {11: 0.0}, now, STALE, LOCAL)
    assert hung and "31s in the check's devices stage, which waits on no other rank (at most 30s)" in hung.reason


def test_a_worker_that_never_beats_is_a_hang_once_stale_after_it_was_seen(tmp_path):
    now = 1000.0
    assert liveness.find_hung(tmp_path, {11: now - STALE + 1}, now, STALE, LOCAL) is None
    hung = liveness.find_hung(tmp_path, {11: now - STALE - 1}, now, STALE, LOCAL)
    assert hung and hung.local_rank is None and "wrote no heartbeat" in hung.reason


def test_a_rank_that_left_or_a_torn_record_is_not_a_hang(tmp_path):
    now = 1000.0
    record(tmp_path, 11, liveness.LEFT, 0.0, 0.0)
    (tmp_path / "12.json").write_text('{"stage": "comp')
    assert liveness.find_hung(tmp_path, {11: 0.0, 12: 0.0}, now, STALE, LOCAL) is None


def test_a_real_heartbeat_records_its_stage_and_says_when_it_leaves(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    beat = liveness.Heartbeat(str(tmp_path))
    path = tmp_path / f"{os.getpid()}.json"
    beat.enter("compute")
    first = json.loads(path.read_text())
    assert first["stage"] == "compute" and first["localRank"] == 3
    time.sleep(liveness.BEAT_SECONDS * 1.5)  # the thread beats without being asked
    assert json.loads(path.read_text())["beat"] > first["beat"]
    assert liveness.find_hung(tmp_path, {os.getpid(): 0.0}, time.monotonic(), STALE, LOCAL) is None
    beat.close()
    assert json.loads(path.read_text())["stage"] == liveness.LEFT
    monkeypatch.delenv(liveness.DIR_ENV, raising=False)
    assert liveness.Heartbeat().path is None  # outside a launcher that watches: no file, no thread
