"""The pre-flight check under the real launcher and torchrun: three "nodes" (three launchers on
this machine, one rank each, a static rendezvous as in a pod), one of them slowed by having its
processes SIGSTOPped and SIGCONTed in turn (a slow node: a tenth of the time). The slow node's
launcher exits PREFLIGHT (76) with the reason in its termination message; the others wait to be
stopped (the operator's teardown: SIGTERM). A node whose rank is frozen in the check (SIGSTOP)
is named by its own launcher (trainer.pod.liveness). Without a slow node, every launcher goes on to
the real run, which learns how long the check took."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localcluster.faults import SlowProcesses, preflight_rank_in
from tests.conftest import ROOT, descendants, trainer_env
from trainer.pod import liveness
from trainium_api import exitcodes, preflight
from trainium_api.launch import PREFLIGHT_FLAG, PREFLIGHT_SECONDS_ENV, TERMINATION_LOG_ENV

pytestmark = pytest.mark.trainer
NODES = 3
SCRIPT = f"import os; print('real run; the check took', os.environ.get({PREFLIGHT_SECONDS_ENV!r}), flush=True)\n"


def two_free_ports() -> int:
    """A port p with p + 1 free too (the check's rendezvous is on the next port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def launch(tmp: Path, factor: float, port: int, timeout: int = 60, backend: str = "", node2: dict | None = None,
           **env: str) -> list[subprocess.Popen]:
    """One launcher per node; ``backend`` the check's (unset: what an older operator passes,
    none); ``node2``: extra environment for node 2 only."""
    script = tmp / "real.py"
    script.write_text(SCRIPT)
    value = f"{factor},{timeout}" + (f",{backend}" if backend else "")
    return [subprocess.Popen([sys.executable, "-m", "trainer.pod.launch", PREFLIGHT_FLAG, value, "--nnodes",
                              str(NODES), "--node_rank", str(i), "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
                              "--master_port", str(port), str(script)], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=trainer_env(NODE_NAME=f"node-{i}", **{TERMINATION_LOG_ENV: str(tmp / f"term-{i}")},
                                             **env, **((node2 or {}) if i == 2 else {})))
            for i in range(NODES)]


def slow(pid: int, share: float = 0.1) -> SlowProcesses:
    """The launcher and everything it starts, slowed to ``share`` of the time."""
    return SlowProcesses(lambda: [pid, *descendants(pid)], share=share, name=f"slow-{pid}")


def test_a_slow_node_is_named_by_the_check_and_the_others_wait_to_be_stopped(tmp_path):
    procs = launch(tmp_path, 3.0, two_free_ports())
    slower = slow(procs[2].pid)
    try:
        out, err = procs[2].communicate(timeout=240)
    finally:
        slower.stop()
    assert procs[2].returncode == exitcodes.PREFLIGHT, err[-3000:]
    reason = preflight.parse_message((tmp_path / "term-2").read_text())
    assert reason and reason.startswith("node node-2: matmul"), reason
    assert "real run" not in out
    time.sleep(1)
    for p in procs[:2]:
        assert p.poll() is None  # the healthy nodes wait for the teardown ...
        p.send_signal(signal.SIGTERM)
    for p in procs[:2]:
        _, err = p.communicate(timeout=60)
        assert p.returncode == exitcodes.TERMINATED, err[-2000:]  # ... and stop on it
        assert "another node failed (node node-2: matmul" in err
    assert not (tmp_path / "term-0").exists() and not (tmp_path / "term-1").exists()


def test_a_node_whose_rank_hangs_in_the_check_is_named_by_its_own_launcher(tmp_path):
    """Node 2's rank is frozen (SIGSTOP) in its matmuls: the collectives of the others would wait
    for it until the check's timeout and nobody could be named. Its launcher sees the beat go
    stale, kills the rank and exits PREFLIGHT naming its node; the others lose their peer and
    wait to be stopped."""
    procs = launch(tmp_path, 3.0, two_free_ports(), timeout=30)
    deadline = time.monotonic() + 120
    while (frozen := preflight_rank_in(descendants(procs[2].pid), "compute")) is None:
        assert time.monotonic() < deadline and procs[2].poll() is None, "node 2's check never started"
        time.sleep(0.05)
    os.kill(frozen, signal.SIGSTOP)
    stopped_at = time.monotonic()
    out, err = procs[2].communicate(timeout=120)
    stale, _ = liveness.budgets(30)
    assert procs[2].returncode == exitcodes.PREFLIGHT, err[-3000:]
    assert time.monotonic() - stopped_at >= stale  # not before its beat went stale
    reason = preflight.parse_message((tmp_path / "term-2").read_text())
    assert reason and reason.startswith("node node-2: local rank 0 stopped responding (no heartbeat for"), reason
    assert not Path(f"/proc/{frozen}").exists() or "Z" in Path(f"/proc/{frozen}/stat").read_text().split()[2]
    for p in procs[:2]:
        try:
            _, err = p.communicate(timeout=60)  # they wait out the check's timeout, unless stopped first
        finally:
            p.kill()
        assert p.returncode == exitcodes.RETRYABLE, err[-2000:]
        assert "a peer left the check" in err and "real run" not in err
    assert not (tmp_path / "term-0").exists() and not (tmp_path / "term-1").exists()


def test_a_node_whose_device_check_fails_is_named_before_any_device_starts(tmp_path):
    """Node 2's pod says its instance type has one Neuron device (TRAINER_PREFLIGHT_DEVICES, as
    the operator sets it on Trainium); this container has none, so its device check fails. The
    check names node 2 from that, and the others wait to be stopped."""
    procs = launch(tmp_path, 20.0, two_free_ports(), backend="cpu", node2={"TRAINER_PREFLIGHT_DEVICES": "1"})
    _, err = procs[2].communicate(timeout=240)
    assert procs[2].returncode == exitcodes.PREFLIGHT, err[-3000:]
    reason = preflight.parse_message((tmp_path / "term-2").read_text())
    assert reason == "node node-2: 0 Neuron devices in the container, the instance type has 1", reason
    for p in procs[:2]:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert "another node failed (node node-2: 0 Neuron devices" in err, err[-2000:]


def test_a_backend_no_node_can_start_fails_the_run_not_a_node(tmp_path):
    """The run's backend is cuda and no node has a GPU: the image or the cluster is wrong, so
    every launcher exits FATAL (no node is left out)."""
    procs = launch(tmp_path, 20.0, two_free_ports(), backend="cuda")
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [exitcodes.FATAL] * NODES, [e[-1500:] for e in errs]
    assert "the check failed on 3 of 3 nodes: node node-0: the run's backend cuda cannot start" in errs[0]


def test_a_healthy_gang_passes_and_the_real_run_learns_how_long_it_took(tmp_path):
    procs = launch(tmp_path, 20.0, two_free_ports(), backend="cpu")
    errs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        took = float(out.split("the check took")[1].split()[0])
        assert 0 < took < 120, out
        errs.append(err)
    summary = next(line for line in errs[0].splitlines() if line.startswith("trainer.pod.preflight: 3 nodes, 3 ranks"))
    assert "gloo on cpu" in summary and "3 node pairs; passed" in summary, summary  # rank 0 says what it measured


def test_a_gang_on_nodes_that_all_passed_recently_skips_the_check(tmp_path):
    """The operator names the nodes that passed this run's check recently; a slow node among
    them is not looked at again (that is what skipping means), so every launcher runs on."""
    from trainium_api.launch import node_token
    passed = tmp_path / "passed"  # as the list's ConfigMap volume holds it (plan.preflight_map)
    passed.write_text("".join(node_token(f"node-{i}") + "\n" for i in range(3)))
    procs = launch(tmp_path, 3.0, two_free_ports(), TRAINER_PREFLIGHT_PASSED_FILE=str(passed))
    slower = slow(procs[2].pid, 0.5)
    try:
        errs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
        slower.stop()
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-1500:] for e in errs]
    assert "trainer.pod.preflight: skipped: every node of the gang passed" in errs[0]
