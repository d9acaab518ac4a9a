"""Faults the operator must react to, each producing the real Kubernetes signal, each reversible.

| fault            | signal                                                        | undo            |
|------------------|---------------------------------------------------------------|-----------------|
| node_not_ready   | Ready=False (kwok's node-not-ready stage); controller-manager  | node_recover    |
|                  | taints node.kubernetes.io/not-ready                           |                 |
| node_unreachable | no status posts and no Lease renewals (a dead kubelet);       | node_recover    |
|                  | Ready=Unknown after the grace period; unreachable taint       |                 |
| node_partition   | as node_unreachable, but the kubelet and its pods live on      | node_recover    |
|                  | (a control-plane or network blip: the node only looks lost);  |                 |
|                  | partition_together: many nodes, Unknown at once, no flapping  |                 |
| neuron_error     | Node condition NeuronHealth=True, reason NeuronHasError_*      | neuron_healthy  |
|                  | (as the Neuron node problem detector writes it; Ready stays)  |                 |
| accelerated_     | the EKS node monitoring agent's AcceleratedHardwareReady=False | accelerated_    |
|  hardware        | with a Neuron reason (NeuronHBMUncorrectableError, ...)        |  hardware_ready |
| device_loss      | allocatable aws.amazon.com/neuron below capacity              | device_restore  |
| device_plugin_   | every node's Neuron devices unregistered, then registered      | (ends itself)   |
|  restart         | again after N seconds (a device-plugin rollout)                |                 |
| karpenter_       | Karpenter's termination: taint karpenter.sh/disrupted, drain   | return_node     |
|  disrupt         | through the Eviction API (a PodDisruptionBudget holds it), the |                 |
|                  | node deleted once drained                                      |                 |
| spot_            | as Karpenter handles EC2's interruption warning: a             | return_node     |
|  interruption    | SpotInterrupted event, the taint and the drain, and the node  | (before the     |
|                  | deleted at the notice's end whatever held the drain (2 min)   |  deadline)      |
| delete_node      | the Node object is gone                                        | create it again |
| pod_fail         | pod phase Failed, container terminated with the exit code     | delete the pod  |
|                  | (kwok's pod-container-running-failed stage)                   |                 |
| evict_pod        | an Eviction through the API (policy/v1)                       | n/a             |
| freeze_agent     | SIGSTOP of a process-backed pod's agent alone: its workers     | (the pod's      |
|                  | run on, and no order is answered                               |  deletion)      |
| hang_pod         | SIGSTOP of every process of a process-backed pod: Running,     | unhang_pod      |
|                  | silent                                                         |                 |
| kill_rank        | SIGKILL of one torchrun worker of a process-backed pod         | n/a             |
| apiserver_down   | kube-apiserver stopped for N seconds, then started again      | (ends itself)   |
| etcd_restart     | etcd stopped for N seconds (0: a restart), then started again | (ends itself)   |

On process-backed nodes (podrunner.py) the node faults are real for processes too: NotReady,
unreachable and deleted nodes SIGKILL every process placed on them; a partitioned node keeps them.
"""

from __future__ import annotations

import contextlib
import os

from datetime import datetime, timezone

from trainium_api import keys, nodesignals

from .nodes import KWOK_ANNOTATION, NEURON, NEURONCORE, PARTITIONED

NOT_READY_LABEL = "node-not-ready.stage.kwok.x-k8s.io"
POD_FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
NEURON_CONDITION = nodesignals.NEURON_HEALTH.type
NEURON_REASONS = nodesignals.NEURON_HEALTH_REASONS
AGENT_CONDITION = nodesignals.ACCELERATED_HARDWARE.type


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _lease_now() -> str:
    """Now as a Lease's renewTime (MicroTime: microseconds)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_not_ready(core, node: str, reason: str = "KubeletNotReady", message: str = "simulated node failure") -> None:
    core.patch_node(node, {"metadata": {"labels": {NOT_READY_LABEL: "true"},
                                        "annotations": {f"{NOT_READY_LABEL}/reason": reason,
                                                        f"{NOT_READY_LABEL}/message": message}}})


FAULT_HOLDER = "trainium-fault-unreachable"


def node_unreachable(core, node: str) -> None:
    """What a dead kubelet looks like: nobody posts the node's status or renews its Lease.
    kwok stops posting status once the node loses its management annotation; it would still
    renew the Lease, so the Lease is taken over by another holder with a long duration (kwok
    never renews a lease held by someone else). The node lifecycle controller then marks the
    node Unknown after its grace period and taints it unreachable."""
    from kubernetes import client

    core.patch_node(node, {"metadata": {"annotations": {KWOK_ANNOTATION[0]: None}}})
    client.CoordinationV1Api(core.api_client).patch_namespaced_lease(node, "kube-node-lease", {"spec": {
        "holderIdentity": FAULT_HOLDER, "leaseDurationSeconds": 86400,
        "renewTime": _lease_now()}})


def node_partition(core, node: str) -> None:
    """The node drops out of the control plane's view (no status, no Lease renewals: Unknown
    after the grace period, as node_unreachable) while its kubelet and pods keep running, as in
    a control-plane or network disruption. The pod runner reads the annotation and keeps the
    node's processes."""
    core.patch_node(node, {"metadata": {"annotations": {PARTITIONED: "true"}}})
    node_unreachable(core, node)


def kwok_heartbeat_max_seconds(process_nodes: bool = False) -> float:
    """The longest kwok waits between a node's heartbeats (stages.yaml: delay plus jitter of
    node-heartbeat, or of node-heartbeat-process for process-backed nodes, which beat faster)."""
    from pathlib import Path

    import yaml
    name = "node-heartbeat-process" if process_nodes else "node-heartbeat"
    for stage in yaml.safe_load_all((Path(__file__).parent / "stages.yaml").read_text()):
        if stage and stage["metadata"]["name"] == name:
            delay = stage["spec"]["delay"]
            return (delay["durationMilliseconds"] + delay.get("jitterDurationMilliseconds", 0)) / 1000
    raise LookupError(f"stages.yaml has no {name} stage")


def partition_together(core, nodes: list[str], margin: float = 3.0) -> float:
    """node_partition of every node, so that they go Unknown together and stay Unknown; returns
    when the last heartbeat kwok had scheduled has fired (about 11 s for process-backed nodes,
    18 s for simulated ones), the nodes still Ready.

    kwok filters its node watch by the management annotation, so taking the annotation away
    reaches it as no event at all: a heartbeat it had already scheduled (up to
    kwok_heartbeat_max_seconds ahead) still fires and posts Ready=True. Fired after the node
    went Unknown, it brings the node back for one grace period (a disruption that flaps, seen
    in a CI rehearsal). So the fault keeps renewing the nodes' Leases itself until every such
    heartbeat has fired, then stops: the node controller marks them all Unknown one grace
    period later, and nothing posts for them again until node_recover."""
    import time

    from kubernetes import client
    leases = client.CoordinationV1Api(core.api_client)
    for node in nodes:
        node_partition(core, node)
    from .nodes import is_process_node
    drain = max(kwok_heartbeat_max_seconds(is_process_node(n)) for n in nodes) + margin
    until = time.monotonic() + drain
    while time.monotonic() < until:
        stamp = _lease_now()
        for node in nodes:
            leases.patch_namespaced_lease(node, "kube-node-lease", {"spec": {"renewTime": stamp}})
        time.sleep(min(2.0, max(0.0, until - time.monotonic())))
    return drain


def node_recover(core, node: str, timeout: float = 60) -> None:
    """Undo node_not_ready / node_unreachable / node_partition: kwok manages the node again (a
    fresh Lease, Ready status). The controller-manager then removes its not-ready/unreachable
    taints. A partitioned node stays marked until it is Ready again, so the pod runner never
    sees it lost on the way back."""
    import time

    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    leases = client.CoordinationV1Api(core.api_client)
    try:
        if leases.read_namespaced_lease(node, "kube-node-lease").spec.holder_identity == FAULT_HOLDER:
            leases.delete_namespaced_lease(node, "kube-node-lease")
    except ApiException as exc:
        if exc.status != 404:
            raise
    partitioned = (core.read_node(node).metadata.annotations or {}).get(PARTITIONED)
    core.patch_node(node, {"metadata": {"labels": {NOT_READY_LABEL: None},
                                        "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1],
                                                        f"{NOT_READY_LABEL}/reason": None,
                                                        f"{NOT_READY_LABEL}/message": None}}})
    if not partitioned:
        return
    deadline = time.monotonic() + timeout
    while not any(c.type == "Ready" and c.status == "True" for c in core.read_node(node).status.conditions or []):
        if time.monotonic() > deadline:
            raise TimeoutError(f"node {node} not Ready {timeout:.0f}s after its partition ended")
        time.sleep(0.2)
    core.patch_node(node, {"metadata": {"annotations": {PARTITIONED: None}}})


def _neuron_condition(core, node: str, status: str, reason: str, message: str) -> None:
    cond = {"type": NEURON_CONDITION, "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}
    core.patch_node_status(node, {"status": {"conditions": [cond]}})  # strategic merge by type


def neuron_error(core, node: str, reason: str = NEURON_REASONS[0]) -> None:
    if not reason.startswith("NeuronHasError_"):
        raise ValueError(f"reason must be NeuronHasError_*, got {reason!r}")
    _neuron_condition(core, node, "True", reason, "Neuron device error detected (simulated)")


def neuron_healthy(core, node: str) -> None:
    _neuron_condition(core, node, "False", "NeuronHasNoError", "Neuron has no error")


def accelerated_hardware(core, node: str, reason: str = "NeuronHBMUncorrectableError") -> None:
    """AcceleratedHardwareReady False, as the EKS node monitoring agent writes it when its Neuron
    monitor reads ``NEURON_HW_ERR=...`` in the kernel log (a Fatal reason: the condition, no Event)."""
    if reason not in nodesignals.AGENT_NEURON_REASONS:
        raise ValueError(f"reason must be one of {', '.join(nodesignals.AGENT_NEURON_REASONS)}, got {reason!r}")
    _agent_condition(core, node, AGENT_CONDITION, reason, nodesignals.AGENT_NEURON_REASONS[reason])


def accelerated_hardware_ready(core, node: str) -> None:
    """The agent's healthy condition (what it writes when it starts: only its restart clears a
    fault, or the node's replacement)."""
    _agent_condition(core, node, AGENT_CONDITION, None, "")


def _agent_condition(core, node: str, kind: str, reason: str | None, message: str) -> None:
    ready_reason, ready_message = nodesignals.AGENT_READY_REASONS[kind]
    cond = {"type": kind, "status": "True" if reason is None else "False", "reason": reason or ready_reason,
            "message": message if reason else ready_message, "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}
    core.patch_node_status(node, {"status": {"conditions": [cond]}})


def device_loss(core, node: str, remaining: int) -> None:
    """Allocatable Neuron devices drop to ``remaining`` (capacity unchanged), as the device
    plugin reports when devices fail."""
    core.patch_node_status(node, {"status": {"allocatable": {NEURON: str(remaining), NEURONCORE: str(2 * remaining)}}})


def device_restore(core, node: str) -> None:
    cap = core.read_node(node).status.capacity or {}
    if NEURON not in cap:
        return  # a node without Neuron devices
    core.patch_node_status(node, {"status": {"allocatable": {NEURON: cap[NEURON], NEURONCORE: cap[NEURONCORE]}}})


def device_plugin_restart(core, nodes: list[str], seconds: float) -> None:
    """A device-plugin rollout across ``nodes`` at once: every node's Neuron devices unregistered
    (allocatable 0) for ``seconds``, then registered again. Blocks for ``seconds``."""
    import time
    for node in nodes:
        device_loss(core, node, 0)
    time.sleep(seconds)
    for node in nodes:
        device_restore(core, node)


SPOT_NOTICE_SECONDS = 120.0
"""EC2's Spot interruption warning comes two minutes before the instance is reclaimed."""


class Termination:
    """A node's end as Karpenter's termination controller brings it (kubernetes-sigs/karpenter,
    pkg/controllers/node/termination): the node tainted ``karpenter.sh/disrupted:NoSchedule``,
    its pods evicted through the Eviction API (a PodDisruptionBudget that refuses holds them, and
    the eviction is tried again), and the node deleted once drained; with ``deadline`` (a Spot
    interruption) the node is deleted then whatever still runs on it: EC2 reclaims the instance.
    The drain runs on a thread; :meth:`wait` joins it, :meth:`cancel` stops it (the node stays)."""

    def __init__(self, core, node: str, deadline: float | None = None, period: float = 1.0):
        import threading
        self.core, self.node, self.deadline, self.period = core, node, deadline, period
        self.stopped = threading.Event()
        self.deleted_at: float | None = None
        _taint(core, node, {"key": keys.KARPENTER_DISRUPTED, "effect": "NoSchedule"})
        self.thread = threading.Thread(target=self._drain, name=f"terminate-{node}", daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        import time
        from kubernetes.client.exceptions import ApiException
        end = time.monotonic() + self.deadline if self.deadline is not None else None
        while not self.stopped.is_set():
            # drained once no pod is left, terminating ones included: Karpenter waits for them to
            # end (a pod deleted gracefully saves meanwhile) before the instance goes
            pods = [p for p in self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node}").items
                    if p.status.phase not in ("Succeeded", "Failed")]
            for p in pods:
                if p.metadata.deletion_timestamp:
                    continue
                with contextlib.suppress(ApiException):  # 429: a budget holds it; 404: gone meanwhile
                    evict_pod(self.core, p.metadata.namespace, p.metadata.name)
            if not pods or (end is not None and time.monotonic() >= end):
                with contextlib.suppress(ApiException):
                    self.core.delete_node(self.node)
                    self.deleted_at = time.time()
                return
            self.stopped.wait(self.period)

    def wait(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def cancel(self) -> None:
        self.stopped.set()
        self.thread.join(10)


def karpenter_disrupt(core, node: str) -> Termination:
    """Karpenter disrupts ``node`` (consolidation, drift, expiry): tainted, drained, deleted once empty."""
    return Termination(core, node)


def spot_interruption(core, node: str, notice_seconds: float = SPOT_NOTICE_SECONDS) -> Termination:
    """EC2's Spot interruption warning for ``node``, as Karpenter's interruption controller handles
    it (pkg/controllers/interruption): a SpotInterrupted Warning event on the Node, then the
    termination (taint, drain), and the node deleted ``notice_seconds`` after the warning."""
    _node_event(core, node, "SpotInterrupted", "Spot interruption warning was triggered")
    return Termination(core, node, deadline=notice_seconds)


def _taint(core, node: str, taint: dict) -> None:
    n = core.read_node(node)
    taints = [core.api_client.sanitize_for_serialization(t) for t in n.spec.taints or [] if t.key != taint["key"]]
    core.patch_node(node, {"spec": {"taints": [*taints, taint]}})


def _node_event(core, node: str, reason: str, message: str) -> None:
    n = core.read_node(node)
    core.create_namespaced_event("default", {
        "metadata": {"generateName": f"{node}."}, "type": "Warning", "reason": reason, "message": message,
        "involvedObject": {"kind": "Node", "name": node, "uid": n.metadata.uid, "apiVersion": "v1"},
        "source": {"component": "karpenter"}, "firstTimestamp": _now(), "lastTimestamp": _now(), "count": 1})


def return_node(core, node: str) -> None:
    """Undo a node fault and the quarantine that followed, as an admin returning a repaired node
    would: Ready again, NeuronHealth and AcceleratedHardwareReady healthy, devices back, the
    operator's quarantine taint and the termination notices removed, uncordoned."""
    node_recover(core, node)
    neuron_healthy(core, node)
    accelerated_hardware_ready(core, node)
    device_restore(core, node)
    n = core.read_node(node)
    taints = [core.api_client.sanitize_for_serialization(t) for t in n.spec.taints or []
              if t.key != keys.QUARANTINE_TAINT and t.key not in keys.TERMINATION_NOTICE_TAINTS]
    core.patch_node(node, {"spec": {"taints": taints, "unschedulable": None}})


def inject(core, kind: str, namespace: str, pod) -> None:
    """One benchmark fault into a running pod (a V1Pod) of a gang: ``crash`` (its container exits
    1), ``not-ready`` (its node's kubelet) or ``neuron-health`` (its node's NeuronHealth)."""
    if kind == "crash":
        pod_fail(core, namespace, pod.metadata.name, 1)
    elif kind == "not-ready":
        node_not_ready(core, pod.spec.node_name)
    elif kind == "neuron-health":
        neuron_error(core, pod.spec.node_name)
    else:
        raise ValueError(f"unknown fault kind {kind!r} (crash, not-ready, neuron-health)")


def delete_node(core, node: str) -> None:
    core.delete_node(node)


def pod_fail(core, namespace: str, pod: str, exit_code: int = 1, reason: str = "Error",
             message: str = "simulated container failure") -> None:
    core.patch_namespaced_pod(pod, namespace, {"metadata": {
        "labels": {POD_FAIL_LABEL: "true"},
        "annotations": {f"{POD_FAIL_LABEL}/exit-code": str(exit_code), f"{POD_FAIL_LABEL}/reason": reason,
                        f"{POD_FAIL_LABEL}/message": message}}})


def pod_succeed(core, namespace: str, pod: str) -> None:
    """The pod's trainer finishes: exit 0, phase Succeeded."""
    pod_fail(core, namespace, pod, exit_code=0, reason="Completed", message="")


def evict_pod(core, namespace: str, pod: str) -> None:
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}}
    core.create_namespaced_pod_eviction(pod, namespace, body)


# -- faults on the processes of process-backed pods (podrunner.py) -----------------------------
# These act on this machine's processes, found through the runner's records (podprocs.py).

def hang_pod(pods_root, namespace: str, pod: str) -> list[int]:
    """SIGSTOP every process of the pod but its agent (in-place restarts): it stays Running and
    its workers write nothing, like a job stuck in a collective or a frozen device (the
    process around the workers still answers). Returns the PIDs stopped; ``unhang_pod`` undoes it."""
    import signal

    from . import podprocs
    return podprocs.signal_all(podprocs.live_init_pid(podprocs.latest_pod_dir(pods_root, namespace, pod)),
                               signal.SIGSTOP, spare_agent=True)


def freeze_agent(pods_root, namespace: str, pod: str) -> list[int]:
    """SIGSTOP the pod's agent alone (in-place restarts): its workers run on, but it answers no
    order and writes no report, as an agent stuck in the kernel or starved. Returns the PIDs
    stopped (the pod's deletion kills them: SIGKILL of its namespace after the grace)."""
    import signal

    from . import podprocs
    stopped = []
    for pid in podprocs.namespace_pids(podprocs.live_init_pid(podprocs.latest_pod_dir(pods_root, namespace, pod))):
        if podprocs.is_agent(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
    return stopped


def unhang_pod(pods_root, namespace: str, pod: str) -> list[int]:
    import signal

    from . import podprocs
    return podprocs.signal_all(podprocs.live_init_pid(podprocs.latest_pod_dir(pods_root, namespace, pod)),
                               signal.SIGCONT)


class SlowProcesses:
    """Slow processes down: those ``find()`` returns (asked again each period, so processes
    started meanwhile are slowed too) get ``share`` of the time, SIGSTOPped and SIGCONTed in turn
    every ``period`` seconds by a thread, until ``stop()`` or until none is left (then the thread
    ends by itself, after a last SIGCONT). Their computation stretches; nothing fails."""

    def __init__(self, find, share: float = 0.2, period: float = 0.1, name: str = "slow"):
        import threading
        self.find, self.share, self.period = find, share, period
        self.pids = find()
        if not self.pids:
            raise LookupError(f"{name}: no processes to slow (yet)")
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._cycle, daemon=True, name=name)
        self._thread.start()

    def _signal(self, sig) -> bool:
        import contextlib
        import os
        alive = False
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                os.kill(pid, sig)
                alive = True
        return alive

    def _cycle(self) -> None:
        import signal
        try:
            while not self._stopped.is_set():
                self.pids = self.find() or self.pids
                if not self._signal(signal.SIGSTOP):
                    return
                self._stopped.wait(self.period * (1 - self.share))
                self._signal(signal.SIGCONT)
                self._stopped.wait(self.period * self.share)
        finally:
            self._signal(signal.SIGCONT)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5)


def SlowPod(pods_root, namespace: str, pod: str, share: float = 0.2, period: float = 0.1,  # noqa: N802
            whole: bool = False) -> SlowProcesses:
    """A slow node: the pod's torchrun workers (``whole``: every process of the pod, so a pod
    slowed from its start stays slow as it starts its workers) slowed by SlowProcesses."""
    from . import podprocs
    init_pid = podprocs.live_init_pid(podprocs.latest_pod_dir(pods_root, namespace, pod))

    def find() -> list[int]:
        return (podprocs.namespace_pids(init_pid) if whole
                else list(podprocs.worker_pids(init_pid).values()))
    return SlowProcesses(find, share, period, name=f"slow-{namespace}/{pod}")


def preflight_rank_in(pids, stage: str) -> int | None:
    """The first of ``pids`` that is a pre-flight check's rank in ``stage``, as its heartbeat
    says (trainer.pod.liveness: a file named by its PID in the directory its launcher gave it in
    PREFLIGHT_HEARTBEATS_ENV), else None. Lets a test freeze a rank mid-check."""
    import json
    from pathlib import Path

    from trainium_api.launch import PREFLIGHT_HEARTBEATS_ENV

    from . import podprocs
    for pid in pids:
        beats = podprocs.process_env(pid).get(PREFLIGHT_HEARTBEATS_ENV)
        if not beats:
            continue
        try:
            # the pod's own view: its /tmp may be a mount of its own, its PIDs a namespace's
            own_pid = next(line.split()[-1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                           if line.startswith("NSpid:"))
            record = Path(f"/proc/{pid}/root") / beats.lstrip("/") / f"{own_pid}.json"
            if json.loads(record.read_text()).get("stage") == stage:
                return pid
        except (OSError, ValueError, StopIteration):
            continue
    return None


def kill_rank(pods_root, namespace: str, pod: str, rank: int | None = None) -> tuple[int, int]:
    """SIGKILL one torchrun worker of the pod (global ``rank``; default the pod's lowest), as a
    crashed rank. Returns (rank, pid)."""
    import os
    import signal

    from . import podprocs
    workers = podprocs.worker_pids(podprocs.live_init_pid(podprocs.latest_pod_dir(pods_root, namespace, pod)))
    if not workers:
        raise LookupError(f"pod {namespace}/{pod} has no torchrun workers (yet)")
    if rank is None:
        rank = min(workers)
    if rank not in workers:
        raise LookupError(f"pod {namespace}/{pod} runs ranks {sorted(workers)}, not {rank}")
    os.kill(workers[rank], signal.SIGKILL)
    return rank, workers[rank]


HBM_FAULT_LINE = ("(FATAL-RT-UNDEFINED-STATE) Uncorrectable HBM memory error is detected. Execution results may be "
                  "invalid. Please terminate this instance to prevent future impact from the hardware error.")
"""What the Neuron runtime prints for an unrepairable HBM error (aws-neuron-sdk,
neuron-runtime/nrt-troubleshoot.rst, "Hardware errors")."""
NUMERICAL_ERROR_LINE = "RuntimeError: nrt_execute failed: NRT_EXEC_COMPLETED_WITH_NUM_ERR (status 1004)"
"""A STAND-IN for a framework's words when the runtime completed an execution with numerical
errors (the status name is nrt_status.h's; the sentence around it is ours): the runtime asks
only for a new process, so the node stays and the gang restarts in place."""


def runtime_fault(pods_root, namespace: str, pod: str, line: str = HBM_FAULT_LINE) -> tuple[int, int]:
    """A rank dies of a Neuron hardware fault: ``line`` appears on the lowest worker's stdout (written
    into the very stream it prints to, /proc/<pid>/fd/1: a STAND-IN for the runtime, which
    does not exist here), then the worker is SIGKILLed. Returns (rank, pid)."""
    import os
    import signal

    from . import podprocs
    workers = podprocs.worker_pids(podprocs.live_init_pid(podprocs.latest_pod_dir(pods_root, namespace, pod)))
    if not workers:
        raise LookupError(f"pod {namespace}/{pod} has no torchrun workers (yet)")
    rank = min(workers)
    with open(f"/proc/{workers[rank]}/fd/1", "w") as out:
        out.write(line + "\n")
    os.kill(workers[rank], signal.SIGKILL)
    return rank, workers[rank]


# -- faults of the control plane itself (the Cluster's own components) ------------------------


def apiserver_down(cluster, seconds: float) -> float:
    """kube-apiserver away for ``seconds``: every client (operator, trainers' progress, kubelets,
    controllers) loses the API. Returns the seconds until it was ready again."""
    return _component_down(cluster, "kube-apiserver", seconds)


def etcd_restart(cluster, seconds: float = 0.0) -> float:
    """etcd stopped for ``seconds`` (0: a plain restart) and started on the same data: the API
    server answers errors meanwhile and its watches break."""
    return _component_down(cluster, "etcd", seconds)


def _component_down(cluster, name: str, seconds: float) -> float:
    import time
    t0 = time.monotonic()
    cluster.stop_component(name)
    time.sleep(seconds)
    cluster.start_component(name)
    return time.monotonic() - t0
