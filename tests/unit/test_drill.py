"""Ground truth for the e2e checks (tools/localcluster/drill.py), from a trainer's step log."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from localcluster import drill  # noqa: E402


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_ground_truth_counts_each_surviving_step_once(tmp_path):
    # attempt 1: steps 1-12 ending at t=101..112; restart resumes at 10, 20 s later, steps 11-20
    first = [{"step": s, "time": 100.0 + s, "startStep": 0} for s in range(1, 13)]
    second = [{"step": s, "time": 122.0 + s, "startStep": 10} for s in range(11, 21)]
    truth = drill.ground_truth(write(tmp_path / "l.jsonl", first + second), created=90.0)
    assert sorted(truth.losses) == list(range(1, 21)) and truth.executions == 22
    # 20 surviving steps of 1 s (each attempt's first step is given the median, 1 s)
    assert truth.productive_seconds == 20.0 and truth.wall_seconds == 52.0
    assert drill.restart_points(tmp_path / "l.jsonl") == [10]


def test_a_restart_at_the_last_step_is_not_a_long_step(tmp_path):
    # a graceful stop saved step 12 and the restart resumed exactly there
    first = [{"step": s, "time": 100.0 + s, "startStep": 0} for s in range(1, 13)]
    second = [{"step": s, "time": 130.0 + s, "startStep": 12} for s in range(13, 16)]
    truth = drill.ground_truth(write(tmp_path / "l.jsonl", first + second), created=90.0)
    assert truth.productive_seconds == 15.0 and truth.executions == 15
    assert drill.restart_points(tmp_path / "l.jsonl") == [12]
