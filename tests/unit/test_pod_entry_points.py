"""The pod command's entry points are the pod contract (trainium_api.launch.LAUNCH_MODULE,
WATCH_MODULE): the operator writes these names into every pod, and a trainer image older or
newer than the operator must answer to them, so they run the launcher and the watch wherever
the code lives (found by review: the move of the trainer into packages renamed them once)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from trainium_api.launch import LAUNCH_MODULE, WATCH_MODULE

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_names_are_the_ones_pods_have_always_run():
    assert (LAUNCH_MODULE, WATCH_MODULE) == ("trainer.launch", "trainer.watch")


def test_the_launch_entry_point_is_torchrun_with_our_flags():
    out = _run(LAUNCH_MODULE, "--help")
    assert out.returncode == 0 and "--nproc-per-node" in out.stdout, out.stderr[-2000:]


def test_the_watch_entry_point_is_the_watch():
    out = _run(WATCH_MODULE)
    assert out.returncode == 2 and "usage:" in out.stderr and "--format" in out.stderr, out.stderr[-2000:]
