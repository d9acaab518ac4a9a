"""Goodput drill at scale: a simulated 128-node Llama 2 7B run through hundreds of faults, the
operator's reported goodput against the drill's own ground truth.

    python -m bench.goodput_drill [--nodes 128] [--faults 200] [--compression 200] [--mtbf-minutes 15]

On its own local control plane (kwok nodes, the real operator as a process) it creates the
published 128 x trn1.32xlarge Llama 2 7B TrainingRun (examples/llama2-7b.yaml, checkpoints in a
local directory). The pods are kwok pods: a stand-in trainer in this process plays the gang:

* time is compressed: ``--compression`` real seconds pass per wall second. Step and checkpoint
  times are real-time figures from docs/neuron.md: 1,024 sequences of 4,096 tokens per step at
  about 750 sequences/s on 128 nodes (8 x the published 93-95 on 16) -> 1.37 s per step; an
  asynchronous checkpoint every 200 steps (the example's interval) that completes 60 s after its
  step; a restarted gang trains again 90 s after its pods run (process start, checkpoint load,
  cached graphs). What the operator and Kubernetes do (detection, teardown, scheduling) is
  measured, not simulated;
* progress is written as the trainer writes it: the ``trainium.dev/progress`` annotation on
  every pod (step, the step's end time, last complete checkpoint, start step) every
  ``--report-seconds`` of wall time; a checkpoint is the NxD layout's markers
  (``step_N/checkpoint`` at its start, ``step_N/done`` when complete), so the operator's own
  store reader finds it;
* faults arrive with exponential gaps of mean ``--mtbf-minutes`` (real time), drawn from crash
  (a rank's container exits 1), not-ready (the node's kubelet), neuron-health (the NeuronHealth
  condition) and hang (progress stops, pods stay Running), weights ``--mix``. After each one
  the gang stops training; when the operator's next gang is Running the stand-in resumes from
  the newest complete checkpoint, as the trainer does; the faulted node is healed and its
  quarantine taint removed (an admin returning it), so the cluster keeps its size.

Ground truth is the trainer's: every step's end time in a step log, reduced exactly as the e2e
tests do (tools/localcluster/drill.ground_truth: the steps that survive, each counted once, over
the wall time from creation). After the last fault the run trains on for a while, then the
operator's status goodput (computed at its own pass time) is compared with the truth over the
same wall time: the difference in points, and the operator's lost seconds per fault by phase.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from bench.common import stop_cleanly_on_signals, stop_process, table  # noqa: E402
from trainium_api import keys  # noqa: E402
from trainium_api import checkpoints, progress  # noqa: E402

GROUP, VERSION, PLURAL = "trainium.dev", "v1alpha1", "trainingruns"
STEP_SECONDS = 1024 / 750  # real seconds per step, 128 nodes (docs/neuron.md anchors)
CHECKPOINT_EVERY = 200  # steps
CHECKPOINT_WRITE_SECONDS = 60.0  # real: a save completes this long after its step
RESTART_SECONDS = 90.0  # real: gang Running -> first step of the new attempt
KINDS = ("crash", "not-ready", "neuron-health", "hang")


class Gang:
    """The stand-in trainer of one attempt: steps, checkpoints and progress reports."""

    def __init__(self, drill: "Drill", attempt: int, pods: list, start_step: int, last_ckpt: int | None):
        self.d, self.attempt, self.pods = drill, attempt, pods
        self.step = self.start_step = start_step
        self.last_ckpt = last_ckpt
        self.step_end = time.time()
        self.stopped = threading.Event()
        self.pending: list[tuple[float, int]] = []  # (completes at, step) of in-flight saves
        self.inflight: list = []  # the current round of progress writes

    def train_until(self, deadline: float) -> None:
        """Train (and report) until wall time ``deadline`` or until stopped."""
        d = self.d
        next_report = 0.0
        while not self.stopped.is_set() and time.time() < deadline:
            time.sleep(d.step_wall)
            if self.stopped.is_set():
                break
            self.step += 1
            self.step_end = time.time()
            d.log_step(self.step, self.step_end, self.start_step)
            if self.step % CHECKPOINT_EVERY == 0:
                d.begin_checkpoint(self.step)
                self.pending.append((self.step_end + CHECKPOINT_WRITE_SECONDS / d.args.compression, self.step))
            while self.pending and self.pending[0][0] <= time.time():
                _, s = self.pending.pop(0)
                d.finish_checkpoint(s)
                self.last_ckpt = s
            if time.time() >= next_report:
                self.report()
                next_report = time.time() + d.args.report_seconds

    def report(self) -> None:
        """Every pod's annotation, written in the background as the trainer's reporter writes
        (training never waits for the API); a round still in flight is not overtaken."""
        if any(not f.done() for f in self.inflight):
            return
        payload = progress.ProgressReport(step=self.step, time=self.step_end,
                                          tokens_per_second=4096 * 1024 / STEP_SECONDS, loss=2.0,
                                          last_checkpoint_step=self.last_ckpt,
                                          start_step=self.start_step).to_annotation()
        patch = {"metadata": {"annotations": {keys.PROGRESS: payload}}}
        self.inflight = [self.d.pool.submit(self.d.patch_pod, p, patch) for p in self.pods]


class Drill:
    def __init__(self, args):
        from kubernetes import client
        from localcluster.cluster import Cluster, free_base_port
        self.args = args
        self.rng = random.Random(args.seed)
        self.step_wall = STEP_SECONDS / args.compression
        self.work = Path(tempfile.mkdtemp(prefix="goodput-drill-"))
        self.ckpt_dir = self.work / "checkpoints"
        self.ckpt_dir.mkdir()
        self.steps_log = open(self.work / "steps.jsonl", "w")
        self.cluster = Cluster(state_dir=self.work / "cluster", base_port=free_base_port(27000))
        self.cluster.up()
        api = self.cluster.api_client()
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.pool = ThreadPoolExecutor(max_workers=16)
        self.cluster.kubectl("apply", "-f", str(ROOT / "crds" / "trainingruns.trainium.dev.yaml"))
        self.cluster.wait_established("trainingruns.trainium.dev")
        env = dict(os.environ, KUBECONFIG=str(self.cluster.kubeconfig))
        self.operator_log = open(self.work / "operator.log", "w")
        self.operator = subprocess.Popen([sys.executable, "-m", "trainium_operator", "--metrics-port", "0",
                                          "--liveness-port", str(free_base_port(28000)), "--leader-election", "off"],
                                         env=env, stdout=self.operator_log, stderr=subprocess.STDOUT)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        stop_process(self.operator)
        self.cluster.down()
        self.steps_log.close()
        self.operator_log.close()

    # -- the trainer's side ---------------------------------------------------------------

    def log_step(self, step: int, end: float, start_step: int) -> None:
        self.steps_log.write(json.dumps({"step": step, "time": round(end, 4), "startStep": start_step}) + "\n")

    def begin_checkpoint(self, step: int) -> None:
        tag = self.ckpt_dir / checkpoints.tag_for_step(step)
        tag.mkdir(exist_ok=True)
        (tag / checkpoints.BEGIN).write_bytes(b"")

    def finish_checkpoint(self, step: int) -> None:
        tag = self.ckpt_dir / checkpoints.tag_for_step(step)
        (tag / checkpoints.META).write_text(json.dumps({"step": step, "layout": {"tensor": 8, "data": 512,
                                                                                 "pipeline": 1, "zero1": True}}))
        (tag / checkpoints.DONE).write_bytes(b"")

    def newest_checkpoint(self) -> int | None:
        tag = checkpoints.newest_complete(str(self.ckpt_dir))
        return tag.step if tag else None

    def patch_pod(self, pod, patch) -> None:
        with contextlib.suppress(Exception):  # a pod being torn down: the trainer's reporter never raises either
            self.core.patch_namespaced_pod(pod.metadata.name, self.ns, patch)

    # -- the run --------------------------------------------------------------------------

    def create_run(self) -> None:
        from localcluster.nodes import create_nodes
        self.ns = "drill"
        self.core.create_namespace({"metadata": {"name": self.ns}})
        create_nodes(self.core, self.args.nodes + self.args.spare_nodes, "trn1.32xlarge", "d-")
        body = yaml.safe_load((ROOT / "examples" / "llama2-7b.yaml").read_text())
        spec = body["spec"]
        spec["nodes"] = self.args.nodes
        spec["checkpoint"] = {"uri": str(self.ckpt_dir), "intervalSteps": CHECKPOINT_EVERY, "keep": 0}
        spec["faultTolerance"] = {
            "hangTimeoutSeconds": "auto", "hangTimeoutFloorSeconds": self.args.hang_floor_seconds,
            "restartBudget": {k: 100000 for k in ("application", "node", "neuronDevice", "hang", "eviction")},
            "budgetWindowMinutes": 1, "noProgressRestarts": 100000, "maxQuarantinedNodes": 100000,
            "teardownGraceSeconds": 1, "backoffSeconds": 0}
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)

    def status(self) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, "llama2-7b").get("status") or {}

    def gang_running(self, attempt: int, timeout: float = 300) -> list:
        deadline = time.time() + timeout
        sel = f"trainium.dev/run=llama2-7b,trainium.dev/attempt={attempt}"
        while time.time() < deadline:
            pods = [p for p in self.core.list_namespaced_pod(self.ns, label_selector=sel).items
                    if not p.metadata.deletion_timestamp]
            if len(pods) == self.args.nodes and all(p.status.phase == "Running" for p in pods):
                return sorted(pods, key=lambda p: p.metadata.name)
            time.sleep(0.05)
        raise RuntimeError(f"attempt {attempt}'s gang did not run within {timeout:.0f}s")

    def inject(self, kind: str, gang: Gang) -> str | None:
        """Returns the node to return to service once the run has restarted, if any."""
        from localcluster import faults
        victim = self.rng.choice(gang.pods)
        gang.stopped.set()  # a broken gang trains no further (its collectives stall)
        if kind != "hang":  # a hang changes nothing but progress
            faults.inject(self.core, kind, self.ns, victim)
        return victim.spec.node_name if kind in ("not-ready", "neuron-health") else None

    def run(self) -> dict:
        args, c = self.args, self.args.compression
        weights = dict(zip(KINDS, (float(w) for w in args.mix.split(","))))
        self.create_run()
        self.created = None
        attempt, injected, counts = 1, 0, dict.fromkeys(KINDS, 0)
        t_start = time.time()
        while True:
            pods = self.gang_running(attempt)
            if self.created is None:
                self.created = self.status().get("createdTime")
            resume = self.newest_checkpoint()
            gang = Gang(self, attempt, pods, resume or 0, resume)
            time.sleep(RESTART_SECONDS / c)  # process start, checkpoint load, cached graphs
            if injected >= args.faults:
                # train on, and read the operator's status while the gang still trains: the
                # comparison then covers the same wall time on both sides
                tail = threading.Thread(target=gang.train_until, args=(time.time() + args.tail_seconds + 30,))
                tail.start()
                time.sleep(args.tail_seconds)
                final = self.status()
                gang.stopped.set()
                tail.join()
                break
            gap = self.rng.expovariate(1.0 / (args.mtbf_minutes * 60.0 / c))
            gang.train_until(time.time() + gap)
            kind = self.rng.choices(KINDS, weights=[weights[k] for k in KINDS])[0]
            seen = self.status().get("failureCount") or 0
            node = self.inject(kind, gang)
            injected += 1
            counts[kind] += 1
            deadline = time.time() + 600
            while (self.status().get("failureCount") or 0) <= seen:
                if time.time() > deadline:
                    raise RuntimeError(f"fault {injected} ({kind}) was not detected within 600 s")
                time.sleep(0.05)
            attempt = int(self.status().get("attempt") or attempt)
            if self.status().get("phase") == "Restarting":
                deadline = time.time() + 120
                while self.status().get("phase") == "Restarting" and time.time() < deadline:
                    time.sleep(0.05)
                attempt = int(self.status().get("attempt") or attempt)
            if node:
                from localcluster import faults
                faults.return_node(self.core, node)
            if injected % 10 == 0 or injected == args.faults:
                st = self.status()
                print(f"[drill] {injected}/{args.faults} faults ({time.time() - t_start:.0f}s): step {gang.step}, "
                      f"status goodput {(st.get('goodput') or {}).get('effectiveRatio')}", flush=True)
        self.steps_log.flush()
        return {"status": final, "counts": counts, "seconds": time.time() - t_start}


def compare(status: dict, steps_path: Path) -> dict:
    """The operator's goodput against the truth over the same wall time (its pass's ``now``)."""
    from localcluster import drill
    good = status["goodput"]
    created = status["createdTime"]
    until = created + good["wallSeconds"]
    records = [json.loads(line) for line in steps_path.read_text().splitlines() if line.strip()]
    kept = steps_path.with_suffix(".until.jsonl")
    kept.write_text("".join(json.dumps(r) + "\n" for r in records if r["time"] <= until))
    truth = drill.ground_truth(kept, created)
    true_ratio = truth.productive_seconds / good["wallSeconds"]
    return {"reported": good["effectiveRatio"], "truth": true_ratio, "wall": good["wallSeconds"],
            "productive_reported": good["productiveSeconds"], "productive_truth": truth.productive_seconds,
            "lost": good["lostSeconds"], "failures": status.get("failureCount") or 0,
            "executions": truth.executions, "surviving": len(truth.losses)}


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--spare-nodes", type=int, default=8)
    ap.add_argument("--faults", type=int, default=200)
    ap.add_argument("--compression", type=float, default=200.0, help="real seconds per wall second")
    ap.add_argument("--mtbf-minutes", type=float, default=15.0, help="mean time between faults, real minutes")
    ap.add_argument("--mix", default="4,2,2,1", help="weights of crash, not-ready, neuron-health, hang")
    ap.add_argument("--hang-floor-seconds", type=float, default=3.0,
                    help="spec.faultTolerance.hangTimeoutFloorSeconds (wall seconds)")
    ap.add_argument("--report-seconds", type=float, default=1.0, help="progress annotation interval (wall)")
    ap.add_argument("--tail-seconds", type=float, default=10.0, help="training after the last fault (wall)")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    stop_cleanly_on_signals()
    d = Drill(args)
    try:
        out = d.run()
    finally:
        d.close()
    result = compare(out["status"], d.work / "steps.jsonl")
    c, n = args.compression, max(result["failures"], 1)
    print(f"\nGoodput drill: {args.nodes} nodes, Llama 2 7B, {result['failures']} faults "
          f"({', '.join(f'{k} {v}' for k, v in out['counts'].items())}), time compressed {c:.0f}x "
          f"({out['seconds']:.0f} s wall = {out['seconds'] * c / 3600:.1f} h simulated), "
          f"MTBF {args.mtbf_minutes:.0f} min; {result['surviving']} steps survive of {result['executions']} run")
    print(table(["", "wall s", "productive s", "effective ratio"], [
        ["operator status", f"{result['wall']:.1f}", f"{result['productive_reported']:.1f}", f"{result['reported']:.4f}"],
        ["ground truth (step log)", f"{result['wall']:.1f}", f"{result['productive_truth']:.1f}", f"{result['truth']:.4f}"],
        ["difference (points)", "", "", f"{100 * (result['reported'] - result['truth']):+.2f}"]]))
    print("\nLost time per fault by phase, as the operator reports it (wall seconds; x compression = real):")
    print(table(["phase", "wall s per fault", "real s per fault"],
                [[k, f"{v / n:.2f}", f"{v / n * c:.0f}"] for k, v in result["lost"].items()]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
