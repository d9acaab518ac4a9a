"""The checkpoint store as on EKS (tier e2e): the operator runs in its own mount namespace and
cannot see the pods' store (tests/e2e/conftest.py); the pods report what they see of it.

- a run survives 4 restarts without a "no progress" failure, and status.lastCheckpoint follows
  the store, though the operator never lists it;
- a damaged newest complete checkpoint: the restarted gang resumes from the previous tag, an
  event names the bad one, and the bad tag stays in the store;
- a store that fills up mid-run: within one checkpoint interval the run's condition and an
  event name the failing saves, lastCheckpoint stays on the last complete tag, and both clear
  once space returns.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from localcluster import drill, faults
from localcluster.drill import Drill

from trainium_api import checkpoints

pytestmark = pytest.mark.e2e

CHECKPOINT_EVERY = 5


def spec(name: str, tiny_data, workdir: Path, steps: int, **groups) -> dict:
    checkpoint = {"intervalSteps": CHECKPOINT_EVERY, "keep": 100, **groups.pop("checkpoint", {})}
    return drill.manifest(name, tiny_data, workdir, training={"steps": steps}, checkpoint=checkpoint,
                          logging={"interval": 5, "progressIntervalSeconds": 1}, **groups)


def finish(d: Drill, timeout: float = 300) -> dict:
    st = d.wait(lambda: (s := d.status()).get("phase") in ("Succeeded", "Failed") and s, timeout, "the run to end")
    assert st["phase"] == "Succeeded", st.get("message")
    return st


def condition(st: dict, ctype: str) -> dict:
    return next((c for c in st.get("conditions") or [] if c["type"] == ctype), {})


def events(e2e, ns: str, reason: str) -> list[str]:
    return [e.message for e in e2e.core.list_namespaced_event(ns).items if e.reason == reason]


def store_step(uri: str) -> int | None:
    newest = checkpoints.newest_complete(uri)
    return newest.step if newest else None


def test_four_restarts_without_a_no_progress_failure_and_last_checkpoint_follows_the_store(e2e, tiny_data, tmp_path):
    """With the operator listing a store it cannot see, each restart looked like one without
    checkpoint progress, and the 4th failed the run ("no progress", noProgressRestarts 3)."""
    ns = e2e.namespace("four-restarts")
    d = Drill(e2e.cluster, ns, spec("four", tiny_data, tmp_path, steps=60))
    d.create()
    d.wait_step(3, 180)
    assert not e2e.operator.sees(d.ckpt_uri) and os.path.isdir(d.ckpt_uri)
    for k in range(4):
        d.wait_step(10 * (k + 1) + 3, 180)
        # the status names what the store holds, reported by the pods
        d.wait(lambda: (d.status().get("lastCheckpoint") or {}).get("step") == store_step(d.ckpt_uri), 20,
               "status.lastCheckpoint to name the store's newest complete checkpoint")
        # index 0's pod, whichever attempt made it (an in-place restart keeps the pods)
        pod = next(p for p in d.pods() if p.metadata.labels.get("trainium.dev/index") == "0"
                   and p.status.phase == "Running" and not p.metadata.deletion_timestamp)
        faults.kill_rank(e2e.cluster.pods_dir, ns, pod.metadata.name)
        d.wait(lambda: d.status().get("restartCount", 0) > k and d.status().get("phase") == "Running", 120,
               f"restart {k + 1} to be running")
    st = finish(d)
    assert st["restarts"] == {"application": 4}, st["restarts"]
    assert st["lastCheckpoint"]["step"] == store_step(d.ckpt_uri) == 60
    assert st["lastCheckpoint"]["uri"] == f"{d.ckpt_uri}/step_60"


def _truncate_a_shard(tag_dir: Path) -> Path:
    shard = sorted((tag_dir / "model").glob("*.pt"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])  # a write cut short (or a lifecycle rule, a hand)
    return shard


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_and_is_named(e2e, tiny_data, tmp_path):
    ns = e2e.namespace("damaged")
    # memory off: an in-place restart would otherwise restore from the nodes' intact memory copies
    d = Drill(e2e.cluster, ns, spec("damaged", tiny_data, tmp_path, steps=80,
                                    checkpoint={"intervalSteps": 20, "memory": "off"}))
    d.create()
    d.wait(lambda: (d.status().get("lastCheckpoint") or {}).get("step") == 40, 300, "checkpoint 40 in the status")
    assert store_step(d.ckpt_uri) == 40
    shard = _truncate_a_shard(Path(d.ckpt_uri) / "step_40")
    d.inject("kill-rank")  # before step 60's save: step_40 is the newest complete tag
    st = d.wait(lambda: (s := d.status()).get("current", {}).get("skippedCheckpoint") and s, 120,
                "the restarted gang to say it skipped the damaged tag")
    assert st["current"]["skippedCheckpoint"].startswith("step_40: ")
    named = d.wait(lambda: events(e2e, ns, "CheckpointSkipped"), 10, "the CheckpointSkipped event")
    assert "step_40" in named[0], named
    assert shard.exists()  # the bad tag is left in place, not deleted
    st = finish(d)
    resumed = [f for f in st["failures"] if f.get("resumedStep") is not None]
    assert resumed and resumed[0]["resumedStep"] == 20, st["failures"]
    assert st["lastCheckpoint"]["step"] == 80


def _fill(path: Path) -> Path:
    """Fills the file system of ``path`` (a file that grows until ENOSPC)."""
    filler = path / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * (1 << 20))
                fh.flush()
        except OSError:  # ENOSPC: the file system is full, as wanted
            return filler


def test_a_store_that_fills_up_is_said_within_one_interval_and_clears_when_space_returns(e2e, tiny_data, tmp_path):
    store = tmp_path / "small-store"
    store.mkdir()
    # a small file system of its own (the pods' mounts are made when they start: after this one)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "trainium-e2e-small-store", str(store)], check=True)
    try:
        ns = e2e.namespace("store-full")
        body = spec("full", tiny_data, tmp_path, steps=60)
        body["spec"]["checkpoint"]["uri"] = str(store / "ckpt")
        d = Drill(e2e.cluster, ns, body)
        d.create()
        d.wait(lambda: ((d.status().get("lastCheckpoint") or {}).get("step") or 0) >= 10, 240, "two checkpoints")
        filler = _fill(store)
        full_at = d.trained_step()
        st = d.wait(lambda: (s := d.status()) and condition(s, "CheckpointsSaving").get("status") == "False" and s,
                    120, "CheckpointsSaving=False")
        said_at = d.trained_step()
        print(f"\nstore full after step {full_at}; CheckpointsSaving=False by step {said_at}: "
              f"{condition(st, 'CheckpointsSaving')['message']}")
        # within one checkpoint interval of the first save that failed (the next one due after the fill)
        first_failed = (full_at // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY
        assert said_at <= first_failed + CHECKPOINT_EVERY, (full_at, said_at)
        assert "No space left" in condition(st, "CheckpointsSaving")["message"]
        # (events are written after the status they describe)
        d.wait(lambda: events(e2e, ns, "CheckpointSavesFailing"), 10, "the CheckpointSavesFailing event")
        assert st["checkpointSaveFailures"] >= 1
        last = st["lastCheckpoint"]["step"]
        assert last == store_step(d.ckpt_uri) and last < first_failed  # the last complete tag, not a failed one
        filler.unlink()
        st = d.wait(lambda: (s := d.status()) and condition(s, "CheckpointsSaving").get("status") == "True" and s,
                    120, "CheckpointsSaving=True once space returned")
        d.wait(lambda: events(e2e, ns, "CheckpointSavesRecovered"), 10, "the CheckpointSavesRecovered event")
        assert st["checkpointSaveFailures"] == 0
        assert st["lastCheckpoint"]["step"] > last
        st = finish(d)
        assert st["lastCheckpoint"]["step"] == 60 and not st.get("failures")
    finally:
        time.sleep(0.5)
        subprocess.run(["umount", "-l", str(store)], check=False)
