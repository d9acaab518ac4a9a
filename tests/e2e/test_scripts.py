"""Unmodified training scripts under the operator (tier e2e), pods as real processes: NxD's
Llama example and NxD Training's orchestrator, as script stand-ins that print the upstream
formats and keep NxD's checkpoint layout (tests/standins/scripts). No line of either script
knows the operator: progress comes from their logs through python -m trainer.watch.

- progress (step, loss, tokens per second) reaches the run's status;
- a frozen gang (SIGSTOP, mid-save) is detected as a hang and restarted; a killed rank
  (mid-save) is restarted;
- the torn tag / .ckpt each fault leaves (the highest step, the newest by mtime) is never
  chosen: the operator's lastCheckpoint, the watch's start step, the checkpoint the script
  loaded and, for NxDT, the resume override on the next attempt's command all name the newest
  complete one;
- every step of every attempt computed the uninterrupted run's state (an exact resume).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from localcluster import faults
from localcluster.drill import Drill

from trainium_api import checkpoints

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).resolve().parents[1] / "standins" / "scripts"
STEPS = 30
SAVE_EVERY = 5


def chain(steps: int) -> dict[int, int]:
    """The state after each step of an uninterrupted run (standin_gang.advance)."""
    state, out = 0, {}
    for n in range(1, steps + 1):
        state = (state * 31 + n) % 1_000_000_007
        out[n] = state
    return out


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def script_run(name: str, tmp: Path, fmt: str, command: list[str], ckpt_uri: str) -> dict:
    return {"apiVersion": "trainium.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": name},
            "spec": {"image": "local", "nodes": 2, "instanceType": "cpu", "processesPerNode": 2,
                     "trainer": {"kind": "command", "progressFormat": fmt, "command": command,
                                 "tokensPerSample": 128, "samplesPerStep": 8, "workingDir": str(tmp)},
                     "checkpoint": {"uri": ckpt_uri}, "logging": {"progressIntervalSeconds": 1},
                     "faultTolerance": {"hangTimeoutSeconds": "auto", "hangTimeoutFloorSeconds": 8,
                                        "teardownGraceSeconds": 3},
                     "env": [{"name": "STANDIN_RECORD", "value": str(tmp / "record.jsonl")},
                             {"name": "STANDIN_STEP_SECONDS", "value": "0.3"},
                             {"name": "STANDIN_SAVE_SECONDS", "value": "1.5"},
                             {"name": "OMP_NUM_THREADS", "value": "1"}]}}


def torn_in_flight(ckpt_uri: str, layout: str) -> checkpoints.TagInfo | None:
    """A save that has begun and not finished, above the newest complete one."""
    tags = checkpoints.list_tags(ckpt_uri, read_meta=False, layout=layout)
    newest = max((t.step for t in tags if t.complete), default=0)
    return next((t for t in tags if not t.complete and t.step and t.step > newest > 0), None)


def progress_in_status(d: Drill) -> dict:
    st = d.wait(lambda: (s := d.status()).get("step", 0) >= 6 and s.get("tokensPerSecond") and s, 120,
                "progress in the run's status")
    assert st["phase"] == "Running" and st["loss"] > 0 and st["tokens"] == st["step"] * 8 * 128
    return st


def finish(d: Drill) -> dict:
    st = d.wait(lambda: (s := d.status()).get("phase") in ("Succeeded", "Failed") and s, 240, "the run to end")
    assert st["phase"] == "Succeeded", st.get("message")
    return st


def check_exact_and_resumed_from(record_path: Path, torn: checkpoints.TagInfo, st: dict) -> dict:
    """Every step equals the uninterrupted run; the second attempt loaded the checkpoint the
    operator pinned, the newest complete one, never the torn one."""
    recs = records(record_path)
    truth = chain(STEPS)
    steps = [r for r in recs if r["event"] == "step"]
    assert {r["step"] for r in steps} == set(truth) and all(r["state"] == truth[r["step"]] for r in steps)
    starts = [r for r in recs if r["event"] == "start"]
    assert [s["attempt"] for s in starts] == ["1", "2"], starts
    second = starts[1]
    assert second["loaded"] != torn.tag and second["step"] < torn.step
    resumed = st["current"]["resumeCheckpoint"]  # what the operator told attempt 2 (status of its start)
    assert second["loaded"] == resumed["tag"] and second["step"] == resumed["step"]
    saved = [r for r in recs if r["event"] == "save" and r["time"] < starts[1]["time"]]
    assert resumed["step"] == max(r["step"] for r in saved)  # the newest complete one at the restart
    return second


def test_nxd_example_frozen_mid_save_is_a_hang_and_resumes_from_the_newest_done_tag(e2e, tmp_path):
    ns = e2e.namespace("nxd-script")
    ckpt = str(tmp_path / "ckpt")
    command = [str(SCRIPTS / "tp_zero1_llama_hf_pretrain.py"), "--tensor_parallel_size", "2",
               "--max_steps", str(STEPS), "--logging_interval", "2", "--checkpoint_dir", "$(CHECKPOINT_URI)",
               "--checkpoint_freq", str(SAVE_EVERY), "--num_kept_checkpoint", "3", "--loading_step", "latest_if_exists"]
    d = Drill(e2e.cluster, ns, script_run("nxd", tmp_path, "nxd", command, ckpt))
    d.losses_path = tmp_path / "record.jsonl"
    d.create()
    st = progress_in_status(d)
    print(f"\nnxd: status at step {st['step']}: loss {st['loss']}, {st['tokensPerSecond']} tokens/s")
    torn = d.wait(lambda: torn_in_flight(ckpt, "nxd"), 120, "a save in flight")
    faults.hang_pod(e2e.cluster.pods_dir, ns, d.running_pod(0).metadata.name)
    frozen_at = time.time()
    d.wait(lambda: d.status().get("attempt") == 2, 90, "the hang to be detected and a new gang started")
    st = d.status()
    failure = st["failures"][-1]
    assert failure["cause"] == "hang" and failure["attempt"] == 1, failure
    assert st["lastCheckpoint"]["tag"] != torn.tag and st["current"]["resumeCheckpoint"]["tag"] != torn.tag
    pod = d.wait(lambda: d.pods(2), 30, "attempt 2's pods")[0]  # the status says attempt 2 before they exist
    cmd = pod.spec.containers[0].command
    assert cmd[cmd.index("--start-step") + 1] == str(st["current"]["resumeCheckpoint"]["step"])
    print(f"nxd: frozen mid-save of {torn.tag}; hang detected +{failure['time'] - frozen_at:.1f}s; attempt 2 "
          f"resumes from {st['current']['resumeCheckpoint']['tag']}")
    st = finish(d)
    check_exact_and_resumed_from(d.losses_path, torn, st)
    assert st["step"] == STEPS and st["restarts"] == {"hang": 1}


def test_nxdt_killed_mid_save_resumes_from_the_pinned_complete_checkpoint(e2e, tmp_path):
    ns = e2e.namespace("nxdt-script")
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "hf_llama_7B_config.yaml").write_text(yaml.safe_dump({
        "name": "hf_llama", "trainer": {"max_steps": STEPS},
        "exp_manager": {"explicit_log_dir": str(tmp_path / "exp"), "resume_if_exists": True,
                        "resume_from_checkpoint": None,
                        "checkpoint_callback_params": {"every_n_train_steps": SAVE_EVERY}},
        "data": {"global_batch_size": 8}}))
    ckpt = str(tmp_path / "exp" / "checkpoints")
    command = [str(SCRIPTS / "training_orchestrator.py"), "--config-path=conf", "--config-name=hf_llama_7B_config",
               "trainer.devices=$(NPROC_PER_NODE)", "trainer.num_nodes=$(NNODES)"]
    d = Drill(e2e.cluster, ns, script_run("nxdt", tmp_path, "nxdt", command, ckpt))
    d.losses_path = tmp_path / "record.jsonl"
    d.create()
    st = progress_in_status(d)
    print(f"\nnxdt: status at step {st['step']}: loss {st['loss']}, {st['tokensPerSecond']} tokens/s")
    first = d.pods(1)[0].spec.containers[0].command
    assert first[-1] == "exp_manager.resume_if_exists=false"  # nothing complete yet: never a torn one
    torn = d.wait(lambda: torn_in_flight(ckpt, "nxdt"), 120, "a save in flight")
    faults.kill_rank(e2e.cluster.pods_dir, ns, d.running_pod(0).metadata.name)
    d.wait(lambda: d.status().get("attempt") == 2, 90, "the crash to be detected and a new gang started")
    st = d.status()
    assert st["failures"][-1]["cause"] == "application"
    # NxDT's own rule would take the torn one: it is the newest .ckpt by modification time
    by_mtime = max(Path(ckpt).glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    assert by_mtime.name == torn.tag and not (by_mtime / "done").exists()
    complete = checkpoints.newest_complete(ckpt, "nxdt")
    for pod in d.wait(lambda: d.pods(2), 30, "attempt 2's pods"):
        assert pod.spec.containers[0].command[-1] == f'exp_manager.resume_from_checkpoint="{complete.uri}"'
    print(f"nxdt: killed mid-save of {torn.tag}; attempt 2 pinned to {complete.tag}")
    st = finish(d)
    check_exact_and_resumed_from(d.losses_path, torn, st)
    assert st["step"] == STEPS and st["restarts"] == {"application": 1}
