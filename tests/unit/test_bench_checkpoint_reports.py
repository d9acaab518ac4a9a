"""bench.checkpoint_listing and bench.checkpoint_report_latency keep running (a benchmark that no
longer runs is a defect found late): the listing on moto's S3 server at its smallest sizes, the
report latency's arithmetic and its peer (the old CheckpointLister from git history) on a local
store (the latency benchmark itself needs the local control plane and a training run: it is run by
hand, python bench/checkpoint_report_latency.py --quick, not in the unit tier)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _rows(stdout: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in stdout.splitlines()
            if line.startswith("|") and not line.startswith("|-")]


@pytest.mark.s3
def test_the_listing_benchmark_runs_and_a_steady_call_costs_what_changed():
    res = subprocess.run([sys.executable, "-m", "bench.checkpoint_listing", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = {int(r[0]): r for r in _rows(res.stdout)[1:]}
    assert sorted(rows) == [10, 50]
    for tags, r in rows.items():
        old, steady, first = int(r[2]), int(r[4]), int(r[6])
        assert old >= 2 * tags and first == old  # every tag listed and its meta.json read
        assert steady <= 8  # the root, the newest and the new tag, the fence: not the tags
    assert rows[50][4] == rows[10][4]  # a steady call does not grow with the store


def test_the_latency_summary_counts_unnamed_tags_and_compares_with_the_peer():
    from bench.checkpoint_report_latency import p90, summary_rows
    done = {"step_5": 100.0, "step_10": 105.0, "step_15": 110.0}
    ours = {"step_5": 101.0, "step_10": 106.0, "step_15": 111.5}
    peer = {"step_10": 109.0, "step_15": 116.0}  # step_5 superseded before a listing named it
    rows = {r[0]: r for r in summary_rows(done, {"ours": ours, "peer": peer}, "peer")}
    # named, never named; median, p90 of the tags named; median, p90, max until it or a newer one
    assert rows["ours"][1:8] == [3, 0, "1.00", "1.50", "1.00", "1.50", "1.50"]
    assert rows["peer"][1:8] == [2, 1, "5.00", "6.00", "6.00", "9.00", "9.00"]  # step_5 waited for step_10
    assert rows["ours"][8:] == ["6.0", "6.0"] and rows["peer"][8:] == ["1.0", "1.0"]
    assert p90([float(i) for i in range(1, 11)]) == 9.0 and p90([3.0]) == 3.0


def test_the_peer_is_the_old_lister_and_lists_a_local_store(tmp_path):
    """The old CheckpointLister loads from git history and names the newest complete tag."""
    import time

    from bench.checkpoint_report_latency import load_peer
    store = tmp_path / "store"
    for step, complete in ((5, True), (10, True), (15, False)):
        tag = store / f"step_{step}"
        tag.mkdir(parents=True)
        (tag / "checkpoint").write_text("")
        (tag / "meta.json").write_text(f'{{"step": {step}}}')
        if complete:
            (tag / "done").write_text("")
    lister = load_peer(tmp_path).CheckpointLister()
    run = {"metadata": {"namespace": "ns", "name": "run"}, "spec": {"checkpoint": {"uri": str(store)}}}
    deadline = time.monotonic() + 10
    while (ref := lister.newest(run, None, [])) is None and time.monotonic() < deadline:
        time.sleep(0.1)  # a gang about to start: listed at once, answered within a pass or two
    assert ref is not None and ref.tag == "step_10" and ref.step == 10
