"""Pods, nodes and progress annotations -> what the gang is doing and what broke. Pure.

Views are small dicts/dataclasses built from API objects (plain dicts, as kopf delivers them),
so the same functions serve the handlers, tests and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from trainium_api import keys
from trainium_api import agent, gangorder, nodesignals, preflight, progress, runtimefaults, storefaults
from trainium_api.checkpoints import RESTORE_SOURCES
from trainium_api.launch import PREFLIGHT_PASSED_VOLUME
from trainium_api.spec import Cause


NEURON = "aws.amazon.com/neuron"
# The kubelet's waiting reasons of a container that is starting as it should; any other
# (ErrImagePull, ImagePullBackOff, CreateContainerConfigError, ...) is shown in status at once.
STARTING_REASONS = ("ContainerCreating", "PodInitializing")
# A pod's own reason when the node or the cluster stopped it (not its program): it wins over its
# container's exit reason (an evicted pod's container also ends with Error or exit 137).
EVICTION_REASONS = ("Evicted", "Preempting", "Terminated", "NodeShutdown", "NodeLost", "DeadlineExceeded",
                    # the DisruptionTarget condition's reasons (a drain, preemption, taint manager,
                    # pod GC or the kubelet stopped the pod: its exit code is the signal's, not the job's)
                    "EvictionByEvictionAPI", "PreemptionByScheduler", "DeletionByTaintManager", "DeletionByPodGC",
                    "TerminationByKubelet")


# DisruptionTarget reasons of a pod the cluster moved on purpose (an eviction through the API: a
# drain, Karpenter; the scheduler's preemption for a higher priority): no fault of the run's
VOLUNTARY_REASONS = ("EvictionByEvictionAPI", "PreemptionByScheduler")
# A node on its way out: cordoned (spec.unschedulable: kubectl drain, a node group upgrade) or
# tainted by Karpenter before it drains the node
def draining(node: "NodeView") -> bool:
    """The node is being emptied: cordoned, or about to be terminated (terminating)."""
    return node.unschedulable or terminating(node)


def terminating(node: "NodeView") -> str:
    """The taint that says the node is about to be terminated (keys.TERMINATION_NOTICE_TAINTS:
    Karpenter's, the node termination handler's), "" when none does."""
    return min(keys.TERMINATION_NOTICE_TAINTS & node.taints, default="")


def waiting_reason(pod: "PodView") -> str:
    """The kubelet's reason why ``pod``'s container waits ("" when it does not)."""
    return pod.waiting.split(":")[0]
ZONE_LABEL = "topology.kubernetes.io/zone"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


def _ts(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


@dataclass
class PodView:
    name: str
    attempt: int
    index: int
    phase: str
    node: str | None
    deleting: bool
    exit_code: int | None = None
    reason: str = ""
    message: str = ""
    progress: progress.ProgressReport | None = None  # its report once it has a step (a field that did not fit: None)
    # (of its store, read ``store``: checked against the operator's clock)
    store: progress.StoreReport | None = None  # what it says of its checkpoint store (its annotation)
    created: float | None = None
    unschedulable: str = ""
    finished: float | None = None  # when its container terminated
    scheduled: float | None = None  # when it was bound to its node (PodScheduled True)
    waiting: str = ""  # a container that has not started: the kubelet's reason and message
    progress_errors: list[str] = field(default_factory=list)  # fields of its annotation dropped
    owner: str | None = None  # the uid of the run that controls it
    gone_by: float | None = None  # a deleting pod's deletionTimestamp: when its grace period ends
    runtime_fault: runtimefaults.Finding | None = None  # what the Neuron runtime said, from its termination message
    preflight_failure: str | None = None  # why its node failed the pre-flight check, from its termination message
    store_unavailable: str | None = None  # what store stayed unavailable past its retries, from its termination message
    preflight_running: bool = False  # its launcher says the pre-flight check is under way (its annotation)
    agent: agent.Report | None = None  # its agent's report (in-place restarts), None without one
    order: agent.Order | None = None  # the operator's newest order to its agent
    spare: bool = False  # a standby pod that has not taken an index (faultTolerance.spares)
    preflight_map: str = ""  # the ConfigMap its list of nodes that passed the pre-flight check comes from


def controller_uid(obj: dict) -> str | None:
    """The uid of the object that controls ``obj`` (its ownerReference with controller: true)."""
    return next((r.get("uid") for r in (obj.get("metadata") or {}).get("ownerReferences") or []
                 if isinstance(r, dict) and r.get("controller")), None)


def pod_view(pod: dict) -> PodView:
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    labels = meta.get("labels") or {}
    exit_code, reason, message = None, status.get("reason") or "", status.get("message") or ""
    finished, waiting, fault, failed_check, store_down = None, "", None, None, None
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        term = state.get("terminated")
        if term:
            exit_code = term.get("exitCode")
            reason = reason if reason in EVICTION_REASONS else (term.get("reason") or reason)
            fault = runtimefaults.parse_message(term.get("message"))
            failed_check = preflight.parse_message(term.get("message"))
            store_down = storefaults.parse_message(term.get("message"))
            message = fault.describe() if fault else failed_check or term.get("message") or message
            finished = _ts(term.get("finishedAt"))
        wait = state.get("waiting")
        if wait and not waiting:
            waiting = f"{wait.get('reason') or 'Waiting'}: {wait.get('message') or ''}".strip().rstrip(":")
    conditions = status.get("conditions") or []
    disrupted = next((c for c in conditions if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), None)
    if disrupted and reason not in EVICTION_REASONS:  # a drained pod exits 143 with no pod reason
        reason = disrupted.get("reason") or "EvictionByEvictionAPI"
        message = disrupted.get("message") or message
    unschedulable = next((c.get("message", "") for c in conditions
                          if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"), "")
    node = (pod.get("spec") or {}).get("nodeName")
    scheduled = next((_ts(c.get("lastTransitionTime")) for c in conditions
                      if c.get("type") == "PodScheduled" and c.get("status") == "True"), None)
    if node and scheduled is None:  # bound without the condition (created with a nodeName)
        scheduled = _ts(meta.get("creationTimestamp"))
    said, report_errors = progress.ProgressReport.parse((meta.get("annotations") or {}).get(keys.PROGRESS))
    store = said.store_said() if said is not None else None  # said before the first step too (a store it cannot list)
    report = said if said is not None and said.step is not None else None
    return PodView(name=meta.get("name", ""), attempt=_label_int(labels, keys.ATTEMPT),
                   index=_label_int(labels, keys.INDEX), phase=status.get("phase") or "Pending",
                   node=node, deleting=bool(meta.get("deletionTimestamp")),
                   exit_code=exit_code, reason=reason, message=message,
                   progress=report, store=store, progress_errors=report_errors,
                   created=_ts(meta.get("creationTimestamp")), unschedulable=unschedulable, finished=finished,
                   scheduled=scheduled, waiting=waiting[:500], owner=controller_uid(pod),
                   gone_by=_ts(meta.get("deletionTimestamp")), runtime_fault=fault, preflight_failure=failed_check,
                   store_unavailable=store_down,
                   preflight_running=preflight.is_running(meta.get("annotations")),
                   agent=agent.parse_report((meta.get("annotations") or {}).get(keys.AGENT_REPORT)),
                   order=agent.parse_order((meta.get("annotations") or {}).get(keys.ORDER)),
                   spare=labels.get(keys.SPARE) == "true", preflight_map=_preflight_map(pod))


def _preflight_map(pod: dict) -> str:
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        if isinstance(volume, dict) and volume.get("name") == PREFLIGHT_PASSED_VOLUME:
            return str((volume.get("configMap") or {}).get("name") or "")
    return ""


@dataclass(frozen=True)
class GangOrderView:
    """The run's gang order object as seen (trainium_api.gangorder): its controller, and the
    order it holds (None when malformed)."""
    owner: str | None
    order: "gangorder.GangOrder | None"


def gang_order_view(obj: dict) -> GangOrderView:
    return GangOrderView(controller_uid(obj), gangorder.parse((obj.get("data") or {}).get(gangorder.DATA_KEY)))


def _label_int(labels: dict, key: str) -> int:
    """A number label of ours; -1 when someone wrote something else (a pod of no attempt)."""
    value = labels.get(key, "0")
    return int(value) if isinstance(value, str) and value.isdigit() else -1


@dataclass
class NodeView:
    name: str
    ready: str  # "True", "False", "Unknown"
    taints: set = field(default_factory=set)
    neuron_error: str = ""
    """A condition that says the node's Neuron hardware is faulty (NeuronHealth from the Neuron
    node problem detector, AcceleratedHardwareReady from the EKS node monitoring agent),
    described; "" when none does."""
    node_error: str = ""
    """A condition of the EKS node monitoring agent that says another subsystem of the node is
    faulty (KernelReady, ContainerRuntimeReady, NetworkingReady, StorageReady), described."""
    health: tuple = ()
    """Every condition that says the node is faulty (trainium_api.nodesignals.Finding), in
    nodesignals.CONDITIONS order: when each turned bad tells when EKS node auto repair acts."""
    neuron_allocatable: int | None = None
    neuron_capacity: int | None = None
    unschedulable: bool = False
    changed: float | None = None  # newest transition of Ready or of a health condition (nodesignals)
    ready_changed: float | None = None  # the Ready condition's own transition (NotReady, Unknown: since when)
    instance_type: str = ""  # node.kubernetes.io/instance-type
    zone: str = ""  # topology.kubernetes.io/zone: the node lifecycle controller judges disruption per zone
    uid: str = ""  # the Node object's: another after the node registered again
    provider_id: str = ""  # spec.providerID: the machine (aws:///<zone>/<instance-id> on EKS)
    neuron_short_since: float | None = None
    """Since when the operator has seen allocatable Neuron devices below capacity (the node
    object carries no time for it: the observer's DeviceShortfalls remembers)."""

    @property
    def neuron_short(self) -> bool:
        return self.neuron_capacity is not None and self.neuron_allocatable is not None and \
            self.neuron_allocatable < self.neuron_capacity


def node_view(node: dict) -> NodeView:
    status, spec = node.get("status") or {}, node.get("spec") or {}
    ready, changed, ready_changed = "Unknown", None, None
    conditions = [c for c in status.get("conditions") or [] if isinstance(c, dict)]
    for c in conditions:
        if (c.get("type") == "Ready" or c.get("type") in nodesignals.BY_TYPE) and c.get("lastTransitionTime"):
            changed = max(changed or 0.0, _ts(c["lastTransitionTime"]) or 0.0)
        if c.get("type") == "Ready":
            ready = c.get("status", "Unknown")
            ready_changed = _ts(c.get("lastTransitionTime")) if c.get("lastTransitionTime") else None
    health = tuple(nodesignals.findings(conditions, _ts))
    neuron_error = next((f.describe() for f in health if f.condition.cause == "neuron-device"), "")
    node_error = next((f.describe() for f in health if f.condition.cause == "node"), "")

    def count(group):
        value = (status.get(group) or {}).get(NEURON)
        return int(value) if value is not None else None
    return NodeView(name=node["metadata"]["name"], ready=ready,
                    taints={t.get("key") for t in spec.get("taints") or []}, neuron_error=neuron_error,
                    node_error=node_error, health=health,
                    neuron_allocatable=count("allocatable"), neuron_capacity=count("capacity"),
                    unschedulable=bool(spec.get("unschedulable")), changed=changed, ready_changed=ready_changed,
                    instance_type=str((node["metadata"].get("labels") or {}).get(INSTANCE_TYPE_LABEL) or ""),
                    zone=((node["metadata"].get("labels") or {}).get(ZONE_LABEL) or ""),
                    uid=str(node["metadata"].get("uid") or ""), provider_id=str(spec.get("providerID") or ""))


@dataclass
class Failure:
    cause: Cause
    message: str
    node: str = ""
    pod: str = ""
    fatal: bool = False
    exit_code: int | None = None
    since: float | None = None  # when the signal appeared (container finished, condition changed)
    pod_reported: bool = False
    """The evidence is the run's own pods' words (a termination message, a progress report),
    which the run's author controls: it may keep this run off the node, not taint it for all."""
    voluntary: bool = False
    """The cluster moves the gang on purpose (a drain, an eviction through the API, a preemption
    by the scheduler): a graceful move, never counted against a budget (failure_policy.decide)."""
    runtime_status: str = ""
    """The Neuron runtime's status the failed pod reported (trainium_api.runtimefaults), if any."""
    repairable: bool = False
    """The runtime says a driver reload or a reboot repairs the fault (1205): the node is kept the
    first time within the budget window, left out the next (failure_policy.decide)."""
    fleet_symptom: bool = False
    """The signal is one a fleet-wide routine event also shows on each node (NotReady, missing
    Neuron devices: a container runtime restart, a device-plugin rollout): held while a
    disruption or a mass event lasts (judge._hold, mass_events)."""
    capacity: bool = False
    """The gang was not placed whole (the scheduler found no room for some of its pods): it is
    released and placed again after a backoff, never counted against a budget (gang admission:
    failure_policy.decide)."""


@dataclass
class GangState:
    """The current attempt's pods, summarised."""

    pods: list[PodView]
    running: int
    scheduled: int
    succeeded: int
    step: int | None
    tokens_per_second: float | None
    loss: float | None
    last_checkpoint_step: int | None
    last_progress_time: float | None
    last_checkpoint_time: float | None = None  # when last_checkpoint_step's step ended, where a pod says
    start_step: int | None = None  # where the reporting processes began (their checkpoint), if known
    first_step_time: float | None = None  # when their first step ended (the last pod's), where they say
    eval_perplexity: float | None = None  # newest held-out perplexity, when the run evaluates
    preflight_seconds: float | None = None  # what the attempt's pre-flight check took (its reports say)
    preflight_running: bool = False  # a pod of the gang says its pre-flight check is under way
    restore_seconds: float | None = None  # what restoring the attempt's checkpoint took (the slowest pod's report)
    restore_source: str | None = None  # where it read from (the slowest source any pod reports)

    @property
    def size(self) -> int:
        return len(self.pods)


def gang_state(pods: list[PodView]) -> GangState:
    reports = [p.progress for p in pods if p.progress]
    newest = max(reports, key=lambda r: r.step, default=None)
    checkpointed = max((r.last_checkpoint_step for r in reports if r.last_checkpoint_step is not None), default=None)
    return GangState(
        pods=pods, running=sum(p.phase == "Running" and not p.deleting for p in pods),
        scheduled=sum(bool(p.node) for p in pods), succeeded=sum(succeeded(p) for p in pods),
        step=newest.step if newest else None,
        tokens_per_second=newest.tokens_per_second if newest else None,
        loss=newest.loss if newest else None,
        last_checkpoint_step=checkpointed,
        last_progress_time=max((r.time for r in reports if r.time), default=None),
        # a pod's time of that step, if no later than its own newest step (one pod's garbage, a
        # time in the future, must not take the others' away)
        last_checkpoint_time=max((r.last_checkpoint_time for r in reports
                                  if checkpointed is not None and r.last_checkpoint_step == checkpointed
                                  and r.last_checkpoint_time and r.time and r.last_checkpoint_time <= r.time),
                                 default=None),
        start_step=newest.start_step if newest else None,
        first_step_time=max((r.first_step_time for r in reports if r.first_step_time), default=None),
        eval_perplexity=next((r.eval_perplexity for r in sorted(reports, key=lambda r: -r.step)
                              if r.eval_perplexity is not None), None),
        preflight_seconds=max((r.preflight_seconds for r in reports if r.preflight_seconds is not None),
                              default=None),
        preflight_running=any(p.preflight_running and not p.deleting for p in pods),
        # the gang trains when its slowest pod has restored: that pod's time is the phase's
        restore_seconds=max((r.restore_seconds for r in reports if r.restore_seconds is not None),
                            default=None),
        restore_source=slowest_source([r.restore_source for r in reports]))


def slowest_source(sources) -> str | None:
    """The slowest of restore sources (memory < peer < store), None when none is known."""
    known = [s for s in sources if s in RESTORE_SOURCES]
    return max(known, key=RESTORE_SOURCES.index, default=None)


def succeeded(p: PodView) -> bool:
    """Finished its work: an evicted pod whose program exited 0 on SIGTERM did not."""
    return p.reason not in EVICTION_REASONS and (p.phase == "Succeeded" or (p.phase == "Failed" and p.exit_code == 0))


def not_started(pods: list[PodView]) -> list[PodView]:
    """Pods placed on a node whose container has not started (phase Pending), oldest first."""
    return sorted((p for p in pods if p.node and p.phase == "Pending" and not p.deleting and p.scheduled),
                  key=lambda p: p.scheduled)
