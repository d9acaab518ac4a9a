"""trainer.pod.launch reads what the Neuron runtime said when a worker died and writes it into the
container's termination message (the operator reads it there: docs/neuron.md, "Failures the
runtime names").

Real processes under the real launcher and torchrun; the workers are small scripts that print
what the runtime prints (verbatim lines from tests/fixtures/neuron_runtime_faults.yaml) and
exit: no Neuron runtime exists here, and what is under test is the launcher's reading of its
workers' output, not the runtime.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, trainer_env
from trainium_api import runtimefaults
from trainium_api.launch import TERMINATION_LOG_ENV

pytestmark = pytest.mark.trainer

HBM = ("(FATAL-RT-UNDEFINED-STATE) Uncorrectable HBM memory error is detected. Execution results may be invalid. "
       "Please terminate this instance to prevent future impact from the hardware error.")
WORKER = f"""
import os, sys, time
rank, mode = int(os.environ["RANK"]), sys.argv[1]
if mode == "ok":  # one write per line: two ranks share the stream
    os.write(1, f"rank {{rank}} done\\n".encode())
    sys.exit(0)
said = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), "rank0-said")
if rank == 0:  # the rank that loses its peer: says so, then waits to be stopped by torchrun
    print("RuntimeError: Connection closed by peer [127.0.0.1]:29500", file=sys.stderr, flush=True)
    open(said, "w").close()
    time.sleep(60)
deadline = time.monotonic() + 60  # rank 0 has said its line first (not a head start: ranks start unevenly)
while not os.path.exists(said) and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(0.2)  # (its line through the launcher's pipe before this rank's)
if mode == "hbm":
    print({HBM!r}, flush=True)
if mode == "killed":
    os.kill(os.getpid(), 9)
sys.exit(1)
"""


def launch(tmp: Path, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    script, message = tmp / "worker.py", tmp / "termination-log"
    script.write_text(WORKER)
    res = subprocess.run([sys.executable, "-m", "trainer.pod.launch", "--standalone", "--nproc_per_node", "2",
                          str(script), mode], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=trainer_env(**{TERMINATION_LOG_ENV: str(message)}))
    return res, message


def test_a_hardware_fault_printed_by_one_rank_reaches_the_termination_message(tmp_path):
    res, message = launch(tmp_path, "hbm")
    assert res.returncode == 1, res.stderr[-2000:]
    found = runtimefaults.parse_message(message.read_text())
    assert found is not None and (found.kind, found.status) == ("device", "NRT_EXEC_HW_ERR_HBM_UE"), message.read_text()
    assert found.evidence == HBM
    # the console is as it was: the runtime's line unprefixed on stdout, the peer's on stderr
    assert HBM in res.stdout.splitlines(), res.stdout[-2000:]
    assert "RuntimeError: Connection closed by peer [127.0.0.1]:29500" in res.stderr.splitlines()
    assert "the Neuron runtime reported NRT_EXEC_HW_ERR_HBM_UE" in res.stderr


def test_a_rank_that_only_lost_its_peer_says_so(tmp_path):
    res, message = launch(tmp_path, "crash")
    assert res.returncode == 1
    found = runtimefaults.parse_message(message.read_text())
    assert found is not None and found.kind == "peer", message.read_text()


def test_a_pod_whose_own_worker_was_killed_is_not_a_mere_peer(tmp_path):
    """Its neighbour's "connection closed" is about the killed worker: no peer finding, so the
    operator blames this pod at once (a plain crash)."""
    res, message = launch(tmp_path, "killed")
    assert res.returncode == 1
    assert not message.exists(), message.read_text()


def test_nothing_is_written_when_the_workers_succeed(tmp_path):
    res, message = launch(tmp_path, "ok")
    assert res.returncode == 0, res.stderr[-2000:]
    assert not message.exists()
    assert {"rank 0 done", "rank 1 done"} <= set(res.stdout.splitlines())
