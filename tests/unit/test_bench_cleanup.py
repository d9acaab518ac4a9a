"""The benchmarks clean up after themselves: SIGTERM (a `timeout`, a cancelled job) runs their
`finally`, and bench.operator_scale builds valid runs at any size (its fixed batch of 16 made
every run of 128 nodes invalid, and the benchmark then waited forever)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.operator_scale import run_body
from trainium_operator.spec import parse

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("nodes", [1, 2, 8, 128])
def test_operator_scale_runs_are_valid_at_every_size(nodes):
    spec = parse(run_body(0, nodes)["spec"])
    assert spec.layout.data == nodes and spec.world_size == nodes


def _benchmark(marker: Path, cleanup: str = "") -> subprocess.Popen:
    """A stand-in benchmark: sleeps in a try whose finally runs ``cleanup`` then writes ``marker``."""
    script = (f"import time\nfrom bench.common import stop_cleanly_on_signals\nstop_cleanly_on_signals()\n"
              f"try:\n    print('started', flush=True)\n    time.sleep(60)\n"
              f"finally:\n{cleanup}    open({str(marker)!r}, 'w').write('control plane stopped')\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "api")])})
    assert proc.stdout.readline() == b"started\n"
    return proc


def test_sigterm_runs_the_benchmarks_finally(tmp_path):
    marker = tmp_path / "cleaned"
    proc = _benchmark(marker)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 5
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.read_text() == "control plane stopped"


def test_a_second_signal_does_not_cut_the_cleanup_short(tmp_path):
    """`pkill -f` of a benchmark run under `timeout` signals it twice (once directly, once
    forwarded): the cleanup the first SIGTERM started still finishes."""
    marker = tmp_path / "cleaned"
    proc = _benchmark(marker, "    print('cleaning', flush=True)\n    time.sleep(1)\n")
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline() == b"cleaning\n"
    proc.send_signal(signal.SIGTERM)  # the second one, during the cleanup
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert marker.read_text() == "control plane stopped"
