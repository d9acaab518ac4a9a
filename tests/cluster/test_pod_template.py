"""spec.podTemplate and the CamelCase enumeration words against a real kube-apiserver and
kube-scheduler (the operator a real subprocess; simulated trn1 nodes): the API server takes the
pods the template shapes, the scheduler places them by its node selector and priority class,
the template changes only while the run is suspended, and a recipe written as a user would
(`preflight: Enabled`, `stragglers: Disabled`) is taken while an unquoted `on` is refused naming
the field."""

from __future__ import annotations

import pytest
import yaml

from tests.cluster.test_operator import (  # noqa: F401  (fixtures)
    GROUP, PLURAL, VERSION, create, crd, custom, gang, manifest, operator, status, wait_running_gang)
from tests.conftest import wait_until

pytestmark = pytest.mark.cluster
POOL = "karpenter.sh/nodepool"


@pytest.fixture
def reserved_pool(core_api, operator):
    """Two of the operator's simulated nodes labelled as a reserved node pool."""
    names = sorted(n.metadata.name for n in core_api.list_node().items if n.metadata.name.startswith("op-"))[-2:]
    for n in names:
        core_api.patch_node(n, {"metadata": {"labels": {POOL: "reserved"}}})
    yield names
    for n in names:
        core_api.patch_node(n, {"metadata": {"labels": {POOL: None}}})


@pytest.fixture
def priority_class(local_cluster):
    from kubernetes import client
    api = client.SchedulingV1Api(local_cluster.api_client())
    body = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": "training-high"},
            "value": 100000, "description": "test"}
    try:
        api.create_priority_class(body)
    except client.exceptions.ApiException as exc:
        if exc.status != 409:
            raise
    yield "training-high"


def test_a_template_shapes_the_pods_the_api_server_and_scheduler_take(local_cluster, core_api, custom, namespace,
                                                                      reserved_pool, priority_class):
    body = manifest("templated", nodes=2)
    # a Kueue label reaches the pods (the queue-name label would queue the run: tests/cluster/test_kueue.py)
    body["metadata"]["labels"] = {"kueue.x-k8s.io/priority-class": "research"}
    body["spec"]["podTemplate"] = {
        "metadata": {"labels": {"team": "pretrain"}, "annotations": {"example.com/owner": "alice"}},
        "spec": {"nodeSelector": {POOL: "reserved"}, "priorityClassName": priority_class,
                 "tolerations": [{"key": "capacity-block", "operator": "Exists", "effect": "NoSchedule"}],
                 "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "96Gi"}},
                 "initContainers": [{"name": "log-shipper", "image": "fluent-bit:3", "restartPolicy": "Always",
                                     "securityContext": {"runAsUser": 1000}}]}}
    create(custom, namespace, body)
    wait_running_gang(core_api, custom, namespace, "templated", 1, nodes=2)
    pods = gang(core_api, namespace, "templated", 1)
    assert sorted(p.spec.node_name for p in pods) == reserved_pool  # the pool's nodes, one pod each
    for p in pods:
        assert p.metadata.labels["team"] == "pretrain" and p.metadata.labels["kueue.x-k8s.io/priority-class"] == "research"
        assert p.spec.priority_class_name == priority_class and p.spec.priority == 100000  # resolved by the API server
        assert p.metadata.annotations["karpenter.sh/do-not-disrupt"] == "true"  # faultTolerance.doNotDisrupt
        trainer = p.spec.containers[0]
        assert trainer.resources.requests["cpu"] == "8" and trainer.resources.limits["aws.amazon.com/neuron"] == "16"
        (shipper,) = p.spec.init_containers
        assert shipper.restart_policy == "Always" and shipper.security_context.capabilities.drop == ["ALL"]
        assert shipper.security_context.run_as_user == 1000

    # the template is the next gang's: the API server refuses a change while the gang runs ...
    res = local_cluster.kubectl("patch", "trainingrun", "templated", "-n", namespace, "--type=merge",
                                "-p", '{"spec":{"podTemplate":{"metadata":{"labels":{"team":"eval"}}}}}', check=False)
    assert res.returncode != 0 and "spec.podTemplate may change only while the run is suspended" in res.stderr, \
        res.stderr
    # ... and takes it once the run is suspended, and in the edit that resumes it
    local_cluster.kubectl("patch", "trainingrun", "templated", "-n", namespace, "--type=merge",
                          "-p", '{"spec":{"suspend":true}}')
    wait_until(lambda: not gang(core_api, namespace, "templated"), timeout=60, what="the gang stopped")
    local_cluster.kubectl("patch", "trainingrun", "templated", "-n", namespace, "--type=merge",
                          "-p", '{"spec":{"suspend":false,"podTemplate":{"metadata":{"labels":{"team":"eval"}}}}}')
    wait_until(lambda: (ps := gang(core_api, namespace, "templated")) and
               all(p.metadata.labels.get("team") == "eval" for p in ps) and len(ps) == 2,
               timeout=60, what="the resumed gang with the new template")


def test_a_template_the_operator_refuses_names_its_field(custom, namespace, operator):
    body = manifest("forged", nodes=2)
    body["spec"]["podTemplate"] = {"metadata": {"annotations": {"trainium.dev/progress": '{"step": 999}'}}}
    create(custom, namespace, body)
    st, _ = wait_until(lambda: status(custom, namespace, "forged").get("conditions"), what="the run judged")
    valid = next(c for c in st if c["type"] == "Valid")
    assert valid["status"] == "False"
    assert valid["message"].startswith("spec.podTemplate.metadata.annotations.trainium.dev/progress:"), valid


RECIPE = """
apiVersion: trainium.dev/v1alpha1
kind: TrainingRun
metadata: {{name: {name}}}
spec:
  image: trainer:test
  nodes: 2
  instanceType: trn1.32xlarge
  model: {{preset: llama2-7b}}
  parallelism: {{tensor: 8, sequenceParallel: true}}
  training: {{seqLen: 4096, globalBatchSize: 1024, microBatchSize: 1}}
  data: {{sources: [{{uri: s3://corpus/train/}}], tokenizer: s3://corpus/tok.json}}
  checkpoint: {{uri: s3://team-checkpoints/{namespace}/{name}, memory: {memory}}}
  faultTolerance:
    preflight: {preflight}
    stragglers: {stragglers}
"""


def test_a_recipe_written_as_a_user_would_is_taken(local_cluster, custom, namespace, operator, tmp_path):
    def apply(name, **words):
        f = tmp_path / f"{name}.yaml"
        f.write_text(RECIPE.format(name=name, namespace=namespace, **words))
        return local_cluster.kubectl("apply", "-n", namespace, "-f", str(f), check=False)

    res = apply("camel", preflight="Enabled", stragglers="Disabled", memory="Peers")
    assert res.returncode == 0, res.stderr
    res = apply("older", preflight='"on"', stragglers="report", memory='"off"')  # what was valid stays valid
    assert res.returncode == 0, res.stderr
    for name in ("camel", "older"):
        st, _ = wait_until(lambda: status(custom, namespace, name).get("conditions"), what=f"{name} judged")
        assert next(c for c in st if c["type"] == "Valid")["status"] == "True", (name, st)
    res = apply("bare", preflight="on", stragglers="Report", memory="Auto")  # YAML 1.1: on is true
    assert res.returncode != 0 and "spec.faultTolerance.preflight" in res.stderr, res.stderr
    stored = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "camel")["spec"]
    assert stored["faultTolerance"]["preflight"] == "Enabled" and yaml.safe_dump(stored)


def test_two_runs_racing_for_one_pool_one_trains_and_neither_fails(core_api, custom, namespace, operator):
    """No queue: a pool of three nodes, two runs of two nodes each created together. Each may
    hold part of the pool at first; a gang not placed whole is released and placed again after
    a jittered backoff, so one run trains while the other waits and says why, neither spends a
    budget, and the waiting one trains once the pool is free."""
    names = sorted(n.metadata.name for n in core_api.list_node().items if n.metadata.name.startswith("op-"))[:3]
    for n in names:
        core_api.patch_node(n, {"metadata": {"labels": {"pool": "race"}}})
    try:
        for run in ("race-a", "race-b"):
            body = manifest(run, nodes=2, scheduleTimeoutSeconds=3, restartBudget={"scheduling": 1})
            body["spec"]["podTemplate"] = {"spec": {"nodeSelector": {"pool": "race"}}}
            create(custom, namespace, body)

        def one_trains():
            running = [r for r in ("race-a", "race-b")
                       if len([p for p in gang(core_api, namespace, r) if p.status.phase == "Running"]) == 2]
            return running[0] if len(running) == 1 else None
        winner, waited = wait_until(one_trains, timeout=120, what="one run's gang placed whole")
        loser = "race-b" if winner == "race-a" else "race-a"
        # the other waits, says why, and spends nothing
        st, _ = wait_until(lambda: (s := status(custom, namespace, loser)).get("failures") and s, timeout=60,
                           what="the other run's wait")
        print(f"\n{winner} trains {waited:.1f}s after both were created; {loser}: {st.get('message')}")
        assert st["phase"] in ("Starting", "Restarting"), st
        assert all(f["cause"] == "scheduling" for f in st["failures"])
        assert not (st.get("failureCounters") or {}).get("recent", {}).get("scheduling"), st.get("failureCounters")
        for run in (winner, loser):
            assert status(custom, namespace, run)["phase"] != "Failed"
        # the winner finishes (here: deleted); the waiting one then trains
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, winner)
        wait_until(lambda: len([p for p in gang(core_api, namespace, loser) if p.status.phase == "Running"]) == 2,
                   timeout=120, what=f"{loser} placed once the pool is free")
        assert status(custom, namespace, loser)["phase"] != "Failed"
    finally:
        for n in names:
            core_api.patch_node(n, {"metadata": {"labels": {"pool": None}}})
