"""The pod agent's process handling (trainer.pod.agent), with real processes: it stops every process
under it (sessions of their own included: torchrun starts each worker in a new session; and
workers that outlived their launcher), and decides which exits a restart in place may follow.
The agent part runs in a child process of its own: it stops everything under it, which in the
test process would include the test tier's control plane."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainium_api import exitcodes, runtimefaults
from trainium_api.launch import PREFLIGHT_FLAG
from trainer.pod import agent

# a launcher with a worker in its own session that ignores SIGTERM, and one in its session;
# LAUNCHER_EXITS: the launcher itself ends on SIGTERM at once, leaving the workers behind
TREE = ("import os, subprocess, sys, time, signal\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "time.sleep(60)'], start_new_session=True)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "if not int(sys.argv[1]): signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "time.sleep(60)\n")
AGENT_SIDE = """
import json, os, subprocess, sys, time
from trainer.pod import agent
a = agent.Agent.__new__(agent.Agent)  # the process part only: no API server here
agent._become_subreaper()
a.parked = None
import tempfile
a.busy_dir = tempfile.mkdtemp()
if os.environ.get("SAVING"):  # a worker writing a checkpoint (trainer.contract.busy)
    open(os.path.join(a.busy_dir, "save-1-1"), "w").close()
if len(sys.argv) > 3:  # a parked launcher stand-in (a process with a child of its own, waiting on stdin)
    a.parked = subprocess.Popen([sys.executable, "-c", sys.argv[3]], stdin=subprocess.PIPE)
a.child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
expect = 3 + 2 * (a.parked is not None)
deadline = time.monotonic() + 20
while len(agent._under_me()) < expect and time.monotonic() < deadline:
    time.sleep(0.05)
spare = a.parked.pid if a.parked is not None else None


def handling_sigterm():  # (a process is in /proc from its fork, before its Python has set its handler)
    from trainer.pod.proctable import status_fields
    found = [f for number, _ in agent._under_me(spare) if (f := status_fields(number)) is not None]
    return sum(bool((int(f.get("SigIgn", "0"), 16) | int(f.get("SigCgt", "0"), 16)) & (1 << 14))  # SIGTERM is 15
               for f in found)


# the worker that ignores SIGTERM, and the launcher when it ignores or handles it too: the stop
# must not come before they are ready for it (or the test would stop a tree it did not mean)
handlers = 1 + (int(sys.argv[2]) == 0)
while handling_sigterm() < handlers and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(0.2)  # (each then reaches its sleep or its loop)
under = [n for n, _ in agent._under_me(spare)]
parked = [n for n, _ in agent._under_me()] if spare else []
parked = [n for n in parked if n not in under]
started = time.monotonic()
ok = a.clear(grace=float(os.environ.get("GRACE", "0.5")), idle_seconds=float(os.environ["IDLE"]) if "IDLE" in os.environ else None)
me = agent._proc_self()
zombies = [n for n, (ppid, _, state) in agent._process_table().items() if ppid == me and state == "Z"]
print(json.dumps({"found": len(under), "ok": ok, "left": agent._alive(under), "seconds": time.monotonic() - started,
                  "launcher": a.child.returncode, "zombies": zombies, "parked": len(parked),
                  "parked_alive": all(agent._alive([n]) for n in parked) if parked else None}))
if a.parked is not None:
    a.drop_parked()
"""
# what stands in for a parked launcher: it and a child of its own (the fork server), until stdin closes
PARKED = ("import subprocess, sys\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
          "sys.stdin.read()\n"
          "child.kill()\n")


# as TREE, but the worker that ignores SIGTERM computes (a rank finishing its step, or writing
# its stop-save)
BUSY_TREE = TREE.replace("signal.SIG_IGN); time.sleep(60)", "signal.SIG_IGN)\\nwhile True: pass")


# as BUSY_TREE, but the computing worker moves to the CPU the test fills with busier processes
# and takes the lowest priority there: its own (nice 19) and its session's (a kernel with
# autogroup schedules sessions against each other first)
STARVED_TREE = BUSY_TREE.replace(
    "\\nwhile True: pass",
    "\\nimport os\\nos.sched_setaffinity(0, {int(os.environ[\"STARVE_CPU\"])})\\nos.nice(19)\\n"
    "try: open(\"/proc/self/autogroup\", \"w\").write(\"19\")\\nexcept OSError: pass\\nwhile True: pass")


# as TREE, but the launcher starts a computing process when told to stop (a compile, an uploader)
STARTS_ON_STOP = TREE.replace("if not int(sys.argv[1]): signal.signal(signal.SIGTERM, signal.SIG_IGN)",
                              "signal.signal(signal.SIGTERM, lambda *_: subprocess.Popen([sys.executable, '-c', "
                              "'while True: pass']))")


def _stop(launcher_exits: int, *parked: str, tree: str = TREE, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", AGENT_SIDE, tree, str(launcher_exits), *parked], capture_output=True,
                         text=True, timeout=60, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_stop_reaches_every_process_even_those_ignoring_sigterm():
    got = _stop(0)
    assert got["found"] == 3 and got["ok"] and not got["left"] and got["seconds"] < 10, got
    assert not got["zombies"], got  # every orphan collected: nothing left for the next attempt to trip on


def test_workers_that_outlive_their_launcher_are_stopped_before_the_agent_says_ready():
    got = _stop(1)  # the launcher ends on SIGTERM; one worker does not: found and killed all the same
    assert got["found"] == 3 and got["ok"] and not got["left"] and got["launcher"] is not None, got


def test_the_parked_launcher_and_what_it_started_survive_the_stop_of_an_attempt():
    """trainer.pod.warm: the next attempt's launcher, parked under the agent, is not the stopped
    attempt's: the stop leaves it (and its fork server) alive while every other process goes."""
    got = _stop(0, PARKED)
    assert got["found"] == 3 and got["ok"] and not got["left"], got
    assert got["parked"] == 2 and got["parked_alive"], got


def test_which_exits_may_be_restarted_in_place_and_the_check_is_not_run_again():
    assert agent.restartable(1, "") and agent.restartable(exitcodes.RETRYABLE, "")
    assert agent.restartable(-9, "") and agent.restartable(exitcodes.TERMINATED, "")
    for code in (exitcodes.OK, exitcodes.FATAL, exitcodes.PREFLIGHT):
        assert not agent.restartable(code, "")
    device = runtimefaults.format_message(runtimefaults.Finding("device", "NRT_EXEC_HW_ERR_HBM_UE", 0, "HBM UE on nc 3"))
    peer = runtimefaults.format_message(runtimefaults.Finding("peer", "PEER_CLOSED", 1, "connection closed"))
    assert not agent.restartable(1, device) and agent.restartable(1, peer)
    network = runtimefaults.format_message(runtimefaults.Finding("network", "NRT_NETWORK_PROXY_FAILURE", 0, "x"))
    repairable = runtimefaults.format_message(
        runtimefaults.Finding("repairable", "NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE", 0, "HBM UE, reload the driver"))
    # the node's network path: left; a repairable fault: the operator may keep the node (it decides)
    assert not agent.restartable(1, network) and agent.restartable(1, repairable)
    argv = [PREFLIGHT_FLAG, "2,300", "--nnodes", "2", f"{PREFLIGHT_FLAG}=2,300", "-m", "trainer"]
    assert agent._without_preflight(argv) == ["--nnodes", "2", "-m", "trainer"]


def test_a_stop_after_a_hang_ends_the_grace_once_the_workers_are_idle():
    """Order.idle_seconds (after a hang): workers that use no CPU after the SIGTERM are stuck,
    not saving; they are SIGKILLed once idle that long, well before the grace ends."""
    got = _stop(0, env={"GRACE": "30", "IDLE": "0.5"})
    assert got["found"] == 3 and got["ok"] and not got["left"] and got["seconds"] < 15, got


def test_a_worker_that_computes_keeps_the_whole_grace():
    """A gang only taken for hung (alive, computing its step or writing its stop-save) is not
    idle: the grace runs to its end."""
    assert "while True: pass" in BUSY_TREE
    got = _stop(0, tree=BUSY_TREE, env={"GRACE": "3", "IDLE": "0.5"})
    assert got["found"] == 3 and got["ok"] and not got["left"] and got["seconds"] >= 3, got


def test_a_worker_starved_of_cpu_by_its_neighbours_is_not_taken_for_idle():
    """A computing worker that gets almost no CPU because busier processes share its core (a
    node's other pods, a contended host) waits runnable: its run-queue wait counts, and the
    grace runs to its end. By CPU time alone it would be idle and lose its stop-save."""
    assert "autogroup" in STARVED_TREE
    cpu = max(os.sched_getaffinity(0))
    hog = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(6)]
    try:
        got = _stop(0, tree=STARVED_TREE, env={"GRACE": "3", "IDLE": "0.5", "STARVE_CPU": str(cpu)})
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert got["found"] == 3 and got["ok"] and not got["left"] and got["seconds"] >= 3, got


def test_a_save_in_progress_or_a_process_started_by_the_stop_keeps_the_whole_grace():
    """Ranks waiting in a save's barrier for another pod's upload use no CPU: a save's file in
    the agent's directory (trainer.contract.busy) keeps the grace. So does a process the stop itself
    started that computes (it is counted from its start)."""
    got = _stop(0, env={"GRACE": "3", "IDLE": "0.5", "SAVING": "1"})
    assert got["found"] == 3 and got["ok"] and not got["left"] and got["seconds"] >= 3, got
    assert "subprocess.Popen" in STARTS_ON_STOP.split("signal.SIGTERM, lambda")[1]
    got = _stop(0, tree=STARTS_ON_STOP, env={"GRACE": "3", "IDLE": "0.5"})
    assert got["ok"] and not got["left"] and got["seconds"] >= 3, got


def test_a_save_says_so_in_the_agents_directory_while_it_runs(tmp_path, monkeypatch):
    from trainer.contract.busy import busy
    from trainium_api.agent import BUSY_DIR_ENV
    monkeypatch.delenv(BUSY_DIR_ENV, raising=False)
    with busy("save"):  # no agent: a no-op, nothing written where a later agent would look
        assert not list(tmp_path.iterdir())
    monkeypatch.setenv(BUSY_DIR_ENV, str(tmp_path))
    with busy("save"):
        assert len(list(tmp_path.iterdir())) == 1
    assert not list(tmp_path.iterdir())
    with pytest.raises(RuntimeError), busy("save"):
        raise RuntimeError("the write failed")
    assert not list(tmp_path.iterdir())  # a failed save says so no longer


def test_a_rank_that_runs_its_stop_handler_says_it_is_alive_and_garbage_keeps_the_grace(tmp_path):
    """A rank whose SIGTERM handler runs (trainer.loop.train's stop flag) is alive and saves at its
    next step: it leaves its mark for the rest of the attempt. A busy directory the workers
    removed or filled with a directory reads as saving (the whole grace), never as an error."""
    from trainium_api.agent import BUSY_DIR_ENV
    busy_dir = tmp_path / "busy"
    busy_dir.mkdir()
    code = ("import os, signal, sys, time; sys.path[:0] = sys.argv[1:]\n"
            "from trainer.loop.train import _StopFlag\n"
            "flag = _StopFlag(); os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1)\n"
            "assert flag.requested\n")
    from tests.conftest import ROOT
    out = subprocess.run([sys.executable, "-c", code, str(ROOT), str(ROOT / "api")], capture_output=True, text=True,
                         timeout=120, env={**os.environ, BUSY_DIR_ENV: str(busy_dir)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert [p.name.split("-")[0] for p in busy_dir.iterdir()] == ["stopping"]
    assert agent._saving(str(tmp_path / "removed"))
    (busy_dir / "sub").mkdir()
    assert agent._saving(str(busy_dir))


def test_what_a_process_asked_of_the_cpus_and_whether_it_is_runnable():
    """proctable.demand: a sleeping process asks nothing and is not runnable; a computing one
    asks for time and is runnable; two computing ones sharing one CPU each use about half of it
    and wait the other half in the run queue (counted, by thread, where the kernel keeps
    schedstat); one that is gone is None."""
    import time
    from trainer.pod import proctable

    def asked(pid):
        used, waits, _ = proctable.demand(pid)
        return used, sum(waits.values())

    cpu = max(os.sched_getaffinity(0))
    spin = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    try:
        time.sleep(1.0)  # all past their start
        slept, spun = asked(sleeper.pid), asked(spinners[0].pid)
        time.sleep(1.0)
        slept2, spun2 = asked(sleeper.pid), asked(spinners[0].pid)
        assert slept2[0] - slept[0] < 0.01 and slept2[1] - slept[1] < 0.01
        assert not proctable.demand(sleeper.pid)[2]
        used, waited = spun2[0] - spun[0], spun2[1] - spun[1]
        if os.path.exists("/proc/self/schedstat"):
            assert used + waited > 0.6 and waited > 0.2, (used, waited)  # about 0.5 s each
        else:  # a kernel without schedstat (CONFIG_SCHED_INFO): the CPU time and the runnable check alone
            assert waited == 0 and used > 0.2, (used, waited)
        assert any(proctable.demand(spinners[0].pid)[2] for _ in range(50))
    finally:
        for p in (sleeper, *spinners):
            p.kill()
            p.wait()
    assert proctable.demand(sleeper.pid) is None
