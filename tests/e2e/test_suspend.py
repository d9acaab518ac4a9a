"""spec.suspend as a Job's (Kueue sets it), under the operator with the real trainer's processes
(issue 22): suspending stops the gang gracefully (SIGTERM, exit 143, no failure recorded), the
time suspended is neither productive nor lost in goodput, and resuming starts a new attempt from
the newest complete checkpoint; the run then finishes every step once."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from localcluster import drill
from localcluster.drill import Drill

pytestmark = pytest.mark.e2e
STEPS = 40
SUSPEND_AT = 12
SUSPENDED_FOR = 8.0  # seconds the run stays suspended once its gang is gone


def test_suspend_and_resume_keep_goodput_and_resume_from_the_newest_checkpoint(e2e, tiny_data, tmp_path):
    body = drill.manifest("pause", tiny_data, tmp_path, training={"steps": STEPS},
                          checkpoint={"intervalSteps": 5, "keep": 100},
                          logging={"interval": 5, "progressIntervalSeconds": 1})
    ns = e2e.namespace("suspend")
    d = Drill(e2e.cluster, ns, body)
    d.create()
    d.wait_step(SUSPEND_AT, 240)
    d.custom.patch_namespaced_custom_object(drill.GROUP, drill.VERSION, ns, drill.PLURAL, d.name,
                                            {"spec": {"suspend": True}})
    suspended_at = time.time()
    st = d.wait(lambda: (s := d.status()).get("phase") == "Suspended" and not d.pods() and s, 90,
                "Suspended with every pod gone")
    stopped_step = d.trained_step()
    gone = time.time()
    stops = _sigterm_stops(e2e.cluster.pods_dir, ns)
    wall_then = st["goodput"]["wallSeconds"]
    time.sleep(SUSPENDED_FOR)
    st = d.status()
    assert st["phase"] == "Suspended" and st["goodput"]["wallSeconds"] == wall_then  # the clock stood still
    d.custom.patch_namespaced_custom_object(drill.GROUP, drill.VERSION, ns, drill.PLURAL, d.name,
                                            {"spec": {"suspend": False}})
    st = d.wait(lambda: (s := d.status()).get("phase") in ("Succeeded", "Failed") and s, 300, "the run to end")
    assert st["phase"] == "Succeeded", st.get("message")
    truth = drill.ground_truth(d.losses_path, st["createdTime"])
    paused = st["suspension"]["seconds"]
    gp = st["goodput"]
    true_ratio = truth.productive_seconds / (truth.wall_seconds - paused)
    print(f"\nsuspended at step {stopped_step} ({gone - suspended_at:.1f}s to stop the gang), for {paused:.1f}s; "
          f"resumed from step {st['current']['resumeCheckpoint']['step']}; goodput status {gp['effectiveRatio']:.3f} "
          f"vs truth {true_ratio:.3f} (wall {gp['wallSeconds']}s vs {truth.wall_seconds - paused:.1f}s); lost "
          f"{gp['lostSeconds']}; suspension {st['suspension']}; trainer: {stops}")
    # a suspension is no failure; the gang got SIGTERM and the trainer saved the step it stopped at
    assert not st.get("failures") and not st.get("restarts") and st["attempt"] == 2
    assert stops and all(s.startswith(f"stopping after step {stopped_step}, ") for s in stops), stops
    # the time suspended left the wall time; the gang's restart after the resume is lost time
    assert SUSPENDED_FOR <= paused <= SUSPENDED_FOR + (gone - suspended_at) + 5
    assert abs(gp["wallSeconds"] - (truth.wall_seconds - paused)) <= 2.0
    assert gp["lostSeconds"]["schedule"] > 0 and abs(gp["effectiveRatio"] - true_ratio) <= 0.03
    # attempt 2 resumed from the newest checkpoint that was complete when it started, and every
    # step was trained to the end
    resumes = drill.resumes(e2e.cluster.pods_dir, ns, d.name)
    assert resumes and all(r["step"] == drill.newest_complete_before(d.ckpt_uri, r["started"]) for r in resumes)
    assert resumes[0]["step"] == st["current"]["resumeCheckpoint"]["step"] == stopped_step
    assert gp["lostSeconds"]["recompute"] == 0  # nothing trained twice: it resumed where it stopped
    assert sorted(truth.losses) == list(range(1, STEPS + 1))


def _sigterm_stops(pods_root: Path, ns: str) -> list[str]:
    """What global rank 0 of the stopped gang logged when SIGTERM reached it."""
    out = []
    for rec in drill.podprocs.all_records(pods_root):
        log = Path(rec["dir"]) / drill.podprocs.LOG
        if rec.get("namespace") == ns and log.exists():
            out += re.findall(r"SIGTERM: (stopping after step \d+, [a-z ]+)", log.read_text(errors="replace"))
    return out
