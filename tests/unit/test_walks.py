"""The data walks of tools/walks.py keep working, and the pass hands a failure off once: the
judge's verdict goes whole to restarts.act_on, not back and forth through reconcile.py (issue
42: five hand-offs before)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import walks  # noqa: E402


def test_the_pass_hands_the_failure_off_once():
    assert walks.hand_offs_from_the_pass() == ["_act -> trainium_operator.restarts.act_on"]


def test_the_walks_reach_the_pass_and_the_next_attempt():
    assert "trainium_operator.spec" in walks.spec_walk()
    failed = walks.failed_pod_walk(depth=0)  # raises if the walk never reaches attempt 2
    assert {"trainium_operator.observe", "trainium_operator.judge", "trainium_operator.restarts"} <= failed
