"""`trainer.pod.launch --neuron-precompile-steps N`: the pre-compilation pass before training.

The Neuron SDK's ``neuron_parallel_compile`` is not installable here, so a STAND-IN of that
name is put on PATH: it runs the command it is given once, with
``NEURON_EXTRACT_GRAPHS_ONLY=1`` as the real tool does, and compiles nothing. What this proves:
the launcher runs the pass first with the same torchrun arguments, the pass is limited to N
steps, it writes no checkpoint, losses or progress (so the real run starts from the same
place and the operator never sees the pass as progress), and a missing tool is a fatal error.
What it does not prove: anything about the real tool, its graph extraction or the cache.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY_CONFIG, data_overrides, read_losses, trainer_env
from trainium_api import checkpoints, exitcodes

pytestmark = pytest.mark.trainer

STANDIN = """#!/bin/sh
# Stand-in for neuron_parallel_compile (tests/trainer/test_precompile.py): one pass, no compiling.
echo "$@" >> "$STANDIN_LOG"
NEURON_EXTRACT_GRAPHS_ONLY=1 exec "$@"
"""


def _launch(tmp: Path, tiny, path_dirs: list[str]) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "trainer.pod.launch", "--neuron-precompile-steps", "2", "--standalone",
            "--nproc_per_node", "1", "-m", "trainer", "--config", str(TINY_CONFIG)]
    for o in [*data_overrides(tiny), "training.steps=4", "checkpoint.intervalSteps=2", "logging.interval=1",
              f"checkpoint.uri={tmp / 'ckpt'}", f"logging.lossesFile={tmp / 'losses.jsonl'}"]:
        args += ["--override", o]
    env = trainer_env(STANDIN_LOG=str(tmp / "standin.log"),
                      PATH=os.pathsep.join([*path_dirs, os.path.dirname(sys.executable), "/usr/bin", "/bin"]))
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_precompile_pass_runs_first_and_leaves_no_trace(tiny_data, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "neuron_parallel_compile"
    tool.write_text(STANDIN)
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    res = _launch(tmp_path, tiny_data, [str(bin_dir)])
    assert res.returncode == 0, res.stderr[-4000:]
    calls = (tmp_path / "standin.log").read_text().splitlines()
    assert len(calls) == 1 and "-m trainer.pod.launch --standalone --nproc_per_node 1 -m trainer" in calls[0]
    assert "--neuron-precompile-steps" not in calls[0]  # the pass itself does not recurse
    assert "pre-compilation pass: steps 1-2" in res.stderr
    # The real run started from scratch (the pass saved nothing) and wrote every step once.
    assert "no complete checkpoint to resume from" in res.stderr.split("pre-compilation exited 0")[1]
    assert sorted(read_losses(tmp_path / "losses.jsonl")) == [1, 2, 3, 4]
    assert [t.step for t in checkpoints.list_tags(str(tmp_path / "ckpt")) if t.complete] == [2, 4]


def test_precompile_without_the_tool_is_fatal(tiny_data, tmp_path):
    res = _launch(tmp_path, tiny_data, [])
    assert res.returncode == exitcodes.FATAL
    assert "neuron_parallel_compile is not on PATH" in res.stderr
    assert not (tmp_path / "losses.jsonl").exists()
