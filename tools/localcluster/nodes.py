"""Simulated nodes with the labels, taints and capacity of real instance types."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainium_api.spec import INSTANCE_TYPES as API_TYPES

NEURON, NEURONCORE, EFA = "aws.amazon.com/neuron", "aws.amazon.com/neuroncore", "vpc.amazonaws.com/efa"
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")  # the annotation kwok manages nodes by
# A process-backed node with this annotation only looks lost (faults.node_partition): the pod
# runner keeps its processes.
PARTITIONED = "localcluster.trainium.dev/partitioned"
# Nodes whose name starts with this are process-backed: kwok still manages the Node (lease,
# heartbeat, conditions, chaos) but none of its pods; tools/localcluster/podrunner.py runs
# those pods' containers as local processes. kwok's pod stages exclude them by this prefix.
PROCESS_NODE_PREFIX = "proc-"
PROCESS_NODE_LABEL = "localcluster.trainium.dev/processes"
# Process-backed nodes named so run each pod's container from its image with podman
# (podcontainer.py) instead of this machine's Python environment.
CONTAINER_NODE_PREFIX = PROCESS_NODE_PREFIX + "ctr-"
CONTAINER_NODE_LABEL = "localcluster.trainium.dev/containers"


@dataclass(frozen=True)
class InstanceType:
    name: str
    capacity: dict[str, str]
    taints: tuple[dict, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    dra_devices: int = 0
    """Neuron devices the Neuron DRA driver would publish for the node (DRA-only types)."""


_NEURON_TAINT = ({"key": NEURON, "value": "true", "effect": "NoSchedule"},)


def _trainium(name: str, cpu: str, memory: str) -> InstanceType:
    """A Trainium node: its devices, cores and EFA interfaces as the operator's instance type says
    (trainium_api.spec.INSTANCE_TYPES, one source), with the host's CPU and memory."""
    api = API_TYPES[name]
    return InstanceType(name, {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "7600Gi",
                               NEURON: api["resources"][NEURON], NEURONCORE: str(api["processes"]),
                               EFA: api["resources"][EFA]}, _NEURON_TAINT)


INSTANCE_TYPES = {
    # 16 Trainium devices (32 NeuronCores), 8 EFA adapters (16 on trn1n), 128 vCPU, 512 GiB.
    "trn1.32xlarge": _trainium("trn1.32xlarge", "128", "512Gi"),
    "trn1n.32xlarge": _trainium("trn1n.32xlarge", "128", "512Gi"),
    # 16 Trainium2 devices (64 logical NeuronCores at LNC 2), 16 EFA, 192 vCPU, 2 TiB.
    "trn2.48xlarge": _trainium("trn2.48xlarge", "192", "2048Gi"),
    "trn2u.48xlarge": _trainium("trn2u.48xlarge", "192", "2048Gi"),
    # A Trn3 node: 16 Trainium3 devices (a Gen1 UltraServer's server). AWS publishes no Trn3
    # instance name in what we read: "trn3.sim" is ours. DRA only: no extended resources (the
    # Neuron DRA driver's ResourceSlice lists its devices: publish_dra_devices).
    "trn3": InstanceType("trn3.sim", {"cpu": "192", "memory": "2048Gi", "pods": "110", "ephemeral-storage": "7600Gi"},
                         _NEURON_TAINT, dra_devices=16),
    # A plain CPU node for the operator itself and for CPU demo runs.
    "cpu": InstanceType("m5.2xlarge", {"cpu": "8", "memory": "32Gi", "pods": "110",
                                       "ephemeral-storage": "100Gi"}),
}


def is_process_node(name: str | None) -> bool:
    return bool(name) and name.startswith(PROCESS_NODE_PREFIX)


def is_container_node(name: str | None) -> bool:
    return bool(name) and name.startswith(CONTAINER_NODE_PREFIX)


NETWORK_GROUPS = (64, 16, 4)
"""Simulated nodes, by index, under one network node of each layer: 64 under a layer-1 node, 16
under a layer-2, 4 under a layer-3 (an assumption of ours: EC2 publishes no fan-out)."""


def network_labels(index: int, zone: str, itype: str) -> dict[str, str]:
    """The AWS cloud controller manager's network topology labels (keys.NETWORK_LAYER); on trn2u,
    the Neuron device plugin's UltraServer labels too (of 4 nodes, and of 2)."""
    from trainium_api import keys
    labels = {f"{keys.NETWORK_LAYER}{layer}": f"nn-{zone}-{layer}-{index // size:04d}"
              for layer, size in enumerate(NETWORK_GROUPS, start=1)}
    if itype.startswith("trn2u."):
        labels.update({"neuron.amazonaws.com/ultraserver-mode": "1_2_4",
                       keys.ULTRASERVER: f"us-{index // 4:04d}", "neuron.amazonaws.com/ultraserver-node-id-4": str(index % 4),
                       "neuron.amazonaws.com/ultraserver-server-id-2": f"us2-{index // 2:04d}",
                       "neuron.amazonaws.com/ultraserver-node-id-2": str(index % 2)})
    return labels


def agent_conditions(neuron: bool) -> list[dict]:
    """The healthy conditions the EKS node monitoring agent writes when it starts
    (trainium_api.nodesignals.AGENT_READY_REASONS): AcceleratedHardwareReady on Neuron nodes only."""
    from trainium_api.nodesignals import ACCELERATED_HARDWARE, AGENT_READY_REASONS
    from datetime import datetime, timezone
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return [{"type": kind, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now,
             "lastHeartbeatTime": now}
            for kind, (reason, message) in AGENT_READY_REASONS.items()
            if neuron or kind != ACCELERATED_HARDWARE.type]


def node_manifest(name: str, itype: InstanceType, zone: str = "us-west-2d", index: int = 0,
                  dra: bool = False) -> dict:
    """A Node as EKS registers it: the instance type and zone labels, the network topology labels
    of the cloud controller manager (Trainium types), and the EKS node monitoring agent's
    conditions. ``dra``: its Neuron devices are the Neuron DRA driver's (published as a
    ResourceSlice: publish_dra_devices), not the device plugin's extended resources; its EFA
    interfaces stay the EFA device plugin's (the EFA DRA driver is not simulated)."""
    neuron = NEURON in itype.capacity or itype.dra_devices > 0
    if dra:
        itype = replace(itype, capacity={k: v for k, v in itype.capacity.items() if k not in (NEURON, NEURONCORE)})
    labels = {
        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": itype.name, "topology.kubernetes.io/zone": zone,
        "type": "kwok", **(network_labels(index, zone, itype.name) if neuron else {}), **itype.labels,
    }
    status: dict = {"capacity": dict(itype.capacity), "allocatable": dict(itype.capacity),
                    "conditions": agent_conditions(neuron)}
    if is_process_node(name):
        labels[PROCESS_NODE_LABEL] = "true"
        if is_container_node(name):
            labels[CONTAINER_NODE_LABEL] = "true"
        # Its pods really run here: the node's address is this machine's loopback.
        status["addresses"] = [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}]
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1]}},
        "spec": {"taints": [dict(t) for t in itype.taints]},
        "status": status,
    }


def create_nodes(core_api, count: int, type_name: str, prefix: str | None = None,
                 processes: bool = False, dra: bool = False, containers: bool = False) -> list[str]:
    """Create ``count`` nodes (skipping names that exist); returns their names. ``processes``:
    process-backed nodes (named ``proc-...``), whose pods run as local processes; ``containers``:
    process-backed nodes whose pods run from their images (``proc-ctr-...``, podcontainer.py).
    ``dra``: their Neuron devices published as the Neuron DRA driver would (a DRA-only type
    always is)."""
    from kubernetes.client.exceptions import ApiException

    if type_name not in INSTANCE_TYPES:
        raise ValueError(f"unknown instance type {type_name!r} (known: {', '.join(INSTANCE_TYPES)})")
    itype = INSTANCE_TYPES[type_name]
    prefix = prefix or type_name.split(".")[0] + "-"
    if containers and not is_container_node(prefix):
        prefix = CONTAINER_NODE_PREFIX + prefix
    elif processes and not is_process_node(prefix):
        prefix = PROCESS_NODE_PREFIX + prefix
    elif not (processes or containers) and is_process_node(prefix):
        raise ValueError(f"node names starting with {PROCESS_NODE_PREFIX!r} are for process-backed nodes")
    names = []
    for i in range(count):
        name = f"{prefix}{i:03d}"
        dra_node = dra or itype.dra_devices > 0
        try:
            core_api.create_node(node_manifest(name, itype, index=i, dra=dra_node))
        except ApiException as exc:
            if exc.status != 409:
                raise
        if dra_node:
            publish_dra_devices(core_api, name, itype, i)
        names.append(name)
    return names


CONTROLLER_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
"""What the API server's node admission and the node lifecycle controller put on a node that is not
(yet) Ready; the controller takes them off some seconds after Ready turns True."""


def schedulable(core_api, name: str) -> bool:
    """Ready, and free of the lifecycle controller's taints: a pod may land on it now. (Ready alone
    is not enough: a node just created still carries not-ready until the controller's next pass.)"""
    node = core_api.read_node(name)
    ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
    return ready and not any(t.key in CONTROLLER_TAINTS for t in node.spec.taints or [])


NEURON_DRIVER = "neuron.aws.com"
"""The Neuron DRA driver's name and DeviceClass (aws-neuron-sdk deploy/eks/dra.rst)."""


def install_dra_driver(core_api) -> None:
    """The Neuron DRA driver's DeviceClass, as its Helm chart installs it (its selector: the
    driver's devices); idempotent. Its kubelet plugin is not simulated: kwok's nodes prepare no
    device, and the slices are published by publish_dra_devices."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    try:
        client.ResourceV1Api(core_api.api_client).create_device_class({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": NEURON_DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{NEURON_DRIVER}"'}}]}})
    except ApiException as exc:
        if exc.status != 409:
            raise


def publish_dra_devices(core_api, node: str, itype: InstanceType, index: int = 0, zone: str = "us-west-2d") -> None:
    """The node's ResourceSlice as the Neuron DRA driver publishes it: one pool named after the
    node, a device neurondevice<N> per Trainium device with the attributes the driver's reference
    lists (deviceId, instanceType, resourceType neuron_device, networkNodeLayer1..3)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    from trainium_api import keys
    from trainium_api.spec import INSTANCE_TYPES as API_TYPES
    count = itype.dra_devices or int(API_TYPES[itype.name]["resources"][NEURON])
    layers = network_labels(index, zone, itype.name)
    attrs = {"instanceType": {"string": itype.name}, "resourceType": {"string": "neuron_device"},
             **{f"networkNodeLayer{n}": {"string": layers[f"{keys.NETWORK_LAYER}{n}"]} for n in (1, 2, 3)}}
    owner = core_api.read_node(node)  # the driver's slice goes with its Node (the garbage collector)
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{NEURON_DRIVER}", "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": node, "uid": owner.metadata.uid, "controller": True}]},
            "spec": {"driver": NEURON_DRIVER, "nodeName": node,
                     "pool": {"name": node, "generation": 0, "resourceSliceCount": 1},
                     "devices": [{"name": f"neurondevice{d}", "attributes": {"deviceId": {"int": d}, **attrs}}
                                 for d in range(count)]}}
    try:
        client.ResourceV1Api(core_api.api_client).create_resource_slice(body)
    except ApiException as exc:
        if exc.status != 409:
            raise
