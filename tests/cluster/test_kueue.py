"""Kueue admission with Kueue's real controller (v0.17.0, built from its Go module:
tools/localcluster/kueue.py) and the operator as a real subprocess, against the local API
server and scheduler (simulated trn1 nodes; the gang's progress reports are written as the
trainer writes them).

A run labelled kueue.x-k8s.io/queue-name gets a Workload it owns; no pod exists until Kueue
admits it; the flavor's node labels reach the pods; a second run that the quota does not fit
is Queued with Kueue's reason and spends no budget, and starts when the first finishes; a
higher-priority run preempts a lower one, which stops at its save, shows Preempted, spends no
budget, and resumes from that save when admitted again; a namespace whose admission policy
requires the queue label refuses a run without it at once, with the policy's words.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.cluster.test_operator import (  # noqa: F401  (fixtures)
    CHECKPOINT_STORES, DEVICE_SETTLE, GROUP, PLURAL, VERSION, crd, create, custom, gang, manifest, report, status,
    start_operator, wait_running_gang)
from tests.conftest import wait_until

pytestmark = pytest.mark.cluster
KQ, KV = "kueue.x-k8s.io", "v1beta2"
POOL = "trainium.dev/test-pool"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"


@pytest.fixture(scope="module")
def kueue(local_cluster, crd, core_api, tmp_path_factory):
    """Kueue's CRDs and controller; four simulated trn1 nodes in a pool its flavor names."""
    from localcluster import kueue as kueue_harness
    from localcluster.nodes import create_nodes

    def kubectl(*args):
        local_cluster.kubectl(*args)
    kueue_harness.install_crds(kubectl)
    nodes = create_nodes(core_api, 4, "trn1.32xlarge", "kq-")
    for n in nodes:
        core_api.patch_node(n, {"metadata": {"labels": {POOL: "kueue"}}})
    k = kueue_harness.Kueue(local_cluster.kubeconfig, tmp_path_factory.mktemp("kueue"), pods_ready_timeout="2m")
    yield {"controller": k, "nodes": nodes}
    print("\n--- kueue log (tail) ---\n" + k.tail(3000))
    k.close()


@pytest.fixture(scope="module")
def operator(local_cluster, kueue, core_api, tmp_path_factory):
    """The operator, started once Kueue's API is there (its Workload watch begins at start-up)."""
    log_path = tmp_path_factory.mktemp("operator") / "operator.log"
    proc = start_operator(local_cluster, log_path, DEVICE_SETTLE, *CHECKPOINT_STORES, port_offset=320)
    proc.log_path = log_path  # type: ignore[attr-defined]
    yield proc
    proc.terminate()
    proc.wait(20)
    print("\n--- operator log (tail) ---\n" + log_path.read_text()[-3000:])


@pytest.fixture
def queue(local_cluster, custom, namespace, kueue):
    """A ResourceFlavor of the pool, a ClusterQueue whose quota fits two trn1 nodes (preempting
    lower priorities within it), a LocalQueue "team" in the test's namespace, and a low and a
    high WorkloadPriorityClass."""
    from localcluster import kueue as kueue_harness
    cq = f"cq-{namespace}"[:63]
    objs = [
        (None, "resourceflavors", {"apiVersion": f"{KQ}/{KV}", "kind": "ResourceFlavor", "metadata": {"name": "trn1-pool"},
                                   "spec": {"nodeLabels": {POOL: "kueue"}}}),
        (None, "workloadpriorityclasses", {"apiVersion": f"{KQ}/{KV}", "kind": "WorkloadPriorityClass",
                                           "metadata": {"name": "low"}, "value": 100}),
        (None, "workloadpriorityclasses", {"apiVersion": f"{KQ}/{KV}", "kind": "WorkloadPriorityClass",
                                           "metadata": {"name": "high"}, "value": 1000}),
        (None, "clusterqueues", {"apiVersion": f"{KQ}/{KV}", "kind": "ClusterQueue", "metadata": {"name": cq}, "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [{"coveredResources": ["aws.amazon.com/neuron", "vpc.amazonaws.com/efa"], "flavors": [
                {"name": "trn1-pool", "resources": [{"name": "aws.amazon.com/neuron", "nominalQuota": 32},
                                                    {"name": "vpc.amazonaws.com/efa", "nominalQuota": 16}]}]}]}}),
        (namespace, "localqueues", {"apiVersion": f"{KQ}/{KV}", "kind": "LocalQueue",
                                    "metadata": {"name": "team", "namespace": namespace},
                                    "spec": {"clusterQueue": cq}}),
    ]
    kueue_harness.create_all(custom, objs)

    def active():
        got = custom.get_cluster_custom_object(KQ, KV, "clusterqueues", cq)
        return any(c["type"] == "Active" and c["status"] == "True" for c in (got.get("status") or {}).get("conditions") or [])
    wait_until(active, timeout=60, what="the ClusterQueue active")
    yield cq
    custom.delete_cluster_custom_object(KQ, KV, "clusterqueues", cq)


def queued_manifest(name: str, priority: str | None = None, nodes: int = 2) -> dict:
    body = manifest(name, nodes=nodes)
    body["metadata"]["labels"] = {QUEUE_LABEL: "team", **({PRIORITY_LABEL: priority} if priority else {})}
    return body


def workload(custom, ns, run) -> dict:
    """The run's Workload ({} while the operator has not made it yet)."""
    from kubernetes.client.exceptions import ApiException
    try:
        return custom.get_namespaced_custom_object(KQ, KV, ns, "workloads", f"trainingrun-{run}")
    except ApiException as exc:
        if exc.status != 404:
            raise
        return {}


def condition(obj: dict, kind: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def finish(core_api, ns, run, attempt) -> None:
    from localcluster import faults
    for p in gang(core_api, ns, run, attempt):
        faults.pod_succeed(core_api, ns, p.metadata.name)


def test_a_run_waits_for_quota_says_why_spends_nothing_and_starts_when_the_first_finishes(
        local_cluster, core_api, custom, namespace, operator, queue, kueue):
    create(custom, namespace, queued_manifest("first"))
    wait_running_gang(core_api, custom, namespace, "first", 1, nodes=2, timeout=60)
    pods = gang(core_api, namespace, "first", 1)
    # the flavor's node label reached the pods, and the scheduler placed them in its pool
    assert all(p.spec.node_selector.get(POOL) == "kueue" for p in pods)
    assert {p.spec.node_name for p in pods} <= set(kueue["nodes"])
    assert all(p.metadata.labels.get("kueue.x-k8s.io/podset") == "trainer" for p in pods)
    wl = workload(custom, namespace, "first")
    assert wl["metadata"]["ownerReferences"][0]["kind"] == "TrainingRun"
    assert [ps["count"] for ps in wl["spec"]["podSets"]] == [2]
    report(core_api, namespace, "first", 1, 5)
    wait_until(lambda: status(custom, namespace, "first").get("phase") == "Running", what="first Running")
    wait_until(lambda: condition(workload(custom, namespace, "first"), "PodsReady").get("status") == "True",
               what="PodsReady True on the Workload")
    st = status(custom, namespace, "first")
    assert st["queue"]["state"] == "Admitted" and st["queue"]["clusterQueue"] == queue

    create(custom, namespace, queued_manifest("second"))
    second, _ = wait_until(lambda: (lambda s: s if "insufficient" in (s.get("queue") or {}).get("message", "") else None)(
        status(custom, namespace, "second")), timeout=30, what="second Queued with Kueue's reason")
    assert second["queue"]["reason"] == "Pending"
    assert second["phase"] == "Queued" and second["queue"]["state"] == "Queued", second
    assert "insufficient" in second["queue"]["message"], second["queue"]  # Kueue's own words
    time.sleep(3)  # it stays so: no pod, no attempt, no failure
    second = status(custom, namespace, "second")
    assert not gang(core_api, namespace, "second") and second.get("attempt", 0) == 0
    assert not second.get("failures") and not second.get("restartCount"), second
    table = local_cluster.kubectl("get", "trun", "-n", namespace).stdout
    assert "QUEUE" in table and "Queued" in table and "Admitted" in table, table

    finish(core_api, namespace, "first", 1)
    wait_until(lambda: status(custom, namespace, "first").get("phase") == "Succeeded", timeout=30,
               what="first Succeeded")
    wait_until(lambda: condition(workload(custom, namespace, "first"), "Finished").get("status") == "True",
               what="the first Workload Finished (its quota freed)")
    wait_running_gang(core_api, custom, namespace, "second", 1, nodes=2, timeout=60)
    second = status(custom, namespace, "second")
    assert second["queue"]["state"] == "Admitted" and not second.get("failures"), second


def test_a_higher_priority_run_preempts_a_lower_one_which_resumes_from_its_save(
        core_api, custom, namespace, operator, queue):
    create(custom, namespace, queued_manifest("low", "low"))
    wait_running_gang(core_api, custom, namespace, "low", 1, nodes=2, timeout=60)
    report(core_api, namespace, "low", 1, 20, ckpt=20)
    wait_until(lambda: (status(custom, namespace, "low").get("lastCheckpoint") or {}).get("step") == 20,
               what="low's save at step 20 seen")

    create(custom, namespace, queued_manifest("high", "high"))
    low, _ = wait_until(lambda: (lambda s: s if (s.get("queue") or {}).get("state") == "Preempted" else None)(
        status(custom, namespace, "low")), timeout=60, what="low Preempted")
    wait_running_gang(core_api, custom, namespace, "high", 1, nodes=2, timeout=60)
    low = status(custom, namespace, "low")
    assert low["phase"] == "Queued" and low["queue"]["evictions"] == 1, low
    assert not low.get("failures") and not low.get("restartCount"), low  # not a failure: no budget spent
    assert not gang(core_api, namespace, "low")
    wl = workload(custom, namespace, "low")
    assert "admission" not in (wl.get("status") or {})  # its quota handed back
    assert condition(wl, "Requeued").get("status") == "True"

    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "high")
    wait_running_gang(core_api, custom, namespace, "low", 2, nodes=2, timeout=90)
    low = status(custom, namespace, "low")
    assert low["current"]["resumeCheckpoint"]["step"] == 20, low["current"]  # resumed from its save
    assert low["queue"]["state"] == "Admitted" and not low.get("failures"), low
    assert (low.get("suspension") or {}).get("seconds", 0) > 0  # the time preempted is not counted as lost


def test_a_namespace_that_requires_the_queue_label_refuses_a_run_without_it_at_once(
        local_cluster, core_api, custom, namespace, operator, queue):
    from kubernetes import client
    adm = client.AdmissionregistrationV1Api(local_cluster.api_client())
    policy = f"require-queue-{namespace}"[:63]
    adm.create_validating_admission_policy({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": policy},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                         "operations": ["CREATE"], "resources": ["pods"]}]},
                 "validations": [{"expression": "has(object.metadata.labels) && "
                                                "'kueue.x-k8s.io/queue-name' in object.metadata.labels",
                                  "message": "pods in this namespace need a kueue.x-k8s.io/queue-name label "
                                             "(task governance)"}]}})
    adm.create_validating_admission_policy_binding({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": policy},
        "spec": {"policyName": policy, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}}})
    try:
        time.sleep(2)  # the API server loads the policy
        create(custom, namespace, queued_manifest("labelled"))
        wait_running_gang(core_api, custom, namespace, "labelled", 1, nodes=2, timeout=60)
        create(custom, namespace, manifest("unlabelled", nodes=2))
        st, waited = wait_until(lambda: (lambda s: s if s.get("phase") == "Failed" else None)(
            status(custom, namespace, "unlabelled")), timeout=60, what="the unlabelled run refused")
        assert "need a kueue.x-k8s.io/queue-name label" in st["message"], st["message"]
        # refused once the refusal held for judge.ADMISSION_DENIAL_SECONDS (20 s), not after the
        # scheduling budget (about 40 minutes); one record, no restart
        assert waited < 45 and [f["action"] for f in st["failures"]] == ["fail"] and not st.get("restartCount")
    finally:
        adm.delete_validating_admission_policy_binding(policy)
        adm.delete_validating_admission_policy(policy)


def test_the_workload_is_the_runs_and_goes_with_it(local_cluster, core_api, custom, namespace, operator, queue):
    """The Workload is made for the run and goes with it. One the operator's watch no longer
    holds (its run label removed: the watch selects on it; in CI a watch opened while Kueue was
    being installed once missed a creation) is read from the API server: the admitted gang
    keeps running, the run does not fall back to Queued."""
    from trainium_api import keys
    create(custom, namespace, queued_manifest("gone"))
    wait_running_gang(core_api, custom, namespace, "gone", 1, nodes=2, timeout=60)
    wl = workload(custom, namespace, "gone")
    spec = wl["spec"]
    assert spec["queueName"] == "team" and spec["podSets"][0]["name"] == "trainer"
    requests = spec["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests["aws.amazon.com/neuron"] == "16", json.dumps(spec)

    pods = {p.metadata.uid for p in gang(core_api, namespace, "gone", 1)}
    custom.patch_namespaced_custom_object(KQ, KV, namespace, "workloads", wl["metadata"]["name"],
                                          {"metadata": {"labels": {keys.RUN: None}}})
    for _ in range(6):  # three of the direct reads' periods
        time.sleep(1)
        st = status(custom, namespace, "gone")
        assert st["queue"]["state"] == "Admitted", st["queue"]
        assert {p.metadata.uid for p in gang(core_api, namespace, "gone", 1)} == pods
    assert "is not in the operator's watch" in operator.log_path.read_text()

    # the same reads, seen from a Watcher whose indices hold nothing (a flavor's watch has no
    # label to remove): the Workload and its admitted flavor come from the API server
    from trainium_operator.applier import Pools
    from trainium_operator.kube import Kube
    from trainium_operator.metrics import Metrics
    from trainium_operator.watcher import Watcher
    blind = Watcher(Kube(local_cluster.api_client()), Metrics(), Pools())
    run = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gone")
    snap = blind.snapshot(run, namespace, "gone", run_pods={}, cluster_nodes={}, run_workloads={}, kueue_flavors={})
    assert snap.workload is not None and snap.workload.admitted, snap.workload
    assert snap.flavors["trn1-pool"].node_labels == {POOL: "kueue"}, snap.flavors
    assert blind.unindexed_flavors(["no-such-flavor"]) == {}
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gone")

    wait_until(lambda: not workload(custom, namespace, "gone"), timeout=60,
               what="the Workload garbage-collected with its run")


LAYER_1, LAYER_3 = "topology.k8s.aws/network-node-layer-1", "topology.k8s.aws/network-node-layer-3"


@pytest.fixture
def topology(custom, core_api, kueue, namespace):
    """EKS's network topology labels on the four pool nodes (one layer-1 block, two layer-3
    blocks of two nodes each), a Kueue Topology of those levels and the hostname, a flavor of
    the pool with it, and a ClusterQueue of that flavor fitting three nodes."""
    nodes = kueue["nodes"]
    # Kueue counts the pods on a flavor's nodes; it looks at a workload it could not fit again
    # when a queue changes, not when a pod goes: earlier tests' gangs leave the pool first
    wait_until(lambda: not [p for p in core_api.list_pod_for_all_namespaces().items if p.spec.node_name in nodes],
               timeout=90, what="the pool empty of earlier tests' pods")
    for i, n in enumerate(nodes):
        core_api.patch_node(n, {"metadata": {"labels": {LAYER_1: "nn-1", LAYER_3: f"nn-3-{i // 2}"}}})
    objs = [("topologies", {"apiVersion": f"{KQ}/{KV}", "kind": "Topology", "metadata": {"name": "eks-network"},
                            "spec": {"levels": [{"nodeLabel": LAYER_1}, {"nodeLabel": LAYER_3},
                                                {"nodeLabel": "kubernetes.io/hostname"}]}}),
            ("resourceflavors", {"apiVersion": f"{KQ}/{KV}", "kind": "ResourceFlavor",
                                 "metadata": {"name": "trn1-topology"},
                                 "spec": {"nodeLabels": {POOL: "kueue"}, "topologyName": "eks-network"}})]
    for plural, body in objs:
        try:
            custom.create_cluster_custom_object(KQ, KV, plural, body)
        except Exception as exc:  # noqa: BLE001 - shared, made by an earlier test
            if getattr(exc, "status", None) != 409:
                raise
    cq = f"tas-{namespace}"[:63]
    custom.create_cluster_custom_object(KQ, KV, "clusterqueues", {
        "apiVersion": f"{KQ}/{KV}", "kind": "ClusterQueue", "metadata": {"name": cq}, "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "resourceGroups": [{"coveredResources": ["aws.amazon.com/neuron", "vpc.amazonaws.com/efa"], "flavors": [
                {"name": "trn1-topology", "resources": [{"name": "aws.amazon.com/neuron", "nominalQuota": 48},
                                                        {"name": "vpc.amazonaws.com/efa", "nominalQuota": 24}]}]}]}})
    custom.create_namespaced_custom_object(KQ, KV, namespace, "localqueues", {
        "apiVersion": f"{KQ}/{KV}", "kind": "LocalQueue", "metadata": {"name": "team", "namespace": namespace},
        "spec": {"clusterQueue": cq}})
    yield nodes
    custom.delete_cluster_custom_object(KQ, KV, "clusterqueues", cq)
    for n in nodes:
        core_api.patch_node(n, {"metadata": {"labels": {LAYER_1: None, LAYER_3: None}}})


def test_a_gang_that_requires_a_network_block_is_placed_in_one_by_kueue(core_api, custom, namespace, operator,
                                                                        topology):
    body = queued_manifest("compact")
    body["spec"]["podTemplate"] = {"metadata": {"annotations": {"kueue.x-k8s.io/podset-required-topology": LAYER_3}}}
    create(custom, namespace, body)
    seen: list = [{}]

    def admitted():
        seen[0] = workload(custom, namespace, "compact")
        return seen[0] if (seen[0].get("status") or {}).get("admission") else None
    try:
        wl, _ = wait_until(admitted, timeout=90, what="the Workload admitted with a topology assignment")
    except AssertionError:
        pods = [(p.metadata.namespace, p.metadata.name, p.spec.node_name)
                for p in core_api.list_pod_for_all_namespaces().items if p.spec.node_name in topology]
        raise AssertionError(f"not admitted: {(seen[0].get('status') or {}).get('conditions')}; pods on the pool: "
                             f"{pods}")
    assert wl["spec"]["podSets"][0]["topologyRequest"] == {"required": LAYER_3}
    assert wl["status"]["admission"]["podSetAssignments"][0].get("topologyAssignment"), wl["status"]
    wait_running_gang(core_api, custom, namespace, "compact", 1, nodes=2, timeout=60)
    pods = gang(core_api, namespace, "compact", 1)
    blocks = {core_api.read_node(p.spec.node_name).metadata.labels[LAYER_3] for p in pods}
    assert len(blocks) == 1, blocks  # both pods in one layer-3 block
    for p in pods:
        assert not p.spec.scheduling_gates  # Kueue's topology ungater lifted its gate
        assert p.metadata.annotations["kueue.x-k8s.io/workload"] == "trainingrun-compact"


def test_a_template_edited_while_suspended_reaches_the_workload_and_suspend_frees_the_quota(
        local_cluster, core_api, custom, namespace, operator, queue):
    body = queued_manifest("edited")
    create(custom, namespace, body)
    wait_running_gang(core_api, custom, namespace, "edited", 1, nodes=2, timeout=60)
    local_cluster.kubectl("patch", "trainingrun", "edited", "-n", namespace, "--type=merge",
                          "-p", '{"spec":{"suspend":true}}')
    wl, _ = wait_until(lambda: (lambda w: w if w and w["spec"].get("active") is False
                                and "admission" not in (w.get("status") or {}) else None)(
        workload(custom, namespace, "edited")), timeout=60, what="the Workload deactivated, its quota freed")
    local_cluster.kubectl("patch", "trainingrun", "edited", "-n", namespace, "--type=merge",
                          "-p", '{"spec":{"podTemplate":{"spec":{"nodeSelector":{"team":"pretrain"}}}}}')
    wait_until(lambda: workload(custom, namespace, "edited")["spec"]["podSets"][0]["template"]["spec"]
               .get("nodeSelector", {}).get("team") == "pretrain", timeout=30,
               what="the Workload's pod set updated (the API server and Kueue's CRD took it)")
    assert status(custom, namespace, "edited")["phase"] == "Suspended"
