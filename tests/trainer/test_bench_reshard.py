"""bench.reshard runs end to end at the tiny size (a benchmark that no longer runs is a defect
found late): the trainer's own TP 2 checkpoint, DCP's copy from 2 processes, every method, the
bitwise check, the table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, trainer_env

pytestmark = pytest.mark.trainer


def test_the_reshard_benchmark_runs_and_checks_ours_against_dcp(tmp_path):
    res = subprocess.run([sys.executable, "-m", "bench.reshard", "--size", "tiny", "--repeats", "1",
                          "--dir", str(tmp_path)], cwd=ROOT, env=trainer_env(), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "hold the same tensors, bitwise" in res.stdout
    rows = {row[1].strip(): row for row in (line.split("|") for line in res.stdout.splitlines()
                                            if line.startswith("|")) if row[1].strip() in ("ours", "dcp-load", "dcp")}
    assert set(rows) == {"ours", "dcp-load", "dcp"}
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows.values()), rows
