"""Warm workers (trainer.pod.warm): a parked launcher given its order trains exactly as a launcher
started cold, with its ranks forked from the warm fork server, and keeps the exit-code contract.

Real processes: the parked launcher, its fork server and torchrun's workers, two ranks on gloo.
The order comes on the launcher's stdin as the pod's agent writes it (trainer.pod.agent._unpark).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, data_overrides, read_losses, run_trainer, trainer_cmd, trainer_env
from trainium_api import exitcodes
from trainium_api.agent import PARKED_ATTEMPT, parse_process_name

pytestmark = pytest.mark.trainer


def _descendant_names(pid: int) -> set[str]:
    """Names of every live process under ``pid``."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                table[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), (entry / "comm").read_text().strip())
            except (OSError, IndexError, ValueError):
                continue
    names, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, name) in table.items():
            if ppid == parent:
                names.add(name)
                todo.append(child)
    return names


def _parked(env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer.pod.launch", "--warm"], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**env, "ATTEMPT": PARKED_ATTEMPT})


def _order(proc: subprocess.Popen, argv: list[str], env: dict) -> None:
    proc.stdin.write(json.dumps({"argv": argv, "env": env}) + "\n")
    proc.stdin.close()


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    proc.wait(timeout)
    return proc.stderr.read()


def test_a_warm_launcher_trains_bitwise_as_a_cold_one_with_forked_ranks(tiny_data, tmp_path):
    base = [*data_overrides(tiny_data), "training.steps=40", "checkpoint.uri=", "logging.interval=1"]
    cold = run_trainer(2, [*base, f"logging.lossesFile={tmp_path / 'cold.jsonl'}"])
    assert cold.returncode == 0, cold.stderr[-3000:]

    env = trainer_env()
    proc = _parked(env)
    time.sleep(1.0)  # parked: it warms up while nothing is ordered
    argv = trainer_cmd(2, [*base, f"logging.lossesFile={tmp_path / 'warm.jsonl'}"])[3:]  # after `python -m trainer.pod.launch`
    _order(proc, argv, {**env, "ATTEMPT": "3"})
    seen: set[str] = set()
    while proc.poll() is None:
        seen |= _descendant_names(proc.pid)
        time.sleep(0.05)
    err = proc.stderr.read()
    assert proc.returncode == 0, err[-3000:]
    ranks = {parse_process_name(n) for n in seen} - {None}
    assert ranks == {(3, 0), (3, 1)}, f"workers not forked warm and named for attempt 3: {seen}"
    cold_losses, warm_losses = read_losses(tmp_path / "cold.jsonl"), read_losses(tmp_path / "warm.jsonl")
    assert set(cold_losses) == set(warm_losses) == set(range(1, 41))
    assert all(cold_losses[s]["loss"] == warm_losses[s]["loss"] for s in cold_losses)


def test_a_warm_launcher_keeps_the_exit_code_contract(tiny_data, tmp_path):
    """A rank that exits FATAL (an invalid config) makes the warm launcher exit FATAL, as a cold one."""
    env = trainer_env()
    proc = _parked(env)
    argv = trainer_cmd(2, [*data_overrides(tiny_data), "training.steps=0"])[3:]
    _order(proc, argv, {**env, "ATTEMPT": "1"})
    err = _finish(proc)
    assert proc.returncode == exitcodes.FATAL, err[-3000:]
    assert "training.steps" in err


def test_a_parked_launcher_without_an_order_exits_quietly():
    """Its agent went (stdin closed): it ends, 0, having started nothing."""
    proc = _parked(trainer_env())
    proc.stdin.close()
    err = _finish(proc, 120)
    assert proc.returncode == 0, err[-3000:]


def test_a_stop_of_every_process_lets_warm_ranks_save_as_cold_ones_do(tiny_data, tmp_path):
    """The agent's stop (trainer.pod.agent.clear) SIGTERMs every process under it, the fork server
    included: its ranks must still stop as on any teardown, with the save of the step reached
    (checkpoint.saveOnStop), not be cut short by the fork server's death."""
    import os
    import signal

    from trainium_api import checkpoints
    env = trainer_env()
    proc = _parked(env)
    uri = str(tmp_path / "ckpt")
    losses = tmp_path / "stop.jsonl"
    argv = trainer_cmd(2, [*data_overrides(tiny_data), "training.steps=5000", f"checkpoint.uri={uri}",
                           "checkpoint.intervalSteps=4000", f"logging.lossesFile={losses}",
                           "logging.interval=1"])[3:]
    _order(proc, argv, {**env, "ATTEMPT": "2"})
    deadline = time.monotonic() + 240
    while not (losses.exists() and len(read_losses(losses)) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.1)
    from trainer.pod import agent
    launcher = next(n for n, local in agent._under_me() if local == proc.pid)
    under = [local for n, local in agent._under_me() if n == launcher]  # the launcher
    table = agent._process_table()
    todo = [launcher]
    while todo:  # and everything under it
        parent = todo.pop()
        for n, (ppid, local, _) in table.items():
            if ppid == parent:
                under.append(local)
                todo.append(n)
    for pid in under:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    err = _finish(proc, 120)
    tag = checkpoints.newest_complete(uri)
    assert tag is not None and tag.step >= 3, err[-3000:]
