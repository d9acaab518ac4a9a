"""The pre-flight check's hang finder (trainer.pod.liveness.find_hung) on real heartbeat files, and a
real Heartbeat's records: which of a pod's ranks hangs, and which only waits for a peer."""

from __future__ import annotations

import json
import os
import time

from trainer.pod import liveness

STALE, LOCAL = liveness.budgets(60)


def record(directory, pid: int, stage: str, since: float, beat: float, local_rank: int = 0) -> None:
    (directory / f"{pid}.json").write_text(json.dumps({"localRank": local_rank, "stage": stage, "since": since,
                                                       "beat": beat}))


def test_budgets_sit_inside_the_checks_timeout():
    for timeout in (30, 60, 300, 3600):
        stale, local = liveness.budgets(timeout)
        assert 0 < stale < timeout and 0 < local < timeout and stale <= 30


def test_a_stopped_rank_with_a_stale_beat_is_a_hang_in_any_stage(tmp_path):
    now = 1000.0
    record(tmp_path, 11, "gang all-reduce", now - 50, now - STALE - 1, local_rank=1)
    hung = liveness.find_hung(tmp_path, {11: now - 60}, now, STALE, LOCAL, {11: "T"})
    assert hung and hung.pid == 11 and hung.local_rank == 1
    assert hung.reason.startswith("local rank 1 stopped responding (no heartbeat for 16s (the process is stopped)) "
                                  "in the check's gang all-reduce")


def test_a_running_rank_whose_beat_stalls_gets_the_local_budget(tmp_path):
    """A long call holding the interpreter's lock (a library loaded from a slow disk) stops the
    beat of a healthy rank: not a hang until the stage budget has passed."""
    now = 1000.0
    record(tmp_path, 11, "rendezvous", now - 50, now - STALE - 1)
    assert liveness.find_hung(tmp_path, {11: 0.0}, now, STALE, LOCAL, {11: "D"}) is None
    record(tmp_path, 11, "rendezvous", now - 50, now - LOCAL - 1)
    hung = liveness.find_hung(tmp_path, {11: 0.0}, now, STALE, LOCAL, {11: "D"})
    assert hung and "no heartbeat for 31s)" in hung.reason


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


def test_a_worker_that_never_beats_is_a_hang_once_its_patience_ran_out(tmp_path):
    now = 1000.0
    assert liveness.find_hung(tmp_path, {11: now - STALE - 1}, now, STALE, LOCAL, {11: "R"}) is None
    hung = liveness.find_hung(tmp_path, {11: now - STALE - 1}, now, STALE, LOCAL, {11: "T"})
    assert hung and hung.local_rank is None and "wrote no heartbeat" in hung.reason
    assert liveness.find_hung(tmp_path, {11: now - LOCAL - 1}, now, STALE, LOCAL, {11: "S"})


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
    deadline = time.monotonic() + liveness.BEAT_SECONDS * 20  # the thread beats without being asked
    while json.loads(path.read_text())["beat"] <= first["beat"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(path.read_text())["beat"] > first["beat"]
    assert liveness.find_hung(tmp_path, {os.getpid(): 0.0}, time.monotonic(), STALE, LOCAL) is None
    beat.close()
    assert json.loads(path.read_text())["stage"] == liveness.LEFT
    monkeypatch.delenv(liveness.DIR_ENV, raising=False)
    assert liveness.Heartbeat().path is None  # outside a launcher that watches: no file, no thread


def test_only_the_launchers_check_ranks_are_judged_with_their_state():
    """live_children: this process's children running the check (their command line), with
    /proc's state; another child (an orphan a tool left, re-parented to a launcher that is PID
    1) is not judged."""
    import signal
    import subprocess
    import sys

    from trainer.pod import proctable
    sleep = "import time; time.sleep(60)"
    rank = subprocess.Popen([sys.executable, "-c", sleep, liveness.CHECK_MODULE])
    other = subprocess.Popen([sys.executable, "-c", sleep, "nccom-test"])
    try:
        deadline = time.monotonic() + 10
        while rank.pid not in (found := proctable.live_children(liveness.CHECK_MODULE)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert other.pid not in found and found[rank.pid] in ("R", "S")
        rank.send_signal(signal.SIGSTOP)
        while proctable.live_children(liveness.CHECK_MODULE).get(rank.pid) not in liveness.STOPPED_STATES:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        for p in (rank, other):
            p.kill()
            p.wait()
    assert rank.pid not in proctable.live_children(liveness.CHECK_MODULE)  # ended
