"""The local control plane itself: real components, simulated trn1 nodes, every fault."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.conftest import wait_until

pytestmark = pytest.mark.cluster

NEURON_TOLERATION = {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"}


def make_nodes(core_api, count, prefix, type_name="trn1.32xlarge"):
    from localcluster.nodes import create_nodes
    names = create_nodes(core_api, count, type_name, prefix)
    wait_until(lambda: all(is_ready(core_api, n) == "True" for n in names), what=f"{prefix}* Ready")
    return names


def is_ready(core_api, node):
    conds = core_api.read_node(node).status.conditions or []
    return next((c.status for c in conds if c.type == "Ready"), None)


def taint_keys(core_api, node):
    return {t.key for t in core_api.read_node(node).spec.taints or []}


def trainer_pod(name, node=None, neuron="16", efa="8", owner=None):
    spec = {"containers": [{"name": "trainer", "image": "trainer:test",
                            "resources": {"limits": {"aws.amazon.com/neuron": neuron, "vpc.amazonaws.com/efa": efa}}}],
            "tolerations": [NEURON_TOLERATION]}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    meta = {"name": name}
    if owner:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def phase(core_api, ns, pod):
    return core_api.read_namespaced_pod(pod, ns).status.phase


def test_version_is_the_real_release(local_cluster):
    version = json.loads(local_cluster.kubectl("get", "--raw", "/version").stdout)
    from localcluster.cluster import pinned_version
    pinned = pinned_version("K8S_VERSION")
    assert version["gitVersion"] == pinned and version["minor"] == pinned.split(".")[1]


def test_kubectl_lists_trn1_nodes_with_capacity(local_cluster, core_api):
    names = make_nodes(core_api, 3, "cap-")
    out = local_cluster.kubectl("get", "nodes", "-l", "node.kubernetes.io/instance-type=trn1.32xlarge",
                                "-o", "json").stdout
    nodes = {n["metadata"]["name"]: n for n in json.loads(out)["items"]}
    for name in names:
        n = nodes[name]
        assert n["status"]["capacity"]["aws.amazon.com/neuron"] == "16"
        assert n["status"]["capacity"]["aws.amazon.com/neuroncore"] == "32"
        assert n["status"]["capacity"]["vpc.amazonaws.com/efa"] == "8"
        assert n["status"]["allocatable"]["cpu"] == "128" and n["status"]["allocatable"]["memory"] == "512Gi"
        assert {"key": "aws.amazon.com/neuron", "value": "true", "effect": "NoSchedule"} in n["spec"]["taints"]
    table = local_cluster.kubectl("get", "nodes").stdout
    statuses = {row.split()[0]: row.split()[1] for row in table.splitlines()[1:]}
    assert all(statuses[name] == "Ready" for name in names), table


def test_trn1n_has_16_efa(core_api):
    name = make_nodes(core_api, 1, "efa-", "trn1n.32xlarge")[0]
    assert core_api.read_node(name).status.allocatable["vpc.amazonaws.com/efa"] == "16"


def test_pod_schedules_and_oversized_pod_stays_pending(core_api, namespace):
    node = make_nodes(core_api, 1, "sched-")[0]
    core_api.create_namespaced_pod(namespace, trainer_pod("fits", node))
    core_api.create_namespaced_pod(namespace, trainer_pod("too-big", node, neuron="17"))
    _, took = wait_until(lambda: phase(core_api, namespace, "fits") == "Running", what="pod Running")
    print(f"\npod requesting 16 Neuron devices + 8 EFA Running after {took:.2f}s")
    assert core_api.read_namespaced_pod("fits", namespace).spec.node_name == node

    def unschedulable():
        conds = core_api.read_namespaced_pod("too-big", namespace).status.conditions or []
        return next((c for c in conds if c.type == "PodScheduled" and c.reason == "Unschedulable"), None)
    cond, _ = wait_until(unschedulable, what="Unschedulable condition")
    assert "Insufficient aws.amazon.com/neuron" in cond.message
    assert phase(core_api, namespace, "too-big") == "Pending"


def test_garbage_collection_deletes_owned_pods(core_api, namespace):
    node = make_nodes(core_api, 1, "gc-")[0]
    owner = core_api.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    core_api.create_namespaced_pod(namespace, trainer_pod("child", node, owner=ref))
    wait_until(lambda: phase(core_api, namespace, "child") == "Running", what="child Running")
    core_api.delete_namespaced_config_map("owner", namespace)
    names = lambda: [p.metadata.name for p in core_api.list_namespaced_pod(namespace).items]  # noqa: E731
    _, took = wait_until(lambda: "child" not in names(), what="garbage collection")
    print(f"\nowned pod garbage-collected {took:.2f}s after its owner was deleted")


def test_node_not_ready_and_recovery(core_api):
    from localcluster import faults
    node = make_nodes(core_api, 1, "nr-")[0]
    faults.node_not_ready(core_api, node, reason="KubeletNotReady")
    _, took = wait_until(lambda: is_ready(core_api, node) == "False"
                         and "node.kubernetes.io/not-ready" in taint_keys(core_api, node), what="NotReady + taint")
    print(f"\nNotReady with the not-ready taint after {took:.2f}s")
    faults.node_recover(core_api, node)
    wait_until(lambda: is_ready(core_api, node) == "True"
               and "node.kubernetes.io/not-ready" not in taint_keys(core_api, node), what="recovery")


def test_node_unreachable_and_recovery(core_api):
    from localcluster import faults
    node = make_nodes(core_api, 1, "unreach-")[0]
    faults.node_unreachable(core_api, node)
    _, took = wait_until(lambda: is_ready(core_api, node) == "Unknown"
                         and "node.kubernetes.io/unreachable" in taint_keys(core_api, node),
                         timeout=90, interval=0.5, what="Unknown + unreachable taint")
    print(f"\nnode Unknown with the unreachable taint {took:.1f}s after its heartbeats stopped")
    faults.node_recover(core_api, node)
    wait_until(lambda: is_ready(core_api, node) == "True"
               and "node.kubernetes.io/unreachable" not in taint_keys(core_api, node), what="recovery")


def test_neuron_health_condition_persists_while_node_ready(core_api):
    from localcluster import faults
    node = make_nodes(core_api, 1, "neuron-")[0]
    faults.neuron_error(core_api, node, "NeuronHasError_HBM_UNCORRECTABLE_ERROR")

    def neuron_condition():
        conds = core_api.read_node(node).status.conditions or []
        return next((c for c in conds if c.type == "NeuronHealth"), None)
    cond, _ = wait_until(neuron_condition, what="NeuronHealth")
    assert cond.status == "True" and cond.reason == "NeuronHasError_HBM_UNCORRECTABLE_ERROR"
    # kwok keeps heartbeating the node (strategic merge by condition type): both survive.
    time.sleep(3)
    assert is_ready(core_api, node) == "True" and neuron_condition().reason.startswith("NeuronHasError_")
    faults.neuron_healthy(core_api, node)
    c = neuron_condition()
    assert c.status == "False" and c.reason == "NeuronHasNoError"


def test_nodes_carry_eks_labels_and_the_node_monitoring_agents_conditions(core_api):
    """As EKS registers a Trainium node: the cloud controller manager's network topology labels
    and the EKS node monitoring agent's five conditions, True; they survive kwok's heartbeats,
    and the agent's fault turns its hardware condition False while the node stays Ready."""
    from localcluster import faults
    from trainium_api import nodesignals
    node = make_nodes(core_api, 1, "eks-")[0]
    n = core_api.read_node(node)
    assert {f"topology.k8s.aws/network-node-layer-{i}" for i in (1, 2, 3)} <= set(n.metadata.labels)
    conds = {c.type: c for c in n.status.conditions}
    assert all(conds[k].status == "True" and conds[k].reason == r for k, (r, _) in nodesignals.AGENT_READY_REASONS.items())
    faults.accelerated_hardware(core_api, node, "NeuronHBMUncorrectableError")
    time.sleep(3)  # heartbeats merge by condition type
    conds = {c.type: c for c in core_api.read_node(node).status.conditions}
    hw = conds["AcceleratedHardwareReady"]
    assert (hw.status, hw.reason, hw.message) == ("False", "NeuronHBMUncorrectableError",
                                                  "Discovered HBM Uncorrectable Error")
    assert conds["Ready"].status == "True" and conds["KernelReady"].status == "True"
    faults.accelerated_hardware_ready(core_api, node)
    assert {c.type: c for c in core_api.read_node(node).status.conditions}["AcceleratedHardwareReady"].status == "True"


def test_a_spot_interruption_taints_drains_through_budgets_and_takes_the_node_at_its_deadline(core_api, namespace):
    """Karpenter's handling of EC2's interruption warning: a SpotInterrupted event on the Node, the
    karpenter.sh/disrupted taint, evictions a PodDisruptionBudget refuses (tried again), and the
    node deleted at the notice's end all the same."""
    from localcluster import faults
    node = make_nodes(core_api, 1, "spot-")[0]
    core_api.create_namespaced_pod(namespace, {"metadata": {"name": "held", "labels": {"app": "held"}}, "spec": {
        "nodeName": node, "containers": [{"name": "c", "image": "x"}],
        "tolerations": [{"key": "aws.amazon.com/neuron", "operator": "Exists"}]}})
    from kubernetes import client
    client.PolicyV1Api(core_api.api_client).create_namespaced_pod_disruption_budget(namespace, {
        "metadata": {"name": "held"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "held"}}}})
    wait_until(lambda: core_api.read_namespaced_pod("held", namespace).status.phase == "Running", what="pod Running")
    end = faults.spot_interruption(core_api, node, notice_seconds=4)
    assert faults.keys.KARPENTER_DISRUPTED in taint_keys(core_api, node)
    events = [e for e in core_api.list_namespaced_event("default").items
              if e.involved_object.name == node and e.reason == "SpotInterrupted"]
    assert events and events[0].type == "Warning" and events[0].source.component == "karpenter"
    time.sleep(2)
    assert not core_api.read_namespaced_pod("held", namespace).metadata.deletion_timestamp  # the budget holds it
    end.wait(20)
    assert end.deleted_at is not None
    from kubernetes.client.exceptions import ApiException
    with pytest.raises(ApiException) as gone:
        core_api.read_node(node)
    assert gone.value.status == 404


def test_device_loss_and_restore(core_api):
    from localcluster import faults
    node = make_nodes(core_api, 1, "devloss-")[0]
    faults.device_loss(core_api, node, 12)
    st = core_api.read_node(node).status
    assert st.allocatable["aws.amazon.com/neuron"] == "12" and st.capacity["aws.amazon.com/neuron"] == "16"
    time.sleep(2)
    assert core_api.read_node(node).status.allocatable["aws.amazon.com/neuron"] == "12"  # kwok leaves it
    faults.device_restore(core_api, node)
    assert core_api.read_node(node).status.allocatable["aws.amazon.com/neuron"] == "16"


def test_delete_node(core_api):
    from kubernetes.client.exceptions import ApiException
    from localcluster import faults
    node = make_nodes(core_api, 1, "del-")[0]
    faults.delete_node(core_api, node)

    def gone():
        try:
            core_api.read_node(node)
            return False
        except ApiException as exc:
            return exc.status == 404
    wait_until(gone, what="node deleted")


def test_pod_failure_with_exit_code(core_api, namespace):
    from localcluster import faults
    node = make_nodes(core_api, 1, "podfail-")[0]
    core_api.create_namespaced_pod(namespace, trainer_pod("rank0", node))
    wait_until(lambda: phase(core_api, namespace, "rank0") == "Running", what="Running")
    faults.pod_fail(core_api, namespace, "rank0", exit_code=78, reason="Error")
    _, took = wait_until(lambda: phase(core_api, namespace, "rank0") == "Failed", what="Failed")
    term = core_api.read_namespaced_pod("rank0", namespace).status.container_statuses[0].state.terminated
    print(f"\npod Failed with exit code {term.exit_code} after {took:.2f}s")
    assert term.exit_code == 78 and term.reason == "Error"


def test_pod_eviction(core_api, namespace):
    from localcluster import faults
    node = make_nodes(core_api, 1, "evict-")[0]
    core_api.create_namespaced_pod(namespace, trainer_pod("victim", node))
    wait_until(lambda: phase(core_api, namespace, "victim") == "Running", what="Running")
    faults.evict_pod(core_api, namespace, "victim")
    names = lambda: [p.metadata.name for p in core_api.list_namespaced_pod(namespace).items]  # noqa: E731
    wait_until(lambda: "victim" not in names(), what="evicted pod gone")


def test_helm_installs_a_chart(local_cluster, core_api, namespace, tmp_path):
    chart = tmp_path / "hello"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: hello\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hi\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\ndata:\n"
        "  greeting: {{ .Values.greeting | quote }}\n")
    helm = str(local_cluster.bin_dir / "helm")
    env = {"KUBECONFIG": str(local_cluster.kubeconfig), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    res = subprocess.run([helm, "install", "demo", str(chart), "-n", namespace, "--set", "greeting=hello",
                          "--wait", "--timeout", "60s"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert core_api.read_namespaced_config_map("demo-cm", namespace).data == {"greeting": "hello"}
    res = subprocess.run([helm, "uninstall", "demo", "-n", namespace], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_second_cluster_side_by_side_and_warm_up(local_cluster, tmp_path):
    """Another cluster on other ports and state dir starts (warm: binaries cached) and stops
    without touching the first."""
    from localcluster.cluster import Cluster, free_base_port
    other = Cluster(state_dir=tmp_path / "second", base_port=free_base_port(start=local_cluster.base_port + 100))
    took = other.up()
    try:
        print(f"\nwarm up of a second cluster: {took:.1f}s")
        from localcluster.cluster import pinned_version
        assert json.loads(other.kubectl("get", "--raw", "/version").stdout)["gitVersion"] == pinned_version("K8S_VERSION")
        assert took < 30
    finally:
        other.down()
    assert other.status() == {} and local_cluster.running()


def test_scale_128_nodes_and_128_pods(core_api, namespace):
    from localcluster.nodes import create_nodes
    t0 = time.monotonic()
    names = create_nodes(core_api, 128, "trn1.32xlarge", "scale-")
    wait_until(lambda: sum(is_ready(core_api, n) == "True" for n in names) == 128, timeout=180, interval=1,
               what="128 nodes Ready")
    t_nodes = time.monotonic() - t0
    for i in range(128):
        core_api.create_namespaced_pod(namespace, trainer_pod(f"rank-{i:03d}"))
    running = lambda: sum(p.status.phase == "Running" for p in core_api.list_namespaced_pod(namespace).items)  # noqa: E731
    wait_until(lambda: running() == 128, timeout=300, interval=1, what="128 pods Running")
    t_all = time.monotonic() - t0
    pods = core_api.list_namespaced_pod(namespace).items
    assert len({p.spec.node_name for p in pods}) == 128  # 16 devices each: one pod per node
    print(f"\nscale: 128 trn1 nodes Ready in {t_nodes:.1f}s; 128 pods x 16 Neuron devices Running "
          f"{t_all - t_nodes:.1f}s later ({t_all:.1f}s in all)")
    for n in names:
        core_api.delete_node(n)
