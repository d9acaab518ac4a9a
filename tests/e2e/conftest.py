"""The e2e tier's control plane: its own cluster (so no simulated node of another tier can take
a pod), three process-backed cpu nodes (a gang of two and a spare for quarantines), the CRD,
and the operator as a real process for the whole module."""

from __future__ import annotations

import re
import time

import pytest

from localcluster import drill, faults
from localcluster.cluster import Cluster, free_base_port

NODES = 3


class E2E:
    def __init__(self, cluster: Cluster, operator: drill.Operator, nodes: list[str]):
        from kubernetes import client
        self.cluster, self.operator, self.nodes = cluster, operator, nodes
        self.core = client.CoreV1Api(cluster.api_client())

    def namespace(self, label: str) -> str:
        name = "e2e-" + re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")[:40]
        self.core.create_namespace({"metadata": {"name": name}})
        deadline = time.monotonic() + 30
        while True:  # pods need the default ServiceAccount and the API server's CA ConfigMap
            try:
                self.core.read_namespaced_service_account("default", name)
                self.core.read_namespaced_config_map("kube-root-ca.crt", name)
                return name
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def heal_nodes(self) -> None:
        """Undo what a test did to the nodes: faults, quarantine taints."""
        for n in self.core.list_node(label_selector="localcluster.trainium.dev/processes=true").items:
            taints = [t for t in n.spec.taints or [] if t.key != "trainium.dev/quarantined"]
            if len(taints) != len(n.spec.taints or []):
                self.core.patch_node(n.metadata.name, {"spec": {"taints": [
                    self.core.api_client.sanitize_for_serialization(t) for t in taints]},
                    "metadata": {"labels": {"trainium.dev/quarantined": None}}})
            if any(c.type == "NeuronHealth" and c.status == "True" for c in n.status.conditions or []):
                faults.neuron_healthy(self.core, n.metadata.name)
            if (n.metadata.labels or {}).get(faults.NOT_READY_LABEL):
                faults.node_recover(self.core, n.metadata.name)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            nodes = self.core.list_node(label_selector="localcluster.trainium.dev/processes=true").items
            if all(any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or []) and
                   not any(t.key.startswith("node.kubernetes.io/") for t in n.spec.taints or []) for n in nodes):
                return
            time.sleep(0.2)
        raise AssertionError("process nodes did not become healthy again")


@pytest.fixture(scope="session")
def e2e(tmp_path_factory):
    import warnings
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    state = tmp_path_factory.mktemp("e2e-cluster")
    cluster = Cluster(state_dir=state, base_port=free_base_port(start=26000))
    cluster.up()
    operator = None
    try:
        cluster.kubectl("apply", "-f", str(drill.ROOT / "crds" / "trainingruns.trainium.dev.yaml"))
        cluster.kubectl("wait", "--for=condition=Established", "crd/trainingruns.trainium.dev", "--timeout=60s")
        nodes = drill.process_nodes(cluster, NODES, "e2e-")
        operator = drill.Operator(cluster, state / "operator.log")
        operator.start()
        yield E2E(cluster, operator, nodes)
    finally:
        if operator:
            operator.stop()
            print("\n--- operator log (tail) ---\n" + (state / "operator.log").read_text()[-2000:])
        cluster.down(keep_state=True)
        drill.kill_leftovers(cluster.pods_dir)


@pytest.fixture(autouse=True)
def healthy_nodes(e2e):
    yield
    e2e.heal_nodes()
