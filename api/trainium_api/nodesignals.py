"""The node conditions other components write about a node's health, and what each means to a
run (docs/neuron.md, "Node health signals"). One table: the operator reads it
(trainium_operator.observe.node_view), the local control plane writes it (localcluster.faults).

Sources:
- the Neuron node problem detector (aws-neuron/aws-neuron-sdk,
  src/k8/neuron-problem-detector): ``NeuronHealth`` True with a reason
  ``NeuronHasError_<kind>`` on a hardware error in the kernel log;
- the EKS node monitoring agent (aws/eks-node-monitoring-agent, pkg/conditions/conditions.go,
  pkg/reasons/reasons.yaml, monitors/neuron/monitor.go): one condition per subsystem, True
  while healthy, False with the reason of a Fatal finding (Warning findings are Events only).
  Its Neuron monitor reads ``NEURON_HW_ERR=...`` lines from /dev/kmsg;
- EKS node auto repair (docs.aws.amazon.com/eks/latest/userguide/node-repair.html) acts on the
  agent's conditions after a wait: AcceleratedHardwareReady 10 minutes, the others and Ready
  30 minutes; under Karpenter and EKS Auto Mode it replaces the node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Writer = Literal["neuron-problem-detector", "eks-node-monitoring-agent"]


@dataclass(frozen=True)
class NodeCondition:
    type: str
    bad_status: str
    """The condition's status when the node is faulty ("True" for NeuronHealth, "False" for the agent's)."""
    cause: Literal["neuron-device", "node"]
    """The failure cause a run's pod on the node takes: its node is quarantined either way."""
    writer: Writer
    repair_after_seconds: float | None = None
    """When EKS node auto repair acts on the condition, after it turned bad (None: it does not)."""


NEURON_HEALTH = NodeCondition("NeuronHealth", "True", "neuron-device", "neuron-problem-detector")
ACCELERATED_HARDWARE = NodeCondition("AcceleratedHardwareReady", "False", "neuron-device",
                                     "eks-node-monitoring-agent", 600.0)
CONDITIONS: tuple[NodeCondition, ...] = (
    NEURON_HEALTH,
    ACCELERATED_HARDWARE,
    # the agent's other subsystems: a Fatal finding there (a kernel out of PIDs, a pod stuck
    # terminating, a network interface down) is the node's fault. StorageReady has no Fatal reason
    # today; read all the same, as the agent may add one
    NodeCondition("KernelReady", "False", "node", "eks-node-monitoring-agent", 1800.0),
    NodeCondition("ContainerRuntimeReady", "False", "node", "eks-node-monitoring-agent", 1800.0),
    NodeCondition("NetworkingReady", "False", "node", "eks-node-monitoring-agent", 1800.0),
    NodeCondition("StorageReady", "False", "node", "eks-node-monitoring-agent", 1800.0),
)
BY_TYPE = {c.type: c for c in CONDITIONS}
READY_REPAIR_SECONDS = 1800.0
"""EKS node auto repair replaces a node NotReady or Unknown for this long."""

NEURON_HEALTH_REASONS = ("NeuronHasError_SRAM_UNCORRECTABLE_ERROR", "NeuronHasError_NC_UNCORRECTABLE_ERROR",
                         "NeuronHasError_HBM_UNCORRECTABLE_ERROR", "NeuronHasError_DMA_ERROR",
                         "NeuronHasError_HANG_ON_COLLECTIVES")
"""The Neuron node problem detector's reasons (its k8s-neuron-problem-detector config)."""
AGENT_NEURON_REASONS = {
    # the agent's reason -> its message (monitors/neuron/monitor.go), all Fatal, repair: Replace
    "NeuronSRAMUncorrectableError": "Discovered SRAM Uncorrectable Error",
    "NeuronNCUncorrectableError": "Discovered NC Uncorrectable Error",
    "NeuronHBMUncorrectableError": "Discovered HBM Uncorrectable Error",
    "NeuronDMAError": "Discovered DMA Error",
}
AGENT_READY_REASONS = {
    # the reason and message each condition holds while healthy (cmd/eks-node-monitoring-agent/main.go)
    "KernelReady": ("KernelIsReady", "Monitoring for the Kernel system is active"),
    "StorageReady": ("DiskIsReady", "Monitoring for the Disk system is active"),
    "ContainerRuntimeReady": ("ContainerRuntimeIsReady", "Monitoring for the ContainerRuntime system is active"),
    "NetworkingReady": ("NetworkingIsReady", "Monitoring for the Networking system is active"),
    "AcceleratedHardwareReady": ("NeuronAcceleratedHardwareIsReady",
                                 "Monitoring for the Neuron AcceleratedHardware system is active"),
}


@dataclass(frozen=True)
class Finding:
    condition: NodeCondition
    reason: str
    message: str
    since: float | None

    def describe(self) -> str:
        said = f"{self.condition.type}={self.condition.bad_status} {self.reason}"
        return f"{said}: {self.message}" if self.message else said


MESSAGE_LIMIT = 200
"""The agent appends each new finding's message to the condition's ("; "): a status keeps a bounded part."""


def findings(conditions: list[dict], parse_time) -> list[Finding]:
    """The node's conditions that say it is faulty, in CONDITIONS order (``parse_time``: the
    caller's reader of lastTransitionTime)."""
    out = []
    for c in conditions:
        known = BY_TYPE.get(c.get("type")) if isinstance(c, dict) else None
        if known is None or c.get("status") != known.bad_status:
            continue
        at = c.get("lastTransitionTime")
        reason = str(c.get("reason") or ("NeuronHasError" if known is NEURON_HEALTH else "Unknown"))[:MESSAGE_LIMIT]
        out.append(Finding(known, reason, str(c.get("message") or "")[:MESSAGE_LIMIT],
                           parse_time(at) if at else None))
    return sorted(out, key=lambda f: CONDITIONS.index(f.condition))
