"""AWS's NxD Llama example with ZeRO-1 does not resume its weights (NxD 2.29, torch-xla 2.9):
the behaviour docs/neuron.md and docs/scripts.md describe, pinned so that a new NxD or torch-xla
that fixes it tells us to change them.

The script (unmodified, plain torchrun, one rank on torch-xla's CPU device) with the 7B launch
script's flags (ZeRO-1, mixed precision) runs 12 steps; a second copy stops at step 5 and is
started again with ``--loading_step latest_if_exists``. NxD's ``load_checkpoint`` loads the
optimizer first, and torch-xla's ``ZeroRedundancyOptimizer.load_state_dict`` re-makes its fp32
copies from the parameters it holds then (the initial ones, ``init_zero``); the checkpoint has
no ``sharded_master_weights`` (the example sets ``use_master_weights_in_ckpt: False``). So the
first step after the resume (the loaded model) is right and every later one starts from the
initial weights plus one update."""

from __future__ import annotations

import pytest

from tests import nxd_example as ex

pytestmark = pytest.mark.nxd

STEPS, STOP, SAVE_EVERY = 12, 5, 5


def test_with_zero1_the_example_loses_its_weights_after_a_resume(tmp_path):
    env = ex.example_env()
    model, data = ex.tiny_llama(tmp_path, env)

    def args(where, steps_this_run=None):
        return ex.arguments(model, data, where / "out", str(where / "ckpt"), STEPS, SAVE_EVERY, ex.ZERO1,
                            steps_this_run=steps_this_run)
    truth = ex.run(env, tmp_path / "uninterrupted", args(tmp_path / "uninterrupted"))
    first = ex.run(env, tmp_path / "stopped", args(tmp_path / "stopped", STOP))
    resumed = ex.run(env, tmp_path / "stopped", args(tmp_path / "stopped"))
    assert sorted(truth) == list(range(1, STEPS + 1)) and sorted(first) == list(range(1, STOP + 1))
    assert all(first[s] == truth[s] for s in first)
    assert sorted(resumed) == list(range(STOP + 1, STEPS + 1))  # NxD's loader found step_5
    assert resumed[STOP + 1] == truth[STOP + 1]  # the loaded model: right
    for step in range(STOP + 2, STEPS + 1):  # then the initial weights again: the loss jumps up
        assert float(resumed[step][0]) > float(truth[step][0]) + 0.05, (step, resumed[step], truth[step])
    print(f"\nZeRO-1 resume of NxD's example: step {STEPS} loss {resumed[STEPS][0]} against "
          f"{truth[STEPS][0]} uninterrupted (step {STOP + 1}: {resumed[STOP + 1][0]}, equal)")
