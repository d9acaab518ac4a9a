"""The pod agent's process handling (trainer.agent), with real processes: it finds and stops
every process under the workers' launcher, sessions of their own included (torchrun starts each
worker in a new session), and decides which exits a restart in place may follow."""

from __future__ import annotations

import subprocess
import sys
import time

from trainium_api import exitcodes, runtimefaults
from trainium_api.launch import PREFLIGHT_FLAG
from trainer import agent

TREE = ("import os, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "time.sleep(60)'])\n"
        "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "time.sleep(60)\n")


def test_a_stop_reaches_every_process_under_the_launcher_even_when_it_ignores_sigterm():
    a = agent.Agent.__new__(agent.Agent)  # the process part only: no API server in this test
    a.child = subprocess.Popen([sys.executable, "-c", TREE])
    deadline = time.monotonic() + 20
    while len(agent._descendants(a.child.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    under = agent._descendants(a.child.pid)
    assert len(under) == 2, under
    started = time.monotonic()
    a.stop_child(grace=0.5)  # everything ignores SIGTERM: SIGKILL after the grace
    assert time.monotonic() - started < 10
    assert a.child.poll() is not None and not agent._alive([n for n, _ in under])


def test_which_exits_may_be_restarted_in_place_and_the_check_is_not_run_again():
    assert agent.restartable(1, "") and agent.restartable(exitcodes.RETRYABLE, "")
    assert agent.restartable(-9, "") and agent.restartable(exitcodes.TERMINATED, "")
    for code in (exitcodes.OK, exitcodes.FATAL, exitcodes.PREFLIGHT):
        assert not agent.restartable(code, "")
    device = runtimefaults.format_message(runtimefaults.Finding("device", "NRT_EXEC_HW_ERR_HBM_UE", 0, "HBM UE on nc 3"))
    peer = runtimefaults.format_message(runtimefaults.Finding("peer", "PEER_CLOSED", 1, "connection closed"))
    assert not agent.restartable(1, device) and agent.restartable(1, peer)
    argv = [PREFLIGHT_FLAG, "2,300", "--nnodes", "2", f"{PREFLIGHT_FLAG}=2,300", "-m", "trainer"]
    assert agent._without_preflight(argv) == ["--nnodes", "2", "-m", "trainer"]
