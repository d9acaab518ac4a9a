"""Paced disruptions against a real kube-apiserver, scheduler and `kubectl drain` (the operator a
real subprocess; simulated trn1 nodes): the run's PodDisruptionBudget holds the drain's eviction,
the operator sees the cordon and moves the gang once, resuming from its save, and spends no
restart budget; the drain then completes."""

from __future__ import annotations

import subprocess

import pytest

from tests.cluster.test_operator import (  # noqa: F401  (fixtures)
    create, crd, custom, gang, manifest, operator, report, status, wait_running_gang)
from tests.conftest import wait_until

pytestmark = pytest.mark.cluster


def test_a_drain_moves_the_gang_once_at_a_save_and_spends_no_budget(local_cluster, core_api, custom, namespace,
                                                                    operator):
    from kubernetes import client
    create(custom, namespace, manifest("drained", nodes=2))
    wait_running_gang(core_api, custom, namespace, "drained", 1, nodes=2)
    report(core_api, namespace, "drained", 1, 10, ckpt=10)
    wait_until(lambda: status(custom, namespace, "drained").get("phase") == "Running", what="Running")
    wait_until(lambda: (status(custom, namespace, "drained").get("lastCheckpoint") or {}).get("step") == 10,
               what="the save at step 10 seen")
    policy = client.PolicyV1Api(local_cluster.api_client())
    pdb, _ = wait_until(lambda: (lambda b: b if b.status and b.status.expected_pods == 2 else None)(
        policy.read_namespaced_pod_disruption_budget("drained", namespace)), what="the PodDisruptionBudget counting")
    assert pdb.spec.min_available == 2 and pdb.status.disruptions_allowed == 0

    first = gang(core_api, namespace, "drained", 1)
    node = first[0].spec.node_name
    drain = subprocess.Popen(["kubectl", "--kubeconfig", str(local_cluster.kubeconfig), "drain", node,
                              "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=120s",
                              "--pod-selector=trainium.dev/run=drained"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        record, _ = wait_until(lambda: next(iter(status(custom, namespace, "drained").get("failures") or []), None),
                               timeout=30, what="the move recorded")
        # the operator moved the gang (the budget held the drain's eviction): not an eviction, not a failure
        assert record["exempt"] == "voluntary" and "being drained" in record["message"], record
        assert record["node"] == node
        wait_running_gang(core_api, custom, namespace, "drained", 2, nodes=2, timeout=60)
        assert node not in {p.spec.node_name for p in gang(core_api, namespace, "drained", 2)}
        out, _ = drain.communicate(timeout=120)
        assert drain.returncode == 0, out  # the drain went on once the gang had moved
        st = status(custom, namespace, "drained")
        assert st["current"]["resumeCheckpoint"]["step"] == 10  # no step lost past the save
        assert len(st["failures"]) == 1  # moved once
        assert not any((st.get("failureCounters") or {}).get("recent", {}).values()), st.get("failureCounters")
    finally:
        if drain.poll() is None:
            drain.kill()
        local_cluster.kubectl("uncordon", node, check=False)
