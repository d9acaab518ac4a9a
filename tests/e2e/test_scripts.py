"""Unmodified training scripts under the operator (tier e2e), pods as real processes: NxD's
Llama example and NxD Training's orchestrator, as script stand-ins that print the upstream
formats and keep NxD's checkpoint layout (tests/standins/scripts). No line of either script
knows the operator: progress comes from their logs through python -m trainer.pod.watch.

- progress (step, loss, tokens per second) reaches the run's status;
- a frozen gang (SIGSTOP, mid-save) is detected as a hang and restarted; a killed rank
  (mid-save) is restarted;
- the operator cannot see the checkpoint store (its own mount namespace, as on EKS): the pods
  list it (trainer.pod.watch) and report what they see;
- the torn tag / .ckpt each fault leaves (the highest step, the newest by mtime) is never
  chosen: the operator's lastCheckpoint (from the pods' reports), the watch's start step, and
  the checkpoint the script loaded (for NxDT, through the resume override the watch adds from
  what its pod listed) all name the newest complete one;
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


def first_report(d: Drill, attempt: int) -> dict | None:
    """Pod 0 of ``attempt``'s progress report, once it has a step."""
    pods = d.pods(attempt)
    text = (pods[0].metadata.annotations or {}).get("trainium.dev/progress") if pods else None
    report = json.loads(text) if text else None
    return report if report and report.get("step") else None


def finish(d: Drill) -> dict:
    st = d.wait(lambda: (s := d.status()).get("phase") in ("Succeeded", "Failed") and s, 240, "the run to end")
    assert st["phase"] == "Succeeded", st.get("message")
    return st


def check_exact_and_resumed_from(record_path: Path, torn: checkpoints.TagInfo, st: dict) -> dict:
    """Every step equals the uninterrupted run; the second attempt loaded the checkpoint the
    pods reported when it started, the newest complete one, never the torn one."""
    recs = records(record_path)
    truth = chain(STEPS)
    steps = [r for r in recs if r["event"] == "step"]
    assert {r["step"] for r in steps} == set(truth) and all(r["state"] == truth[r["step"]] for r in steps)
    starts = [r for r in recs if r["event"] == "start"]
    assert [s["attempt"] for s in starts] == ["1", "2"], starts
    second = starts[1]
    assert second["loaded"] != torn.tag and second["step"] < torn.step
    resumed = st["current"]["resumeCheckpoint"]  # what the pods reported when attempt 2 started
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
    assert not e2e.operator.sees(ckpt) and e2e.operator.sees("/etc/os-release")  # staged as on EKS
    print(f"\nnxd: status at step {st['step']}: loss {st['loss']}, {st['tokensPerSecond']} tokens/s")
    torn = d.wait(lambda: torn_in_flight(ckpt, "nxd"), 120, "a save in flight")
    faults.hang_pod(e2e.cluster.pods_dir, ns, d.running_pod(0).metadata.name)
    frozen_at = time.time()
    d.wait(lambda: d.status().get("attempt") == 2, 90, "the hang to be detected and a new gang started")
    st = d.status()
    failure = st["failures"][-1]
    assert failure["cause"] == "hang" and failure["attempt"] == 1, failure
    assert st["lastCheckpoint"]["tag"] != torn.tag and st["current"]["resumeCheckpoint"]["tag"] != torn.tag
    # the watch on attempt 2's pod found the same checkpoint in the store and reports it as its start
    report = d.wait(lambda: first_report(d, 2), 60, "attempt 2's first progress report")
    assert report["startStep"] == st["current"]["resumeCheckpoint"]["step"]
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
    assert not e2e.operator.sees(ckpt) and e2e.operator.sees("/etc/os-release")  # staged as on EKS
    torn = d.wait(lambda: torn_in_flight(ckpt, "nxdt"), 120, "a save in flight")
    faults.kill_rank(e2e.cluster.pods_dir, ns, d.running_pod(0).metadata.name)
    d.wait(lambda: d.status().get("attempt") == 2, 90, "the crash to be detected and a new gang started")
    st = d.status()
    assert st["failures"][-1]["cause"] == "application"
    # NxDT's own rule would take the torn one: it is the newest .ckpt by modification time
    by_mtime = max(Path(ckpt).glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    assert by_mtime.name == torn.tag and not (by_mtime / "done").exists()
    complete = checkpoints.newest_complete(ckpt, "nxdt")
    assert st["lastCheckpoint"]["tag"] == complete.tag  # what the pods reported, which the operator cannot read
    print(f"nxdt: killed mid-save of {torn.tag}; attempt 2 resumes from {complete.tag}")
    st = finish(d)
    second = check_exact_and_resumed_from(d.losses_path, torn, st)
    # pinned by the watch from what its pod listed: attempt 1 found nothing complete (never a torn
    # one), attempt 2 the newest complete checkpoint, not the newer torn one NxDT alone would take
    first = next(r for r in records(d.losses_path) if r["event"] == "start")
    assert first["loaded"] is None and second["loaded"] == complete.tag
    assert st["step"] == STEPS and st["restarts"] == {"application": 1}
