"""bench.data_reads runs end to end on a small corpus (a benchmark that no longer runs is a
defect found late): moto's S3 server, the counting proxy, both readers, the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.s3


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_the_data_reads_benchmark_runs_and_a_prepared_rank_reads_its_share(fmt):
    """Whatever the raw format, the prepared shards made from it are read per rank."""
    res = subprocess.run([sys.executable, "-m", "bench.data_reads", "--docs", "800", "--batch", "16",
                          "--seq-len", "32", "--dp", "1,2", "--format", fmt], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"raw text ({fmt})" in res.stdout
    rows = [row for row in (line.split("|") for line in res.stdout.splitlines() if line.startswith("|"))
            if row[1].strip() == "prepared"]
    assert len(rows) == 2
    for row in rows:  # the x (1/DP of prepared) column, and no tokenizer time
        assert float(row[5]) <= 1.1 and float(row[6]) == 0.0, row
