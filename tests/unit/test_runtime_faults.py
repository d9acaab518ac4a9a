"""The Neuron runtime's words -> a finding -> the termination message -> the operator's reading
(trainium_api.runtimefaults), over the runtime's own lines kept verbatim as fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainium_api import runtimefaults as rf

SAMPLES = yaml.safe_load((Path(__file__).parents[1] / "fixtures" / "neuron_runtime_faults.yaml").read_text())["samples"]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s["line"][:60] for s in SAMPLES])
def test_each_runtime_line_gives_its_finding(sample):
    found = rf.scan(["some ordinary line", sample["line"], "another"], local_rank=1)
    if sample["kind"] is None:
        assert found is None, found
        return
    assert (found.kind, found.status, found.local_rank) == (sample["kind"], sample["status"], 1)
    assert found.evidence == sample["line"][:rf.EVIDENCE_LIMIT]


def test_a_device_fault_wins_over_a_lost_peer_in_any_order():
    peer, hbm = "RX, connection closed by remote peer", "Uncorrectable HBM memory error is detected. x"
    assert rf.scan([peer, hbm]).kind == rf.scan([hbm, peer]).kind == "device"
    assert rf.worst([None, rf.scan([peer]), rf.scan(["NRT_EXEC_SW_NQ_OVERFLOW"])]).kind == "restart"
    assert rf.worst([None, None]) is None


def test_the_message_round_trips_and_fits_the_kubelet_limit():
    f = rf.scan(["[MLA 0][NC 3] DMA RX engine 7 is in an abort state" + "x" * 10_000], local_rank=5)
    text = rf.format_message(f)
    assert len(text.encode()) <= rf.TERMINATION_MESSAGE_LIMIT
    assert rf.parse_message(text) == f
    assert "local rank 5: Neuron runtime NRT_EXEC_HW_ERR_DMA_ABORT" in f.describe()


@pytest.mark.parametrize("text", [
    None, "", "Error", "neuron-runtime-fault:", "neuron-runtime-fault: device NRT_EXEC_HW_ERR_HBM_UE",
    "neuron-runtime-fault: evil NRT_EXEC_HW_ERR_HBM_UE local-rank 0\nx",  # unknown kind
    "neuron-runtime-fault: device NRT_NOT_A_STATUS local-rank 0\nx",  # unknown status
    "neuron-runtime-fault: device NRT_EXEC_HW_ERR_HBM_UE local-rank 99999999\nx",
    " neuron-runtime-fault: device NRT_EXEC_HW_ERR_HBM_UE local-rank 0\nx",
])
def test_a_malformed_message_means_nothing(text):
    """The message is written by the run author's code: anything but the exact form is ignored."""
    assert rf.parse_message(text) is None


def test_evidence_is_printable_and_bounded():
    text = "neuron-runtime-fault: device NRT_EXEC_HW_ERR_NC_UE local-rank 0\n\x1b[31mred\x07" + "y" * 5000
    f = rf.parse_message(text)
    assert f.evidence.startswith("[31mred") and len(f.evidence) <= rf.EVIDENCE_LIMIT and f.evidence.isprintable()


ORPHAN_SCRIPT = r"""
import os, subprocess, sys, time
from trainer.pod.outputwatch import OutputWatch
w = OutputWatch().start()
subprocess.Popen(["sh", "-c", "sleep 3; echo ORPHAN"])  # outlives the launcher's workers, holds stdout
print("(FATAL-RT-UNDEFINED-STATE) [ND 0][NC 1] Uncorrectable memory error is detected, metadata: 0x1.", flush=True)
t = time.monotonic()
found = w.stop(timeout=0.2)
assert time.monotonic() - t < 2.5  # (not the orphan's 3 s)
assert w.stop() == found  # a second stop neither waits nor changes anything
with open(sys.argv[1], "w") as f:  # the next file opened must not receive the orphan's output
    f.write("mine\n")
time.sleep(4)
print("status", found.status, flush=True)
"""


def test_the_watch_lets_go_of_a_stream_an_orphan_still_holds(tmp_path):
    """A process that outlives the workers keeps the pipe: stop() returns within its timeout, the
    orphan's output still reaches the original stream, and no file opened afterwards gets it."""
    import subprocess
    import sys
    out = tmp_path / "after.txt"
    root = Path(__file__).parents[2]
    res = subprocess.run([sys.executable, "-c", ORPHAN_SCRIPT, str(out)], capture_output=True, text=True, timeout=60,
                         cwd=root, env={"PYTHONPATH": f"{root / 'api'}:{root}", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert out.read_text() == "mine\n"
    lines = res.stdout.splitlines()
    assert "ORPHAN" in lines and "status NRT_EXEC_HW_ERR_NC_UE" in lines, res.stdout


def test_only_recent_findings_count(monkeypatch):
    from trainer.pod import outputwatch
    w = outputwatch.OutputWatch()
    clock = [1000.0]
    monkeypatch.setattr(outputwatch.time, "monotonic", lambda: clock[0])
    w.see("NRT_EXEC_COMPLETED_WITH_NUM_ERR")  # an early NaN warning
    clock[0] += outputwatch.RECENT_SECONDS + 1
    w.see("Connection reset by peer")
    assert w.finding().kind == "peer"  # the stale restart finding no longer outranks it
