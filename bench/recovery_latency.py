"""Failure detection and recovery latency: the operator against JobSet and an Indexed Job, same cluster.

    python -m bench.recovery_latency [--nodes 16,128] [--faults 20] [--kinds crash,not-ready,neuron-health]
                                     [--peers jobset,job]

Starts its own local control plane (tools/localcluster) with nodes + 4 spare trn1.32xlarge
nodes, then for each gang size:
  ours  a TrainingRun; progress written as the trainer writes it; each fault is injected into
        the running gang; detect = the run's status records the failure; recover = every pod of
        the next attempt is Running. The pods have no agent (kwok runs no process), so every
        restart recreates the gang: today's path without in-place restarts.
  agents  the same TrainingRun with each pod's agent played by the benchmark (AgentStandIn, a
        stand-in for trainer.pod.agent: it answers the operator's orders on the pod as the agent
        does, at once); a crash is the agent's report that its workers exited (the pod stays),
        so it restarts in place, and a lost node replaces its pod alone; recover = the status
        records the next attempt's gang running (every agent running its workers).
  jobset  JobSet v0.12.0 (bench/jobset.py: built from its Go module, its controller run out of
        cluster like ours), one Job of ``nodes`` pods with backoffLimit 0 and failurePolicy
        Recreate: any failed rank restarts the whole gang, as Kubeflow Trainer v2 runs it;
        detect = status.restarts counts the restart; recover = every pod of the new attempt
        (label jobset.sigs.k8s.io/restart-attempt) is Running.
  job   an Indexed Job (completions = parallelism = nodes) with a podFailurePolicy (FailJob on
        the fatal exit code 78, Ignore on DisruptionTarget), as a user would run torchrun
        without the operator; detect = the Job controller creates a replacement pod; recover =
        the replacement is Running. The Job replaces only the failed index (a torchrun gang
        does not survive that) and leaves pods on NotReady nodes until taint-based eviction
        (300 s by default); waits are capped at --peer-timeout.
Faults: crash (a rank's container exits 1), not-ready (the node's kubelet reports NotReady),
neuron-health (the Neuron node problem detector's NeuronHealth condition turns True). Peers
that never react to a fault show ">cap" (--peer-timeout). Prints p50/p95 per gang size, method
and fault kind, the pods each restart created (median), and the ratios peer / ours for
detection and for recovery.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
# The node controller's grace period on the benchmark's control plane (tools/localcluster reads
# it at import): on two busy cores kwok's heartbeats for 1,000 simulated nodes and more lapse past
# the default 20 s, and nodes the benchmark did not touch go Unknown. Its node faults set the
# condition itself, which every method sees at once.
os.environ.setdefault("TRN_NODE_MONITOR_GRACE", "600s")

from bench.common import stop_cleanly_on_signals, table  # noqa: E402
from trainium_api import agent, gangorder, keys, progress  # noqa: E402

GROUP, VERSION, PLURAL = "trainium.dev", "v1alpha1", "trainingruns"


def wait(pred, timeout, interval=0.05):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = pred()
        if v:
            return time.monotonic() - t0
        time.sleep(interval)
    return None


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def fmt(x, cap=None):
    if x is None:
        return f">{cap:.0f}" if cap else "n/a"
    return f"{x:.2f}"


class Bench:
    def __init__(self, args):
        from kubernetes import client

        from localcluster.cluster import Cluster, free_base_port
        self.args = args
        self.cluster = Cluster(state_dir=Path(tempfile.mkdtemp(prefix="bench-cluster-")), base_port=free_base_port(25000))
        self.cluster.up()
        api = self.cluster.api_client()
        self.core, self.custom, self.batch = client.CoreV1Api(api), client.CustomObjectsApi(api), client.BatchV1Api(api)
        self.cluster.kubectl("apply", "-f", str(ROOT / "crds" / "trainingruns.trainium.dev.yaml"))
        self.cluster.wait_established("trainingruns.trainium.dev")
        env = dict(os.environ, KUBECONFIG=str(self.cluster.kubeconfig))
        log = open(os.environ["BENCH_OPERATOR_LOG"], "ab") if os.environ.get("BENCH_OPERATOR_LOG") else subprocess.DEVNULL
        self.operator = subprocess.Popen([sys.executable, "-m", "trainium_operator", "--metrics-port", "0",
                                          "--liveness-port", str(free_base_port(26000))], env=env,
                                         stdout=log, stderr=subprocess.STDOUT)  # (BENCH_OPERATOR_LOG: its log)
        self.jobset_controller = None
        self.spreads: dict[tuple[int, str], list[float]] = {}

    def close(self):
        if self.jobset_controller is not None:
            self.jobset_controller.close()
        self.operator.terminate()
        self.operator.wait(20)
        self.cluster.down()

    # -- helpers --------------------------------------------------------------------------

    def namespace(self, name):
        self.core.create_namespace({"metadata": {"name": name}})
        wait(lambda: self._sa(name), 30)

    def _sa(self, ns):
        try:
            return self.core.read_namespaced_service_account("default", ns)
        except Exception:
            return None

    def pods(self, ns, selector):
        return [p for p in self.core.list_namespaced_pod(ns, label_selector=selector).items
                if not p.metadata.deletion_timestamp]

    def heal(self, node):
        from localcluster import faults
        faults.return_node(self.core, node)
        wait(lambda: all(t.key not in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
                         for t in self.core.read_node(node).spec.taints or []), 60)

    def created_since(self, ns, before: set[str]) -> int:
        return len({p.metadata.uid for p in self.core.list_namespaced_pod(ns).items} - before)

    def uids(self, ns) -> set[str]:
        return {p.metadata.uid for p in self.core.list_namespaced_pod(ns).items}

    # -- ours -----------------------------------------------------------------------------

    @staticmethod
    def run_body(name: str, n: int) -> dict:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingRun", "metadata": {"name": name}, "spec": {
            "image": "trainer:bench", "nodes": n, "instanceType": "trn1.32xlarge", "model": {"preset": "llama2-7b"},
            "parallelism": {"tensor": 8, "sequenceParallel": True},
            "training": {"seqLen": 4096, "globalBatchSize": max(1024, 4 * n), "microBatchSize": 1},  # (DP is 4n)
            "data": {"sources": [{"uri": "s3://d/"}], "tokenizer": "s3://d/t.json"},
            "checkpoint": {"uri": f"/tmp/bench-ckpt-{os.getpid()}"},
            # (in place every time: the benchmark writes no checkpoint, which would end a streak)
            # the agents must answer within the grace and 15 s (inplace.answer_within): the
            # stand-in writes every pod's answer from this one process, about 50 a second on two
            # cores, so a large gang gets a grace that covers its pace (real agents answer side by side)
            "faultTolerance": {"teardownGraceSeconds": max(5, n // 16),
                               "restartBudget": {"application": 1000, "node": 1000},
                               "inPlaceRestarts": 1000,
                               "budgetWindowMinutes": 1, "noProgressRestarts": 1000, "maxQuarantinedNodes": 1000}}}

    def ours(self, n, ns, kinds):
        """The operator without agents: every restart recreates the gang."""
        def up(attempt):
            sel = f"trainium.dev/run=run,trainium.dev/attempt={attempt}"
            return len(p := self.pods(ns, sel)) == n and all(x.status.phase == "Running" for x in p)

        def gang(attempt):
            return self.pods(ns, f"trainium.dev/run=run,trainium.dev/attempt={attempt}")
        return self._faults("ours", n, ns, kinds, up, gang, lambda kind, victim, attempt: inject(
            self.core, kind, ns, victim))

    def gang(self, n, ns, kinds):
        """As agents, the agents reading the gang order (each with a watch of its own)."""
        return self.agents(n, ns, kinds, gang=True)

    def agents(self, n, ns, kinds, gang=False):
        """The operator with in-place restarts: each pod's agent played by AgentStandIn."""
        from trainium_operator import plan
        stand_in = AgentStandIn(self.core, ns, gang=gang, watches=n if gang else 0).start()

        def up(attempt):
            st = self._status(ns, "run")
            return st.get("attempt") == attempt and (st.get("current") or {}).get("gangRunningTime")

        def gang_pods(attempt):
            current = self._status(ns, "run").get("current") or {}
            names = plan.gang_pod_names("run", n, current.get("gangAttempt") or attempt, current.get("podNames") or [])
            return [self.core.read_namespaced_pod(pod, ns) for pod in names]

        def fault(kind, victim, attempt):
            if kind == "crash":  # with an agent the pod stays: its workers' exit is the agent's report
                stand_in.crash(victim.metadata.name, attempt)
            else:
                inject(self.core, kind, ns, victim)
        try:
            results = self._faults("gang" if gang else "agents", n, ns, kinds, up, gang_pods, fault,
                                   lambda: stand_in.order_writes)
            self.spreads[(n, "gang" if gang else "agents")] = stand_in.spreads()
            return results
        finally:
            stand_in.stop()

    def _faults(self, method, n, ns, kinds, up, gang, fault, writes=None):
        """One TrainingRun through --faults faults: wait for attempt ``up``, write the gang's
        (``gang``) progress, inject ``fault`` into one pod, time the detection (status.failureCount
        grows), then the recovery (the next attempt ``up``) and count the pods it created, and
        (``writes()``: the orders written so far) the orders it took."""
        name = "run"
        self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, self.run_body(name, n))
        results = {k: ([], [], [], []) for k in kinds}
        written = 0
        for i in range(self.args.faults + 1):
            attempt = i + 1
            if wait(lambda: up(attempt), 300, 0.02) is None:
                raise RuntimeError(f"attempt {attempt} did not come up: {self._status(ns, name).get('message')}")
            if i:
                results[kind][1].append(time.monotonic() - t_detect)
                results[kind][2].append(self.created_since(ns, before))
                results[kind][3].append(writes() - written if writes else None)
                if kind != "crash":
                    self.heal(bad)
            if i == self.args.faults:
                break
            pods = gang(attempt)
            before = self.uids(ns)
            payload = progress.ProgressReport(step=10 * attempt, time=time.time(), tokens_per_second=1e5, loss=2.0,
                                              attempt=attempt).to_annotation()
            for p in pods:
                self.core.patch_namespaced_pod(p.metadata.name, ns, {"metadata": {"annotations": {
                    keys.PROGRESS: payload}}})
            wait(lambda: self._status(ns, name).get("phase") == "Running", 60, 0.02)
            kind = kinds[i % len(kinds)]
            victim = pods[i % n]
            bad = victim.spec.node_name
            seen = self._status(ns, name).get("failureCount") or 0  # status keeps only the newest failures
            written = writes() if writes else 0
            fault(kind, victim, attempt)
            d = wait(lambda: (self._status(ns, name).get("failureCount") or 0) > seen, 120, 0.02)
            t_detect = time.monotonic()
            results[kind][0].append(d)
            restart = (self._status(ns, name).get("failures") or [{}])[-1].get("restart")
            print(f"  {method} n={n} fault {i + 1}/{self.args.faults} {kind}: detected {d:.2f}s, restart {restart}",
                  flush=True)
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        return results

    def _status(self, ns, name):
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name).get("status") or {}

    # -- peer: Indexed Job ------------------------------------------------------------------

    def job(self, n, ns, kinds):
        from localcluster import faults
        body = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "torchrun"}, "spec": {
            # backoffLimitPerIndex: each index gets its own failure backoff (10 s, doubling), the
            # Job's best configuration for replacing single ranks.
            "completions": n, "parallelism": n, "completionMode": "Indexed", "backoffLimitPerIndex": 10000,
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [78]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]},
            "template": self.pod_template("job")}}
        self.batch.create_namespaced_job(ns, body)
        results = {k: ([], [], []) for k in kinds}
        cap = self.args.peer_timeout
        for i in range(self.args.faults):
            wait(lambda: sum(x.status.phase == "Running" for x in self.pods(ns, "bench=job")) == n, 300)
            kind = kinds[i % len(kinds)]
            gang = sorted((p for p in self.pods(ns, "bench=job") if p.status.phase == "Running"),
                          key=lambda p: p.metadata.name)
            victim = gang[i % n]
            index = victim.metadata.labels.get("batch.kubernetes.io/job-completion-index")
            before = {p.metadata.name for p in self.core.list_namespaced_pod(ns, label_selector="bench=job").items}
            before_uids = self.uids(ns)
            inject(self.core, kind, ns, victim)

            def replacement():
                return next((p for p in self.pods(ns, f"bench=job,batch.kubernetes.io/job-completion-index={index}")
                             if p.metadata.name not in before), None)
            d = wait(replacement, cap, 0.02)
            r = wait(lambda: (rp := replacement()) is not None and rp.status.phase == "Running", cap) if d else None
            results[kind][0].append(d)
            results[kind][1].append(r)
            results[kind][2].append(len(self.uids(ns) - before_uids) if d else None)
            print(f"  job  n={n} fault {i + 1}/{self.args.faults} {kind}: replacement "
                  f"{fmt(d, cap)}s, running {fmt(r, cap)}s later", flush=True)
            if kind != "crash":
                self.heal(victim.spec.node_name)
                if d is None:  # the Job never reacted: clean the stuck index so the next fault starts clean
                    self.core.delete_namespaced_pod(victim.metadata.name, ns, grace_period_seconds=0)
        self.batch.delete_namespaced_job("torchrun", ns, propagation_policy="Background")
        return results

    # -- peer: JobSet -----------------------------------------------------------------------

    def jobset(self, n, ns, kinds):
        from bench import jobset as js
        if self.jobset_controller is None:
            self.cluster.kubectl("apply", "--server-side", "-f", str(js.crd_path()))
            if wait(lambda: self._established("jobsets.jobset.x-k8s.io"), 60) is None:
                raise RuntimeError("the JobSet CRD did not become Established")
            self.jobset_controller = js.Controller(self.cluster.kubeconfig, Path(tempfile.mkdtemp(prefix="bench-jobset-")))
        self.custom.create_namespaced_custom_object(js.GROUP, js.API_VERSION, ns, js.PLURAL,
                                                    js.gang("torchrun", n, self.pod_template("jobset")))
        results = {k: ([], [], []) for k in kinds}
        cap = self.args.peer_timeout

        def restarts():
            st = self.custom.get_namespaced_custom_object(js.GROUP, js.API_VERSION, ns, js.PLURAL, "torchrun")
            return (st.get("status") or {}).get("restarts") or 0

        def gang_running(attempt):
            pods = self.pods(ns, f"bench=jobset,jobset.sigs.k8s.io/restart-attempt={attempt}")
            return len(pods) == n and all(p.status.phase == "Running" for p in pods)
        for i in range(self.args.faults):
            before = restarts()
            if wait(lambda: gang_running(before), 300) is None:
                # (at 1,024 pods: a crashed rank's Job not restarted 5 minutes on): the faults not
                # injected count as never reacted to, the cap, and the table is still printed
                print(f"  jobset n={n}: attempt {before}'s gang not Running after 300 s: no more faults", flush=True)
                for j in range(i, self.args.faults):
                    for column in results[kinds[j % len(kinds)]][:3]:
                        column.append(None)
                break
            kind = kinds[i % len(kinds)]
            gang = sorted(self.pods(ns, f"bench=jobset,jobset.sigs.k8s.io/restart-attempt={before}"),
                          key=lambda p: p.metadata.name)
            victim = gang[i % n]
            before_uids = self.uids(ns)
            inject(self.core, kind, ns, victim)
            d = wait(lambda: restarts() > before, cap, 0.02)
            r = wait(lambda: gang_running(before + 1), cap) if d else None
            results[kind][0].append(d)
            results[kind][1].append(r)
            results[kind][2].append(len(self.uids(ns) - before_uids) if r else None)
            print(f"  jobset n={n} fault {i + 1}/{self.args.faults} {kind}: restart {fmt(d, cap)}s, "
                  f"new gang running {fmt(r, cap)}s later", flush=True)
            if kind != "crash":
                self.heal(victim.spec.node_name)
        self.custom.delete_namespaced_custom_object(js.GROUP, js.API_VERSION, ns, js.PLURAL, "torchrun")
        return results

    def _established(self, crd):
        from kubernetes import client
        try:
            obj = client.ApiextensionsV1Api(self.core.api_client).read_custom_resource_definition(crd)
        except Exception:
            return False
        return any(c.type == "Established" and c.status == "True" for c in obj.status.conditions or [])

    def pod_template(self, label):
        limits = {"aws.amazon.com/neuron": "16", "vpc.amazonaws.com/efa": "8"}
        return {"metadata": {"labels": {"trainium.dev/keep-running": "true", "bench": label}}, "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"node.kubernetes.io/instance-type": "trn1.32xlarge"},
            "tolerations": [{"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "trainer", "image": "trainer:bench",
                            "resources": {"limits": limits, "requests": limits}}]}}


class AgentStandIn:
    """A stand-in for every pod's agent (trainer.pod.agent) in one namespace: kwok runs no process,
    so this answers the operator's orders as the agent does, with no workers to stop: a running
    pod reports ``running`` for its attempt, an order to stop is answered ``ready``, an order to
    start ``running``, a pod created to replace another (TRAINER_AGENT_AWAIT_START) reports
    ``ready`` for its attempt; :meth:`crash` makes a pod report that its workers exited, until a
    newer attempt is ordered. One watch of the pods (the agents have one each); its reports are
    written by 32 threads, as independent agents write theirs side by side (one thread would
    serialise 128 pods' reports and time itself, not the operator).

    ``gang``: the agents read the run's gang order (trainium_api.gangorder; their reports say
    so, and the operator writes no order on the pods), watched here by ``watches`` watches of
    their own, as each agent watches it: each order's arrival at every one is timed. Without
    it the agents are an older image's and are ordered on their pods. Either way every order
    the operator writes is counted (``order_writes``) and each step's spread, from the first
    agent that has it to the last (``spreads``)."""

    def __init__(self, core, ns: str, gang: bool = False, watches: int = 0, run: str = "run"):
        import threading
        self.core, self.ns, self.gang, self.run = core, ns, gang, run
        self.crashed: dict[str, int] = {}
        from concurrent.futures import ThreadPoolExecutor
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, daemon=True)]
        if gang:
            self.threads.append(threading.Thread(target=self._gang_loop, daemon=True))
            self.threads += [threading.Thread(target=self._agent_watch, daemon=True) for _ in range(watches)]
            # the agents' watches, each on a connection of its own (as each agent has)
            from kubernetes import client
            cfg = copy.copy(core.api_client.configuration)
            cfg.connection_pool_maxsize = watches + 8
            self.watch_core = client.CoreV1Api(client.ApiClient(cfg))
        self.writers = ThreadPoolExecutor(32)
        self.written: dict[str, tuple[int, str]] = {}  # pod -> the report last sent (not yet seen back)
        self.pods: dict[str, object] = {}  # the newest of each pod, as watched
        self.order: gangorder.GangOrder | None = None
        self.order_writes = 0
        self._pod_orders: dict[str, str] = {}  # pod -> its order annotation as last seen
        self._steps: dict[tuple, list[float]] = {}  # (attempt, start) -> when each agent first had it
        self._arrivals: dict[str, list[float]] = {}  # a gang order's resourceVersion -> arrival at each watch
        self._gang_versions: list[str] = []

    def start(self) -> "AgentStandIn":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.writers.shutdown(wait=False, cancel_futures=True)

    def spreads(self) -> list[float]:
        """Each order step's spread: from the first agent that had it to the last (seconds)."""
        if self.gang:
            with self.lock:
                return [max(t) - min(t) for t in self._arrivals.values() if t]
        with self.lock:
            return [max(t) - min(t) for t in self._steps.values() if t]

    def _write(self, pod: str, want: agent.Report) -> None:
        try:
            self.core.patch_namespaced_pod(pod, self.ns, {"metadata": {"annotations": {
                keys.AGENT_REPORT: agent.report_payload(agent.Report(want.attempt, want.state, time=time.time(),
                                                                     gang_orders=self.gang))}}})
        except Exception as exc:  # a pod deleted meanwhile: its report is moot
            if not self.stopped.is_set():
                print(f"  agent stand-in: {pod}: {str(exc)[:100]}", flush=True)
            self.written.pop(pod, None)

    def crash(self, pod: str, attempt: int) -> None:
        self.crashed[pod] = attempt
        self.core.patch_namespaced_pod(pod, self.ns, {"metadata": {"annotations": {keys.AGENT_REPORT: agent.report_payload(
            agent.Report(attempt, "exited", 1, "simulated worker crash", time.time(), gang_orders=self.gang))}}})

    def wanted(self, pod) -> agent.Report | None:
        meta = pod.metadata
        if meta.deletion_timestamp or pod.status.phase != "Running":
            return None
        ann = meta.annotations or {}
        order = agent.parse_order(ann.get(keys.ORDER))
        gang = self.order.for_pod(self.run, meta.name) if self.order is not None else None
        if gang is not None and (order is None or (gang.attempt, gang.start) > (order.attempt, order.start)):
            order = gang
        attempt = int((meta.labels or {}).get("trainium.dev/attempt", "1"))
        if order is not None and order.attempt >= attempt:
            if self.crashed.get(meta.name, 0) >= order.attempt:
                return None
            return agent.Report(order.attempt, "running" if order.start else "ready")
        if meta.name in self.crashed:
            return None
        waits = any(e.name == agent.AWAIT_START_ENV for e in pod.spec.containers[0].env or [])
        return agent.Report(attempt, "ready" if waits else "running")

    def _answer(self, pod) -> None:
        want = self.wanted(pod)
        have = agent.parse_report((pod.metadata.annotations or {}).get(keys.AGENT_REPORT))
        key, name = (want.attempt, want.state) if want else None, pod.metadata.name
        if want is not None and (have is None or (have.attempt, have.state) != key) and self.written.get(name) != key:
            self.written[name] = key
            self.writers.submit(self._write, name, want)

    def _count_pod_order(self, pod, now: float) -> None:
        text = (pod.metadata.annotations or {}).get(keys.ORDER)
        if text and self._pod_orders.get(pod.metadata.name) != text:
            self._pod_orders[pod.metadata.name] = text
            order = agent.parse_order(text)
            with self.lock:
                self.order_writes += 1
                if order is not None:
                    self._steps.setdefault((order.attempt, order.start), []).append(now)

    def _loop(self) -> None:
        from kubernetes import watch
        while not self.stopped.is_set():
            try:
                for event in watch.Watch().stream(self.core.list_namespaced_pod, self.ns, timeout_seconds=30):
                    if self.stopped.is_set():
                        return
                    pod, now = event["object"], time.time()
                    if event["type"] == "DELETED":
                        self.pods.pop(pod.metadata.name, None)
                        continue
                    self.pods[pod.metadata.name] = pod
                    self._count_pod_order(pod, now)
                    self._answer(pod)
            except Exception as exc:  # a patch racing a deletion, a watch ended: watch again
                if not self.stopped.is_set():
                    print(f"  agent stand-in: {str(exc)[:120]}; watching again", flush=True)
                    time.sleep(0.2)

    def _gang_events(self, core=None, since: str | None = None):
        from kubernetes import watch
        extra = {"resource_version": since} if since else {}
        return watch.Watch().stream((core or self.core).list_namespaced_config_map, self.ns,
                                    field_selector=f"metadata.name={gangorder.object_name(self.run)}",
                                    timeout_seconds=300, **extra)

    def _gang_loop(self) -> None:
        """The gang order as the agents follow it: every pod answers it."""
        while not self.stopped.is_set():
            try:
                for event in self._gang_events():
                    if self.stopped.is_set():
                        return
                    cm = event["object"]
                    if event["type"] == "DELETED":
                        continue
                    rv = cm.metadata.resource_version
                    with self.lock:
                        if rv not in self._gang_versions:
                            self._gang_versions.append(rv)
                            self.order_writes += 1
                    self.order = gangorder.parse((cm.data or {}).get(gangorder.DATA_KEY))
                    for pod in list(self.pods.values()):
                        self._answer(pod)
            except Exception as exc:
                if not self.stopped.is_set():
                    print(f"  agent stand-in (gang order): {str(exc)[:120]}; watching again", flush=True)
                    time.sleep(0.2)

    def _agent_watch(self) -> None:
        """One agent's watch of the gang order: when each version first arrives here (a renewed
        watch goes on from the last version it saw: no version is seen twice)."""
        seen: set[str] = set()
        last = None
        while not self.stopped.is_set():
            try:
                for event in self._gang_events(self.watch_core, last):
                    if self.stopped.is_set():
                        return
                    rv = event["object"].metadata.resource_version
                    if event["type"] in ("ADDED", "MODIFIED") and rv not in seen:
                        now = time.time()
                        seen.add(rv)
                        with self.lock:
                            self._arrivals.setdefault(rv, []).append(now)
                    last = rv
            except Exception:
                last = None  # (a 410: from the current state)
                if not self.stopped.is_set():
                    time.sleep(0.2)


def inject(core, kind, ns, victim):
    from localcluster import faults
    try:
        faults.inject(core, kind, ns, victim)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


PEERS = {"jobset": "jobset", "job": "indexed-job"}
METHODS = {"gang": "operator, in place / replace, gang order", "agents": "operator, in place / replace, pod orders",
           "ours": "operator, recreate (no agents)"}


def main() -> None:
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="16")
    ap.add_argument("--faults", type=int, default=20, help="faults per method and gang size")
    ap.add_argument("--kinds", default="crash,not-ready,neuron-health")
    ap.add_argument("--methods", default="gang,agents,ours", help="comma-separated: gang (in-place restarts, the "
                    "agents played by the benchmark, reading the gang order), agents (the same, agents of an older "
                    "image: orders written on their pods), ours (no agents: the gang recreated)")
    ap.add_argument("--peers", default="jobset,job", help="comma-separated: jobset, job (Indexed Job)")
    ap.add_argument("--peer-timeout", type=float, default=30.0)
    args = ap.parse_args()
    stop_cleanly_on_signals()  # a timed-out or cancelled benchmark still stops its control plane
    kinds, peers = args.kinds.split(","), [p for p in args.peers.split(",") if p]
    methods = [m for m in args.methods.split(",") if m]
    unknown = (set(peers) - set(PEERS)) | (set(methods) - set(METHODS))
    if unknown or not methods:
        raise SystemExit(f"unknown method or peer {sorted(unknown)}: methods {', '.join(METHODS)}; peers "
                         f"{', '.join(PEERS)}")
    if "jobset" in peers:
        from bench import jobset
        jobset.build()  # before the control plane starts: a first build takes minutes
    b = Bench(args)
    rows = []
    try:
        from localcluster.nodes import create_nodes
        for n in [int(x) for x in args.nodes.split(",")]:
            create_nodes(b.core, n + 4, "trn1.32xlarge", f"b{n}-")
            for method in (*methods, *peers):
                ns = f"bench-{method}-{n}"
                b.namespace(ns)
                res = getattr(b, method)(n, ns, kinds)
                for kind, (det, rec, made, *orders) in res.items():
                    rows.append((n, method, kind, det, rec, made, orders[0] if orders else []))
            for node in b.core.list_node(label_selector="type=kwok").items:
                b.core.delete_node(node.metadata.name)
    finally:
        b.close()
    print("\nDetection and recovery latency (seconds; recover = from detection until every pod of the new gang "
          "is Running, with agents until the status records it running its workers; for the Indexed Job, until "
          "its one replacement pod is Running), and the pods each restart created (median)")
    print(table(["nodes", "method", "fault", "n", "detect p50", "detect p95", "recover p50", "recover p95",
                 "pods created"], result_rows(rows, kinds, methods, peers, args.peer_timeout)))
    ordered = [m for m in ("gang", "agents") if m in methods]
    if ordered:
        print("\nThe orders of each restart: API writes of orders (median per fault kind), and each order's spread "
              "from the first agent that had it to the last (gang order: across one watch per agent; pod orders: "
              "across the pods' watch events)")
        print(table(["nodes", "method", "fault", "order writes", "spread p50", "spread max"],
                    order_rows(rows, b.spreads, kinds, ordered)))


def result_rows(rows, kinds, methods, peers, cap):
    """The table: per gang size and fault, the operator's methods, each peer, and the ratios
    other / the first method of the p50s (a peer that never reacted counts as the cap, marked +)."""
    out = []
    for n in sorted({r[0] for r in rows}):
        for kind in kinds:
            first = next(r for r in rows if r[0] == n and r[1] == methods[0] and r[2] == kind)
            for other in (*methods, *peers):
                r = next(r for r in rows if r[0] == n and r[1] == other and r[2] == kind)
                label = METHODS.get(other) or PEERS[other]
                limit = None if other in METHODS else cap
                out.append([n, label, kind, len(r[3]), fmt(pct(r[3], .5), limit), fmt(pct(r[3], .95), limit),
                            fmt(pct(r[4], .5), limit), fmt(pct(r[4], .95), limit), fmt_count(pct(r[5], .5))])
                if other != methods[0]:
                    out.append([n, f"ratio {label} / {METHODS[methods[0]]}", kind, "",
                                _ratio(pct(r[3], .5), pct(first[3], .5), cap), "",
                                _ratio(pct(r[4], .5), pct(first[4], .5), cap), "", ""])
    return out


def order_rows(rows, spreads, kinds, ordered):
    """Per gang size and fault: the order writes of each ordering, and the ratio pod orders /
    gang order."""
    out = []
    for n in sorted({r[0] for r in rows}):
        for kind in kinds:
            writes = {m: pct(next(r for r in rows if r[0] == n and r[1] == m and r[2] == kind)[6], .5)
                      for m in ordered}
            for m in ordered:
                spread = spreads.get((n, m), [])
                out.append([n, METHODS[m], kind, fmt_count(writes[m]), fmt(pct(spread, .5)),
                            fmt(max(spread) if spread else None)])
            if len(ordered) == 2 and writes["gang"]:
                out.append([n, "ratio pod orders / gang order", kind,
                            f"{(writes['agents'] or 0) / writes['gang']:.0f}x", "", ""])
    return out


def fmt_count(x) -> str:
    return "n/a" if x is None else str(int(x))


def _ratio(peer, ours, cap):
    if not ours:
        return "n/a"
    return f"{(peer or cap) / ours:.2f}x" + ("+" if peer is None else "")


if __name__ == "__main__":
    main()
