"""End-to-end drills: the operator as a real process, a TrainingRun whose pods run the real
trainer on process-backed nodes, faults on real processes, and what happened measured from the
trainer's own records. Shared by the e2e tests (tests/e2e), the recovery benchmark
(bench/e2e_recovery.py) and the demo (tools/demo).

Ground truth comes from the trainer, not from the operator: per-step end times and losses from
``logging.lossesFile``, resume decisions from the pods' logs, placement and process lifetimes
from the pod runner's records, and a sampler of the process table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import faults, podprocs
from .cluster import Cluster, free_base_port
from .nodes import create_nodes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-local-run.yaml"
GROUP, VERSION, PLURAL = "trainium.dev", "v1alpha1", "trainingruns"
FAULTS = ("kill-rank", "node-not-ready", "node-deleted", "neuron-error", "accelerated-hardware", "runtime-fault",
          "runtime-restart", "straggler", "hang", "operator-kill", "evict", "agent-frozen", "spot-interruption")
SPOT_NOTICE_SECONDS = 30.0
"""The drills' Spot interruption notice: EC2 gives 120 s (faults.SPOT_NOTICE_SECONDS); a tiny
run's save takes well under a second, and the drill must not wait two minutes for the node to go."""
# the pods' object-store credentials and endpoints: never passed to the operator (Operator)
STORE_CREDENTIALS = ("AWS_", "FSSPEC_", "BOTO")
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
WORKERS_STARTED = re.compile(r"agent: attempt \d+: workers started (?:cold |from the warm launcher )?"
                             r"\(pid \d+\) at ([0-9.]+)")


def manifest(name: str, data: dict[str, str], workdir: Path, prepared: bool = True, **groups) -> dict:
    """examples/tiny-local-run.yaml with its paths under ``workdir`` and groups merged in. The
    data are the tiny corpus's token shards (trainer.data.prepare), as a real run's would be, unless
    ``prepared`` is false (raw text, tokenized by every rank)."""
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {"name": name}
    spec = body["spec"]
    suffix = "_prepared" if prepared else ""
    spec["data"]["sources"] = [{"uri": data["stories" + suffix], "weight": 3},
                               {"uri": data["facts" + suffix], "weight": 1}]
    spec["data"]["tokenizer"] = data["tokenizer"]
    spec["checkpoint"]["uri"] = str(workdir / f"{name}-ckpt")
    spec["logging"]["lossesFile"] = str(workdir / f"{name}-losses.jsonl")
    for group, values in groups.items():
        spec[group] = {**spec[group], **values} if isinstance(values, dict) and isinstance(spec.get(group), dict) \
            else values
    return body


def fitted(body: dict, fault: str | None) -> dict:
    """``body`` made ready for ``fault``. An eviction through the API needs a run without a
    disruption budget (faultTolerance.doNotDisrupt false): the budget of a run that has one
    refuses every eviction of its gang (a drain waits and the operator moves the gang:
    tests/cluster/test_disruptions.py)."""
    if fault == "evict":
        body["spec"]["faultTolerance"] = {**(body["spec"].get("faultTolerance") or {}), "doNotDisrupt": False}
    return body


class Operator:
    """``python -m trainium_operator`` as a subprocess (it can be SIGKILLed and started again).

    Staged as on EKS, where the operator is a pod of its own: with ``hidden`` it runs in its own
    mount namespace in which those directories (where the pods keep their checkpoints, data and
    logs) are empty read-only file systems, and it never gets the pods' object-store credentials
    (no AWS_* or FSSPEC_* variable of this process reaches it). It reads the cluster through a
    copy of the kubeconfig outside ``hidden``."""

    def __init__(self, cluster: Cluster, log_path: Path, env: dict[str, str] | None = None,
                 hidden: tuple[Path, ...] = ()):
        self.cluster, self.log_path, self.env = cluster, Path(log_path), dict(env or {})
        self.hidden = tuple(Path(h) for h in hidden)
        self._copy: Path | None = None  # the kubeconfig's copy outside ``hidden``
        self.proc: subprocess.Popen | None = None
        self.metrics_port = free_base_port(start=cluster.base_port + 400, span=2)

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(STORE_CREDENTIALS)}
        env.update(KUBECONFIG=str(self._kubeconfig()), PYTHONUNBUFFERED="1", **self.env)
        command = [sys.executable, "-m", "trainium_operator", "--metrics-port", str(self.metrics_port),
                   "--liveness-port", str(self.metrics_port + 1)]
        if self.hidden:  # mount(8) over each, then the operator in the same (private) namespace
            script = 'for d in "$@"; do mount -t tmpfs -o ro,size=4k,mode=0555 operator-cannot-see "$d" || exit 1; done; ' \
                     f'exec {" ".join(command)}'
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                       *map(str, self.hidden)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def _kubeconfig(self) -> Path:
        """The cluster's kubeconfig, or a copy beside the log when the cluster's lies under a
        hidden directory, in a directory of its own (it embeds its certificate and token: nothing
        else is read)."""
        source = self.cluster.kubeconfig
        if not any(h == source or h in source.parents for h in self.hidden):
            return source
        if self._copy is None:  # one copy for every start (an operator killed and started again)
            self._copy = Path(tempfile.mkdtemp(prefix="trainium-operator-")) / "kubeconfig"
        copy = self._copy
        copy.write_bytes(source.read_bytes())
        copy.chmod(0o600)
        return copy

    def sees(self, path: str | Path) -> bool:
        """Whether the operator's process can see ``path`` (through its own mount namespace)."""
        return os.path.exists(f"/proc/{self.proc.pid}/root/{Path(path).resolve()}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def _describe(pid: int) -> str:
    """A process in a line: pid, state, command."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").strip()
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} {state} {argv[:160]}"


class ProcessSampler:
    """Samples the process table every ``interval`` s and records which attempts of a run had
    live processes at each sample (via the LOCALPOD variable the runner gives every process)."""

    def __init__(self, namespace: str, run: str, interval: float = 0.05):
        self.prefix, self.interval = f"{namespace}/{run}-", interval
        self.overlaps: list[tuple[float, set]] = []
        self.seen: dict[int, tuple[float, float]] = {}  # attempt -> (first, last) sample time
        self.warm: set[int] = set()  # attempts whose processes were started warm (trainer.pod.warm)
        self._pid_attempt: dict[tuple[int, str], int | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="process-sampler")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)

    def _attempt_of(self, pid: int) -> int | None:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            state, start = stat[0], stat[19]
        except (OSError, IndexError):
            return None
        if state in ("Z", "X"):  # a zombie has let go of everything (its parent has yet to reap it)
            return None
        key = (pid, start)
        if key not in self._pid_attempt:
            env = podprocs.process_env(pid)
            if podprocs.is_parked(pid, env):  # no attempt's yet: looked at again next time
                return None
            warm = podprocs.warm_identity(pid, env)  # started warm: its name says its attempt
            # a gang pod <run>-a<attempt>-<index>, or a spare <run>-spare-<n> (faultTolerance.spares)
            m = re.match(re.escape(self.prefix) + r"(?:a(\d+)-\d+|spare-\d+)/", env.get("LOCALPOD", ""))
            # a worker's attempt is its ATTEMPT (an in-place restart's workers run in the pods
            # of an earlier attempt, a spare's in a pod of none); the pod's agent outlives every
            # attempt it runs: not counted
            attempt = str(warm[0]) if warm is not None else env.get("ATTEMPT", "")
            if warm is not None and m:
                self.warm.add(warm[0])
            self._pid_attempt[key] = None if not m or podprocs.is_agent(pid) else (
                int(attempt) if attempt.isdigit() else int(m.group(1)) if m.group(1) else None)
        return self._pid_attempt[key]

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            live = {int(e): self._attempt_of(int(e)) for e in os.listdir("/proc") if e.isdigit()}
            attempts = {a for a in live.values() if a is not None}
            for a in attempts:
                first, _ = self.seen.get(a, (now, now))
                self.seen[a] = (first, now)
            if len(attempts) > 1:  # with the oldest attempt's processes, to say what outlived it
                old = min(attempts)
                self.overlaps.append((now, attempts, [_describe(pid) for pid, a in live.items() if a == old][:4]))
            self._stop.wait(self.interval)


@dataclass
class Truth:
    """What the trainer itself recorded."""

    losses: dict[int, dict]  # step -> the record of its final execution
    executions: int  # step executions in all (recomputed ones included)
    productive_seconds: float
    wall_seconds: float
    step_seconds: float  # median

    @property
    def ratio(self) -> float:
        return self.productive_seconds / self.wall_seconds


def read_losses(path: Path) -> list[dict]:
    records = (json.loads(line) for line in Path(path).read_text().splitlines() if line.strip())
    return [r for r in records if "step" in r]  # held-out evaluation records carry evalStep instead


def first_of_process(record: dict) -> bool:
    """The first step a (re)started trainer trained: the step after the one it resumed at."""
    return record["step"] == record.get("startStep", 0) + 1


def restart_points(losses_path: Path) -> list[int]:
    """The steps the run's restarts resumed at, in order, from the trainer's step log."""
    return [r["startStep"] for r in read_losses(losses_path) if first_of_process(r) and r["startStep"] > 0]


def ground_truth(losses_path: Path, created: float) -> Truth:
    """Productive time = the durations of the steps that survive in the final trajectory (each
    step's last execution; a recomputed step counts once), a step's duration being the time since
    the previous step ended in the same attempt (the first step of an attempt, whose start
    includes process start and checkpoint load, is given the median step time). Wall = run
    creation -> the final step's end."""
    records = read_losses(losses_path)
    durations: dict[int, float] = {}
    final: dict[int, dict] = {}
    prev: dict | None = None
    for r in records:
        if prev is not None and not first_of_process(r):
            durations[r["step"]] = r["time"] - prev["time"]
        else:
            durations.pop(r["step"], None)  # first step of an attempt: its start is unknown
        final[r["step"]] = r
        prev = r
    known = sorted(durations.values())
    median = known[len(known) // 2] if known else 0.0
    productive = sum(durations.get(s, median) for s in final)
    wall = max(r["time"] for r in final.values()) - created
    return Truth(final, len(records), productive, wall, median)


def resumes(pods_root: Path, namespace: str, run: str) -> list[dict]:
    """Every resume of the run: the pod that logged it (global rank 0), when it started, the
    checkpoint step it loaded."""
    out = []
    for rec in podprocs.all_records(pods_root):
        # the gang's pods <run>-a<attempt>-<index> and its spares <run>-spare-<n>
        if rec.get("namespace") != namespace or not rec["name"].startswith((f"{run}-a", f"{run}-spare-")):
            continue
        log = Path(rec["dir"]) / podprocs.LOG
        text = log.read_text(errors="replace") if log.exists() else ""
        starts = [(m.start(), float(m.group(1))) for m in WORKERS_STARTED.finditer(text)]
        for m in RESUMED.finditer(text):
            # workers started in place by the pod's agent started later than their pod
            started = max((t for at, t in starts if at < m.start()), default=rec["started"])
            out.append({"pod": rec["name"], "started": started, "uri": m.group(1), "step": int(m.group(2))})
    return out


def newest_complete_before(ckpt_uri: str, when: float) -> int | None:
    """The highest step whose ``done`` marker existed at ``when`` (local path or s3://)."""
    from trainium_api import checkpoints
    steps = [t.step for t in checkpoints.list_tags(str(ckpt_uri), read_meta=False)
             if t.complete and t.step is not None and t.done_mtime is not None and t.done_mtime < when]
    return max(steps, default=None)


def complete_steps(ckpt_uri: str) -> set[int]:
    from trainium_api import checkpoints
    return {t.step for t in checkpoints.list_tags(str(ckpt_uri), read_meta=False) if t.complete}


class Drill:
    """One run on the local control plane, with the means to break it and watch it."""

    def __init__(self, cluster: Cluster, namespace: str, body: dict):
        from kubernetes import client
        api = cluster.api_client()
        self.cluster, self.ns, self.body = cluster, namespace, body
        self.name = body["metadata"]["name"]
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        spec = body["spec"]
        self.ckpt_uri = spec["checkpoint"]["uri"]
        # the trainer's step log; a command trainer's test points this at its script's own record
        self.losses_path = Path((spec.get("logging") or {}).get("lossesFile") or "/nonexistent/losses.jsonl")
        self.events: list[tuple[float, str]] = []
        self.terminations: list = []  # faults.Termination of the spot-interruption fault: joined by the test

    def note(self, what: str) -> None:
        self.events.append((time.time(), what))

    def create(self) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.body)
        self.note("created")

    def obj(self) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.name)

    def status(self) -> dict:
        return self.obj().get("status") or {}

    def pods(self, attempt: int | None = None) -> list:
        sel = f"trainium.dev/run={self.name}" + (f",trainium.dev/attempt={attempt}" if attempt else "")
        return self.core.list_namespaced_pod(self.ns, label_selector=sel).items

    def trained_step(self) -> int:
        """The newest step the trainer finished (its losses file), 0 before the first."""
        try:
            records = read_losses(self.losses_path)
        except OSError:
            return 0
        return records[-1]["step"] if records else 0

    def wait(self, predicate, timeout: float, what: str, interval: float = 0.1):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                st = self.status()
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; phase {st.get('phase')}, "
                                     f"attempt {st.get('attempt')}, step {st.get('step')}, message {st.get('message')}")
            time.sleep(interval)

    def wait_phase(self, phase: str, timeout: float) -> dict:
        return self.wait(lambda: (s := self.status()).get("phase") == phase and s, timeout, f"phase {phase}")

    def wait_step(self, step: int, timeout: float) -> None:
        self.wait(lambda: self.trained_step() >= step, timeout, f"trainer at step {step}")

    def running_pod(self, index: int = 0):
        attempt = self.status().get("attempt")
        return next(p for p in self.pods(attempt) if p.metadata.labels.get("trainium.dev/index") == str(index)
                    and p.status.phase == "Running")

    def inject(self, kind: str, operator: Operator | None = None) -> str:
        """Break the run; returns the node or pod hit. Pod faults hit pod index 0."""
        pod = self.running_pod(0)
        node, pname = pod.spec.node_name, pod.metadata.name
        self.note(f"fault {kind}")
        if kind == "kill-rank":
            faults.kill_rank(self.cluster.pods_dir, self.ns, pname)
            return pname
        if kind == "hang":
            faults.hang_pod(self.cluster.pods_dir, self.ns, pname)
            return pname
        if kind == "agent-frozen":  # pod 0's agent stops answering, then a rank of pod 1 crashes
            faults.freeze_agent(self.cluster.pods_dir, self.ns, pname)
            faults.kill_rank(self.cluster.pods_dir, self.ns, self.running_pod(1).metadata.name)
            return pname
        if kind == "evict":
            faults.evict_pod(self.core, self.ns, pname)
            return pname
        if kind == "node-not-ready":
            faults.node_not_ready(self.core, node)
            return node
        if kind == "node-deleted":  # the instance terminated: the runner kills its processes
            faults.delete_node(self.core, node)
            return node
        if kind == "neuron-error":
            faults.neuron_error(self.core, node)
            return node
        if kind == "accelerated-hardware":  # the EKS node monitoring agent's word
            faults.accelerated_hardware(self.core, node, "NeuronHBMUncorrectableError")
            return node
        if kind == "spot-interruption":  # Karpenter's handling: event, taint, drain, the node gone at the deadline
            self.terminations.append(faults.spot_interruption(self.core, node, SPOT_NOTICE_SECONDS))
            return node
        if kind == "straggler":  # the run needs faultTolerance.stragglers: Replace to act on it
            self.slowed = faults.SlowPod(self.cluster.pods_dir, self.ns, pname, share=0.35)
            return node
        if kind == "runtime-fault":
            faults.runtime_fault(self.cluster.pods_dir, self.ns, pname)
            return node
        if kind == "runtime-restart":  # the runtime asks for a new process: the node stays
            faults.runtime_fault(self.cluster.pods_dir, self.ns, pname, faults.NUMERICAL_ERROR_LINE)
            return pname
        if kind == "operator-kill":
            # SIGKILL the operator while it restarts the gang after a crashed rank
            assert operator is not None
            faults.kill_rank(self.cluster.pods_dir, self.ns, pname)
            attempt = self.status()["attempt"]
            self.wait(lambda: self.status().get("phase") == "Restarting" or self.status().get("attempt") != attempt,
                      60, "the operator to begin the restart")
            operator.kill()
            self.note("operator SIGKILLed")
            time.sleep(1.0)
            operator.start()
            self.note("operator started again")
            return pname
        raise ValueError(f"unknown fault {kind!r} (known: {', '.join(FAULTS)})")


def process_nodes(cluster: Cluster, count: int, prefix: str) -> list[str]:
    from kubernetes import client
    core = client.CoreV1Api(cluster.api_client())
    return wait_ready(core, create_nodes(core, count, "cpu", prefix, processes=True))


def wait_ready(core, names: list[str], timeout: float = 60) -> list[str]:
    """Wait until kwok marks the process-backed nodes ``names`` Ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = [n for n in core.list_node(label_selector="localcluster.trainium.dev/processes=true").items
                 if n.metadata.name in names and any(c.type == "Ready" and c.status == "True"
                                                     for c in n.status.conditions or [])]
        if len(ready) == len(names):
            return names
        time.sleep(0.2)
    raise RuntimeError(f"process nodes {names} not Ready after {timeout:.0f}s")


def new_namespace(core, name: str, timeout: float = 60) -> str:
    """Create a namespace and wait for what pods need: the default ServiceAccount and the API
    server's CA ConfigMap (the service-account token volume mounts it)."""
    core.create_namespace({"metadata": {"name": name}})
    deadline = time.monotonic() + timeout
    while True:
        try:
            core.read_namespaced_service_account("default", name)
            core.read_namespaced_config_map("kube-root-ca.crt", name)
            return name
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def heal_process_nodes(core, timeout: float = 60) -> None:
    """Undo what a drill did to the process-backed nodes (faults, quarantine taints) and wait
    until every one is Ready and free of the node lifecycle controller's taints."""
    selector = "localcluster.trainium.dev/processes=true"
    for n in core.list_node(label_selector=selector).items:
        taints = [t for t in n.spec.taints or [] if t.key != "trainium.dev/quarantined"]
        if len(taints) != len(n.spec.taints or []):
            core.patch_node(n.metadata.name, {"spec": {"taints": [
                core.api_client.sanitize_for_serialization(t) for t in taints]},
                "metadata": {"labels": {"trainium.dev/quarantined": None}}})
        if any(c.type == "NeuronHealth" and c.status == "True" for c in n.status.conditions or []):
            faults.neuron_healthy(core, n.metadata.name)
        if any(c.type == faults.AGENT_CONDITION and c.status == "False" for c in n.status.conditions or []):
            faults.accelerated_hardware_ready(core, n.metadata.name)
        if n.spec.unschedulable or any(t.key in faults.keys.TERMINATION_NOTICE_TAINTS for t in n.spec.taints or []):
            faults.return_node(core, n.metadata.name)
        ann = n.metadata.annotations or {}
        if (n.metadata.labels or {}).get(faults.NOT_READY_LABEL) or ann.get(faults.PARTITIONED) or \
                ann.get(faults.KWOK_ANNOTATION[0]) != faults.KWOK_ANNOTATION[1]:
            faults.node_recover(core, n.metadata.name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        nodes = core.list_node(label_selector=selector).items
        if all(any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or []) and
               not any(t.key.startswith("node.kubernetes.io/") for t in n.spec.taints or []) for n in nodes):
            return
        time.sleep(0.2)
    raise AssertionError("process nodes did not become healthy again")


def kill_leftovers(pods_root: Path) -> None:
    """Stop every pod process the runner may have left (it normally kills them itself)."""
    for rec in podprocs.all_records(pods_root):
        if rec.get("initPid") and not rec.get("finished"):
            podprocs.kill_namespace(rec["initPid"], timeout=2)


@dataclass
class Timeline:
    """Fault -> detected -> new gang running -> first new step -> back at the failed step."""

    fault: float
    detected: float | None = None
    gang_running: float | None = None
    first_step: float | None = None
    caught_up: float | None = None
    failed_step: int = 0
    resumed_step: int | None = None
    operator_lost: dict = field(default_factory=dict)


def timeline(drill: Drill, fault_time: float, failed_step: int) -> Timeline:
    """Read the phases of one recovery from the trainer's records and the run's status."""
    st = drill.status()
    tl = Timeline(fault=fault_time, failed_step=failed_step, operator_lost=(st.get("goodput") or {}).get("lostSeconds") or {})
    failure = next((f for f in st.get("failures") or [] if f["time"] >= fault_time - 1), None)
    if failure:
        tl.detected = failure["time"]
        if failure.get("recoveredTime"):
            tl.gang_running = failure["recoveredTime"]
    # the new attempt's steps: from the first step of a process started after the fault
    records = read_losses(drill.losses_path)
    start = next((i for i, r in enumerate(records) if r["time"] > fault_time and first_of_process(r)), None)
    resumed = records[start:] if start is not None else []
    if resumed:
        tl.first_step = resumed[0]["time"]
        tl.resumed_step = resumed[0]["startStep"]
        tl.caught_up = next((r["time"] for r in resumed if r["step"] >= failed_step), None)
    return tl
