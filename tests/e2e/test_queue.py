"""Kueue preemption under the operator with the real trainer's processes and Kueue's real
controller (v0.17.0, built from its Go module): a low-priority run trains; a high-priority run
of the same spec is queued on the same ClusterQueue, whose quota fits one; Kueue preempts the
low one, whose gang gets SIGTERM and saves the step it stopped at; it shows Preempted, spends
no budget and waits while the high one trains to the end; admitted again, it resumes from its
save and finishes with every step's loss and gradient norm equal, bitwise, to the high run's,
which ran the same spec uninterrupted (the high run is the reference).
"""

from __future__ import annotations

import pytest

from localcluster import drill
from localcluster.drill import Drill

pytestmark = pytest.mark.e2e
KQ, KV = "kueue.x-k8s.io", "v1beta2"
STEPS = 24
PREEMPT_AT = 8


@pytest.fixture(scope="module")
def kueue(e2e, tmp_path_factory):
    """Kueue's CRDs (the running operator notices them: kopf watches CRDs) and its controller."""
    from localcluster import kueue as harness
    harness.install_crds(lambda *a: e2e.cluster.kubectl(*a))
    k = harness.Kueue(e2e.cluster.kubeconfig, tmp_path_factory.mktemp("kueue"))
    yield k
    print("\n--- kueue log (tail) ---\n" + k.tail(2000))
    k.close()


def queue_objects(ns: str) -> list[tuple[str | None, str, dict]]:
    """A flavor of the process nodes, a ClusterQueue of two CPUs (one 2-pod gang of 1 CPU a pod)
    preempting lower priorities, the namespace's LocalQueue, and two priority classes."""
    cq = f"cq-{ns}"[:63]
    return [
        (None, "resourceflavors", {"apiVersion": f"{KQ}/{KV}", "kind": "ResourceFlavor",
                                   "metadata": {"name": "e2e-default"}, "spec": {}}),
        (None, "workloadpriorityclasses", {"apiVersion": f"{KQ}/{KV}", "kind": "WorkloadPriorityClass",
                                           "metadata": {"name": "e2e-low"}, "value": 10}),
        (None, "workloadpriorityclasses", {"apiVersion": f"{KQ}/{KV}", "kind": "WorkloadPriorityClass",
                                           "metadata": {"name": "e2e-high"}, "value": 1000}),
        (None, "clusterqueues", {"apiVersion": f"{KQ}/{KV}", "kind": "ClusterQueue", "metadata": {"name": cq}, "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [{"coveredResources": ["cpu"], "flavors": [
                {"name": "e2e-default", "resources": [{"name": "cpu", "nominalQuota": 2}]}]}]}}),
        (ns, "localqueues", {"apiVersion": f"{KQ}/{KV}", "kind": "LocalQueue", "metadata": {"name": "team", "namespace": ns},
                             "spec": {"clusterQueue": cq}}),
    ]


def queued(name: str, priority: str, tiny_data, workdir) -> dict:
    body = drill.manifest(name, tiny_data, workdir, training={"steps": STEPS},
                          checkpoint={"intervalSteps": 4, "keep": 100},
                          logging={"interval": 4, "progressIntervalSeconds": 1},
                          podTemplate={"spec": {"resources": {"requests": {"cpu": "1"}}}})
    body["metadata"]["labels"] = {f"{KQ}/queue-name": "team", f"{KQ}/priority-class": priority}
    return body


def test_a_preempted_run_saves_waits_and_resumes_bitwise(e2e, kueue, tiny_data, tmp_path):
    from kubernetes import client

    from localcluster import kueue as harness
    custom = client.CustomObjectsApi(e2e.cluster.api_client())
    ns = e2e.namespace("preempt")
    harness.create_all(custom, queue_objects(ns))
    low = Drill(e2e.cluster, ns, queued("low", "e2e-low", tiny_data, tmp_path))
    low.create()
    low.wait_step(PREEMPT_AT, 300)
    high = Drill(e2e.cluster, ns, queued("high", "e2e-high", tiny_data, tmp_path))
    high.create()
    st = low.wait(lambda: (s := low.status()).get("queue", {}).get("state") == "Preempted" and not low.pods() and s,
                  120, "low preempted with its gang gone")
    stopped = low.trained_step()
    assert st["phase"] == "Queued" and not st.get("failures") and not st.get("restarts"), st
    done = high.wait(lambda: (s := high.status()).get("phase") in ("Succeeded", "Failed") and s, 400, "high to end")
    assert done["phase"] == "Succeeded", done.get("message")
    st = low.wait(lambda: (s := low.status()).get("phase") in ("Succeeded", "Failed") and s, 400, "low to end")
    assert st["phase"] == "Succeeded", st.get("message")

    reference = drill.ground_truth(high.losses_path, done["createdTime"])
    truth = drill.ground_truth(low.losses_path, st["createdTime"])
    print(f"\nlow preempted after step {stopped}, resumed from step {st['current']['resumeCheckpoint']['step']} "
          f"after {st['suspension']['seconds']:.1f}s queued; queue {st['queue']}; goodput {st['goodput']}")
    # preempted, not failed: no failure, no restart, no budget; counted once as an eviction
    assert not st.get("failures") and not st.get("restarts") and st["queue"]["evictions"] == 1
    assert st["attempt"] == 2
    # the Workload marked Finished in the pass that saw the run succeed; the next pass reads it back
    low.wait(lambda: low.status().get("queue", {}).get("state") == "Finished", 30, "low's Workload Finished")
    # it resumed from the save it made when stopped, and trained nothing twice
    assert st["current"]["resumeCheckpoint"]["step"] == stopped
    assert st["goodput"]["lostSeconds"]["recompute"] == 0
    # the time queued is neither productive nor lost
    assert st["suspension"]["seconds"] > 0
    # bitwise: every step's loss and gradient norm as in the run that was never preempted
    assert sorted(truth.losses) == sorted(reference.losses) == list(range(1, STEPS + 1))
    for step, rec in reference.losses.items():
        got = truth.losses[step]
        assert (got["loss"], got["gradNorm"]) == (rec["loss"], rec["gradNorm"]), f"step {step}"
