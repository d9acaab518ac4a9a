"""The operator (a real subprocess) against the local control plane with simulated trn1 nodes.

Progress is written on the pods exactly as the trainer writes it (trainium_api.progress.ProgressReport).
Detection and recovery times are printed; the goals are in the issue and bench/ measures them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, wait_until
from trainium_api import keys
from trainium_api import progress

pytestmark = pytest.mark.cluster
GROUP, VERSION, PLURAL = "trainium.dev", "v1alpha1", "trainingruns"
QUARANTINE = "trainium.dev/quarantined"


@pytest.fixture(scope="module")
def crd(local_cluster):
    res = local_cluster.kubectl("apply", "-f", str(ROOT / "crds" / "trainingruns.trainium.dev.yaml"))
    local_cluster.wait_established("trainingruns.trainium.dev")
    return res


# The stores this test operator lets runs name (and lists): the tests' and the examples', and one
# per namespace under a shared bucket, as a cluster shared by teams would configure it.
CHECKPOINT_STORES = [f"--checkpoint-prefix={p}" for p in (
    "/tmp/trainium-operator-tests", "s3://my-checkpoints", "/fsx", "/shared/runs", "s3://team-checkpoints/{namespace}")]

# A Neuron device shortfall settles this long before it is a failure (30 s by default: a device
# plugin's restart); short here so the device-loss case stays quick, and still seen to settle.
DEVICE_SETTLE = "--disruption-device-settle-seconds=3"


def start_operator(local_cluster, log_path: Path, *args: str, port_offset: int = 300) -> subprocess.Popen:
    """``python -m trainium_operator`` with its own metrics and liveness ports, plus ``args``."""
    from localcluster.cluster import free_base_port
    port = free_base_port(start=local_cluster.base_port + port_offset, span=2)
    env = dict(os.environ, KUBECONFIG=str(local_cluster.kubeconfig), PYTHONUNBUFFERED="1")
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "trainium_operator", "--metrics-port", str(port),
                             "--liveness-port", str(port + 1), *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.metrics_port = port  # type: ignore[attr-defined]
    return proc


@pytest.fixture(scope="module")
def operator(local_cluster, crd, core_api, tmp_path_factory):
    from localcluster.nodes import create_nodes
    create_nodes(core_api, 20, "trn1.32xlarge", "op-")
    log_path = tmp_path_factory.mktemp("operator") / "operator.log"
    proc = start_operator(local_cluster, log_path, DEVICE_SETTLE, *CHECKPOINT_STORES)
    holder = {"proc": proc, "log": log_path}
    yield holder
    holder["proc"].terminate()
    holder["proc"].wait(20)
    print("\n--- operator log (tail) ---\n" + log_path.read_text()[-3000:])


@pytest.fixture
def custom(local_cluster):
    from kubernetes import client
    return client.CustomObjectsApi(local_cluster.api_client())


@pytest.fixture(autouse=True)
def healthy_nodes(core_api):
    """Earlier tests quarantine and break nodes; start each test from a healthy fleet."""
    yield
    from localcluster import faults
    for n in core_api.list_node(label_selector="node.kubernetes.io/instance-type=trn1.32xlarge").items:
        release_quarantine(core_api, n)
        if any(c.type == "NeuronHealth" and c.status == "True" for c in n.status.conditions or []):
            faults.neuron_healthy(core_api, n.metadata.name)
        if any(c.type == faults.AGENT_CONDITION and c.status == "False" for c in n.status.conditions or []):
            faults.accelerated_hardware_ready(core_api, n.metadata.name)
        if (n.metadata.labels or {}).get(faults.NOT_READY_LABEL):
            faults.node_recover(core_api, n.metadata.name)
        cap, alloc = n.status.capacity or {}, n.status.allocatable or {}
        if alloc.get("aws.amazon.com/neuron") != cap.get("aws.amazon.com/neuron"):
            faults.device_restore(core_api, n.metadata.name)


def release_quarantine(core_api, node) -> None:
    """Undo the operator's quarantine of a node (a V1Node): drop the taint and the label."""
    taints = [t for t in node.spec.taints or [] if t.key != QUARANTINE]
    if len(taints) != len(node.spec.taints or []):
        core_api.patch_node(node.metadata.name, {"spec": {"taints": [core_api.api_client.sanitize_for_serialization(t)
                                                                     for t in taints]},
                                                 "metadata": {"labels": {QUARANTINE: None}}})


def manifest(name: str, nodes: int = 16, **ft) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingRun", "metadata": {"name": name},
            "spec": {"image": "trainer:test", "nodes": nodes, "instanceType": "trn1.32xlarge",
                     "model": {"preset": "llama2-7b"},
                     "parallelism": {"tensor": 8, "sequenceParallel": True, "zero1": True},
                     "training": {"seqLen": 4096, "globalBatchSize": 1024, "microBatchSize": 1},
                     "data": {"sources": [{"uri": "s3://corpus/train/"}], "tokenizer": "s3://corpus/tok.json"},
                     "checkpoint": {"uri": f"/tmp/trainium-operator-tests/{name}-{os.getpid()}", "intervalSteps": 10},
                     "faultTolerance": {"teardownGraceSeconds": 5, **ft}}}


def create(custom, ns, body) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)


def status(custom, ns, name) -> dict:
    return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name).get("status") or {}


def gang(core_api, ns, name, attempt=None) -> list:
    sel = f"trainium.dev/run={name}" + (f",trainium.dev/attempt={attempt}" if attempt else "")
    return [p for p in core_api.list_namespaced_pod(ns, label_selector=sel).items if not p.metadata.deletion_timestamp]


def wait_running_gang(core_api, custom, ns, name, attempt, nodes=16, timeout=60) -> float:
    def ok():
        pods = gang(core_api, ns, name, attempt)
        return len(pods) == nodes and all(p.status.phase == "Running" for p in pods)
    return wait_until(ok, timeout=timeout, what=f"attempt {attempt} running")[1]


def report(core_api, ns, name, attempt, step, ckpt=None, restored_from: str | None = None) -> None:
    """Progress annotations exactly as the trainer's local rank 0 writes them (with a held-out
    perplexity, as a run with data.heldOut reports; ``ckpt``: the newest complete checkpoint the
    pod sees in its store, which the operator never reads; ``restored_from``: the pods resumed
    from ``ckpt``, read from there: memory, peer or store)."""
    store = progress.StoreReport(progress.CheckpointSeen(f"step_{ckpt}", ckpt, time.time())) if ckpt else None
    resumed = {"start_step": ckpt, "restore_seconds": 0.5, "restore_source": restored_from} if restored_from else {}
    body = progress.ProgressReport(step=step, time=time.time(), tokens_per_second=24000.0 * 16, loss=2.0,
                                   last_checkpoint_step=ckpt, eval_perplexity=7.5,
                                   store=store or progress.StoreReport(), **resumed).to_annotation()
    for p in gang(core_api, ns, name, attempt):
        core_api.patch_namespaced_pod(p.metadata.name, ns, {"metadata": {"annotations": {keys.PROGRESS: body}}})


def start_and_run(core_api, custom, ns, name, nodes=16, **ft):
    create(custom, ns, manifest(name, nodes, **ft))
    wait_running_gang(core_api, custom, ns, name, 1, nodes)
    report(core_api, ns, name, 1, 5)
    wait_until(lambda: status(custom, ns, name).get("phase") == "Running", what="phase Running")


def fail_and_measure(core_api, custom, ns, name, inject, cause, nodes=16):
    """Inject, then time detection (status records the failure) and recovery (next gang Running)."""
    inject()
    rec, detect = wait_until(lambda: next((f for f in status(custom, ns, name).get("failures") or []
                                           if f["attempt"] == 1), None), timeout=60, what="failure detected")
    assert rec["cause"] == cause, rec
    recover = wait_running_gang(core_api, custom, ns, name, 2, nodes)
    print(f"\n{cause}: detected {detect:.2f}s after injection (operator: {rec.get('detectedAfter')}s after the "
          f"signal); new gang Running {recover:.2f}s after detection")
    return rec, detect, recover


# --------------------------------------------------------------------------------------------


def test_examples_apply_and_llama2_7b_recipe_is_accepted(local_cluster, operator, custom, namespace):
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        if "kind: TrainingRun" not in path.read_text():
            continue
        res = local_cluster.kubectl("apply", "-n", namespace, "-f", str(path), check=False)
        assert res.returncode == 0, f"{path.name}: {res.stderr}"
    st, _ = wait_until(lambda: status(custom, namespace, "llama2-7b").get("dataParallel") and
                       status(custom, namespace, "llama2-7b"), what="llama2-7b status")
    assert st["dataParallel"] == 512 and st["worldSize"] == 4096
    assert next(c for c in st["conditions"] if c["type"] == "Valid")["status"] == "True"
    trn2, _ = wait_until(lambda: status(custom, namespace, "llama3-8b-trn2").get("dataParallel") and
                         status(custom, namespace, "llama3-8b-trn2"), what="llama3-8b-trn2 status")
    assert (trn2["worldSize"], trn2["dataParallel"]) == (1024, 256)  # 16 trn2 nodes x 64 ranks, TP 4
    out = local_cluster.kubectl("get", "trun", "-n", namespace).stdout
    print("\n" + out)
    assert "llama2-7b" in out and "512" in out
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        if "kind: TrainingRun" in path.read_text():
            local_cluster.kubectl("delete", "-n", namespace, "-f", str(path), "--wait=false", check=False)


API_REJECTS = [  # (what, patch to the valid manifest's spec, words in the API server's error)
    ("no image", {"image": None}, "image"),
    ("zero nodes", {"nodes": 0}, "nodes"),
    ("bad instance type", {"instanceType": "p5.48xlarge"}, "instanceType"),
    ("unknown preset", {"model": {"preset": "gpt-5"}}, "model.preset"),
    ("bad precision", {"training": {"precision": "fp8"}}, "training.precision"),
    ("batch not a multiple of micro batch", {"training": {"globalBatchSize": 10, "microBatchSize": 4}},
     "globalBatchSize must be a multiple"),
    ("minLr above lr", {"training": {"lr": 1e-4, "minLr": 1e-3}}, "minLr must not exceed"),
    ("tensor not dividing heads", {"model": {"preset": "llama2-7b", "numHeads": 12}, "parallelism": {"tensor": 8}},
     "parallelism.tensor must divide"),
    ("no checkpoint uri", {"checkpoint": {"uri": ""}}, "checkpoint.uri is required"),
    ("no data sources", {"data": {"sources": [], "tokenizer": "t.json"}}, "data.sources"),

    ("unknown field", {"training": {"stepz": 5}}, "stepz"),
    ("a command trainer without its command", {"trainer": {"kind": "command", "progressFormat": "nxd"}},
     "trainer.command is required"),
    ("a command trainer without a progress format", {"trainer": {"kind": "command", "command": ["train.py"]}},
     "trainer.progressFormat is required"),
    ("an unknown progress format", {"trainer": {"kind": "command", "command": ["train.py"], "progressFormat": "tqdm"}},
     "trainer.progressFormat"),
]
# A whole number a client writes as a JSON float (Python's 8.0) passes the API server's integer
# schema, but no CEL rule can read it: each integer field's own rule refuses it naming the field
# (kubectl writes 10.0 as 10, so these go through the Python client). Ints in number fields are
# compared with the rules' floats.
NUMBER_KINDS_REJECTS = [  # (patch, the field a refusal names, words in its message)
    ({"training": {"globalBatchSize": 10.0, "microBatchSize": 4}}, "spec.training.globalBatchSize",
     "must be written as an integer"),
    ({"model": {"preset": "llama2-7b", "numHeads": 32.0}, "parallelism": {"tensor": 8}}, "spec.model.numHeads",
     "must be written as an integer"),
    ({"nodes": 16.0}, "spec.nodes", "must be written as an integer"),
    ({"training": {"lr": 1, "minLr": 2.5}}, "spec.training.minLr", "minLr must not exceed"),
    ({"training": {"lr": 0.5, "minLr": 1}}, "spec.training.minLr", "minLr must not exceed"),
]
NUMBER_KINDS_ACCEPTED = [{"training": {"lr": 1, "minLr": 0.5}}]
OPERATOR_REJECTS = [  # valid for the schema, but not for the layout or the operator's own checks
    ("tensor x pipeline does not divide the world", {"nodes": 1, "instanceType": "cpu", "processesPerNode": 1,
                                                     "model": {"preset": "tiny"},
                                                     "training": {"globalBatchSize": 16, "microBatchSize": 4,
                                                                  "seqLen": 128},
                                                     "parallelism": {"tensor": 2}}, "spec.parallelism.tensor"),
    ("global batch not divisible by dp x micro", {"nodes": 3, "training": {"globalBatchSize": 1024,
                                                                           "microBatchSize": 1}},
     "spec.training.globalBatchSize"),
    ("sequence not divisible with SP", {"training": {"seqLen": 4100}}, "spec.training.seqLen"),
    ("bad hang timeout", {"faultTolerance": {"hangTimeoutSeconds": "soon"}}, "spec.faultTolerance.hangTimeoutSeconds"),
    # one held-out source or a list of them: a structural schema cannot say that, the operator does
    ("held-out data that is no URI", {"data": {"heldOut": 5}}, "spec.data.heldOut"),
    ("a held-out item without a uri", {"data": {"heldOut": [{"weight": 2}]}}, "spec.data.heldOut[0].uri"),
    ("too few micro-batches for a 4-stage 1F1B", {"parallelism": {"pipeline": 4}, "training": {"globalBatchSize": 32}},
     "spec.training.globalBatchSize"),
    ("pipeline stages that do not divide the layers", {"parallelism": {"pipeline": 4}, "model": {"numLayers": 30}},
     "spec.parallelism.pipeline"),
    ("more processes than NeuronCores", {"processesPerNode": 64}, "spec.processesPerNode"),
    ("a backend the instance type cannot run", {"backend": "cuda"}, "spec.backend"),
    ("a progress regex that does not compile", {"trainer": {"kind": "command", "command": ["train.py"],
                                                            "progressFormat": "regex", "progressRegex": "(?P<step>\\d+",
                                                            "checkpointLayout": "nxd"}},
     "spec.trainer.progressRegex"),
    ("a progress regex without a step group", {"trainer": {"kind": "command", "command": ["train.py"],
                                                           "progressFormat": "regex", "progressRegex": "iter (\\d+)",
                                                           "checkpointLayout": "nxd"}},
     "spec.trainer.progressRegex"),
    # host access is the operator's (the test operator allows no hostPath prefix, the default)
    ("a hostPath volume at the node's root", {"volumes": [{"name": "root", "hostPath": {"path": "/"}}],
                                              "volumeMounts": [{"name": "root", "mountPath": "/host",
                                                                "readOnly": True}]},
     "spec.volumes[0].hostPath.path"),
    ("a hostPath volume that climbs out", {"volumes": [{"name": "kubelet",
                                                        "hostPath": {"path": "/var/tmp/../../var/lib/kubelet"}}]},
     "spec.volumes[0].hostPath.path"),
    # checkpoint stores are the operator's too (CHECKPOINT_STORES): another team's prefix, the
    # operator's own file system, a climb out of the namespace's prefix
    ("another namespace's checkpoint store", {"checkpoint": {"uri": "s3://team-checkpoints/another-team/r"}},
     "spec.checkpoint.uri"),
    ("the operator's own file system", {"checkpoint": {"uri": "/var/run/secrets/kubernetes.io"}}, "spec.checkpoint.uri"),
    ("the instance metadata endpoint as a store", {"checkpoint": {"uri": "http://169.254.169.254/latest/"}},
     "spec.checkpoint.uri"),
    ("a volume source reaching storage the namespace does not own",
     {"volumes": [{"name": "n", "nfs": {"server": "10.0.0.1", "path": "/"}}]}, "spec.volumes[0].nfs"),
    ("another run's trainer identity", {"serviceAccountName": "trainium-trainer-someone-else"},
     "spec.serviceAccountName"),
]


def _merge(base: dict, patch: dict) -> dict:
    out = dict(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def test_invalid_specs_are_refused_naming_the_field(local_cluster, operator, custom, namespace, tmp_path):
    refused = 0
    for i, (what, patch, words) in enumerate(API_REJECTS):
        body = manifest(f"bad-api-{i}")
        body["spec"] = _merge(body["spec"], patch)
        f = tmp_path / f"bad{i}.yaml"
        f.write_text(yaml.safe_dump(body))
        res = local_cluster.kubectl("apply", "-n", namespace, "-f", str(f), check=False)
        assert res.returncode != 0 and words in res.stderr, f"{what}: {res.stderr}"
        refused += 1
    from kubernetes.client.exceptions import ApiException
    for i, (patch, field, words) in enumerate(NUMBER_KINDS_REJECTS):
        body = manifest(f"bad-number-{i}")
        body["spec"] = _merge(body["spec"], patch)
        with pytest.raises(ApiException) as refusal:
            create(custom, namespace, body)
        causes = json.loads(refusal.value.body)["details"]["causes"]
        assert any(c["field"] == field and words in c["message"] for c in causes), (patch, causes)
        refused += 1
    for i, spec in enumerate(NUMBER_KINDS_ACCEPTED):  # ... and a valid one written so is taken
        body = manifest(f"number-kinds-{i}")
        body["spec"] = _merge(body["spec"], spec)
        create(custom, namespace, body)
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, f"number-kinds-{i}")
        refused += 1
    for bad_name in ("run.v2", "r" * 57):  # valid object names, but no Service or host name
        body = manifest(bad_name)
        f = tmp_path / "bad-name.yaml"
        f.write_text(yaml.safe_dump(body))
        res = local_cluster.kubectl("apply", "-n", namespace, "-f", str(f), check=False)
        assert res.returncode != 0 and "metadata.name must be a DNS-1035 label" in res.stderr, res.stderr
        refused += 1
    for i, (what, patch, field) in enumerate(OPERATOR_REJECTS):
        body = manifest(f"bad-op-{i}")
        body["spec"] = _merge(body["spec"], patch)
        create(custom, namespace, body)
        st, _ = wait_until(lambda: status(custom, namespace, f"bad-op-{i}").get("conditions"), what=what)
        valid = next(c for c in st if c["type"] == "Valid")
        assert valid["status"] == "False" and valid["message"].startswith(field + ":"), (what, valid)
        assert status(custom, namespace, f"bad-op-{i}")["phase"] == "Failed"
        refused += 1
    print(f"\n{refused} invalid specs refused ({len(API_REJECTS) + len(NUMBER_KINDS_REJECTS) + 2} by the API server, "
          f"{len(OPERATOR_REJECTS)} by the operator)")
    assert operator["proc"].poll() is None, "the operator must survive malformed objects"
    # ... and still runs a good one, with its checkpoints in its namespace's store
    good = manifest("good", nodes=2)
    good["spec"]["checkpoint"]["uri"] = f"s3://team-checkpoints/{namespace}/good"
    create(custom, namespace, good)
    wait_until(lambda: status(custom, namespace, "good").get("phase") == "Starting", what="good run starting")


def test_rank_crash_restarts_the_gang(core_api, custom, namespace, operator):
    from localcluster import faults
    start_and_run(core_api, custom, namespace, "crash")
    victim = gang(core_api, namespace, "crash", 1)[3].metadata.name
    rec, detect, recover = fail_and_measure(core_api, custom, namespace, "crash",
                                            lambda: faults.pod_fail(core_api, namespace, victim, 1), "application")
    assert detect < 10 and recover < 30
    st = status(custom, namespace, "crash")
    assert st["attempt"] == 2 and st["restarts"] == {"application": 1} and not st.get("quarantinedNodes")
    report(core_api, namespace, "crash", 2, 7)
    wait_until(lambda: status(custom, namespace, "crash").get("phase") == "Running", what="Running again")


@pytest.mark.parametrize("fault, cause", [("not-ready", "node"), ("neuron-error", "neuron-device"),
                                          ("accelerated-hardware", "neuron-device"),
                                          ("device-loss", "neuron-device"), ("delete-node", "node"),
                                          ("unreachable", "node")])
def test_node_faults_quarantine_the_node_and_restart_elsewhere(core_api, custom, namespace, operator, fault, cause):
    from localcluster import faults
    name = f"nf-{fault}"
    start_and_run(core_api, custom, namespace, name)
    bad = gang(core_api, namespace, name, 1)[5].spec.node_name
    inject = {"not-ready": lambda: faults.node_not_ready(core_api, bad),
              "neuron-error": lambda: faults.neuron_error(core_api, bad, "NeuronHasError_DMA_ERROR"),
              "accelerated-hardware": lambda: faults.accelerated_hardware(core_api, bad, "NeuronDMAError"),
              "device-loss": lambda: faults.device_loss(core_api, bad, 14),
              "delete-node": lambda: faults.delete_node(core_api, bad),
              "unreachable": lambda: faults.node_unreachable(core_api, bad)}[fault]
    rec, detect, recover = fail_and_measure(core_api, custom, namespace, name, inject, cause)
    assert rec["node"] == bad and recover < 30
    assert detect < (90 if fault == "unreachable" else 15)  # unreachable: the node grace period first
    if fault == "device-loss":  # not acted on before it settled (a device plugin's restart)
        assert rec["detectedAfter"] >= 3, rec
    if fault == "delete-node":
        from localcluster.nodes import INSTANCE_TYPES, node_manifest
        core_api.create_node(node_manifest(bad, INSTANCE_TYPES["trn1.32xlarge"]))  # give the fleet its node back
        return
    if fault == "unreachable":
        faults.node_recover(core_api, bad)
    node = core_api.read_node(bad)
    assert any(t.key == QUARANTINE and t.effect == "NoSchedule" for t in node.spec.taints)
    assert node.metadata.labels.get(QUARANTINE)
    assert status(custom, namespace, name)["quarantinedNodes"] == [bad]
    assert bad not in {p.spec.node_name for p in gang(core_api, namespace, name, 2)}


def test_fatal_exit_code_fails_without_retry(core_api, custom, namespace, operator):
    from localcluster import faults
    start_and_run(core_api, custom, namespace, "fatal", nodes=2)
    faults.pod_fail(core_api, namespace, gang(core_api, namespace, "fatal", 1)[0].metadata.name, 78)
    st, _ = wait_until(lambda: (s := status(custom, namespace, "fatal")).get("phase") == "Failed" and s,
                       what="Failed")
    assert "fatal" in st["message"] and st.get("attempt") == 1 and not st.get("restarts")
    wait_until(lambda: not gang(core_api, namespace, "fatal"), what="pods cleaned up")


def test_hang_is_detected_and_restarted(core_api, custom, namespace, operator):
    start_and_run(core_api, custom, namespace, "hang", nodes=2, hangTimeoutSeconds=3)
    rec, detect, _ = fail_and_measure(core_api, custom, namespace, "hang", lambda: None, "hang", nodes=2)
    assert "no step progress" in rec["message"]


def test_eviction_restarts(core_api, custom, namespace, operator):
    """The run's disruption budget refuses an eviction (doNotDisrupt, the default: a drain waits
    for the operator to move the gang, tests/cluster/test_disruptions.py); without it the
    eviction goes through and the gang restarts, spending no budget (a voluntary disruption)."""
    from kubernetes.client.exceptions import ApiException

    from localcluster import faults
    start_and_run(core_api, custom, namespace, "held", nodes=2)
    wait_until(lambda: any(p.metadata.name == "held" for p in client_policy(core_api).list_namespaced_pod_disruption_budget(
        namespace).items), what="the run's disruption budget")
    victim = gang(core_api, namespace, "held", 1)[1].metadata.name
    refused = None
    for _ in range(50):  # until the disruption controller has counted the gang
        try:
            faults.evict_pod(core_api, namespace, victim)
        except ApiException as exc:
            refused = exc
            if exc.status == 429:
                break
        time.sleep(0.2)
    assert refused is not None and refused.status == 429, refused
    start_and_run(core_api, custom, namespace, "evict", nodes=2, doNotDisrupt=False)
    victim = gang(core_api, namespace, "evict", 1)[1].metadata.name
    rec, _, _ = fail_and_measure(core_api, custom, namespace, "evict",
                                 lambda: faults.evict_pod(core_api, namespace, victim), "eviction", nodes=2)
    assert rec["exempt"] == "voluntary", rec


def client_policy(core_api):
    from kubernetes import client
    return client.PolicyV1Api(core_api.api_client)


def test_restart_budget_exhaustion_fails_with_reason(core_api, custom, namespace, operator):
    from localcluster import faults
    start_and_run(core_api, custom, namespace, "budget", nodes=2, restartBudget={"application": 1})
    faults.pod_fail(core_api, namespace, gang(core_api, namespace, "budget", 1)[0].metadata.name, 1)
    wait_running_gang(core_api, custom, namespace, "budget", 2, nodes=2)
    faults.pod_fail(core_api, namespace, gang(core_api, namespace, "budget", 2)[0].metadata.name, 1)
    st, _ = wait_until(lambda: (s := status(custom, namespace, "budget")).get("phase") == "Failed" and s,
                       what="Failed")
    assert "restart budget for application exhausted" in st["message"] and st["attempt"] == 2
    time.sleep(2)
    assert status(custom, namespace, "budget")["attempt"] == 2  # no loop


def test_no_progress_guard_fails_with_reason(core_api, custom, namespace, operator):
    from localcluster import faults
    start_and_run(core_api, custom, namespace, "stuck", nodes=2, noProgressRestarts=2)
    for attempt in (1, 2):
        wait_running_gang(core_api, custom, namespace, "stuck", attempt, nodes=2)
        faults.pod_fail(core_api, namespace, gang(core_api, namespace, "stuck", attempt)[0].metadata.name, 1)
        if attempt == 1:
            wait_until(lambda: status(custom, namespace, "stuck").get("attempt") == 2, what="attempt 2")
    wait_running_gang(core_api, custom, namespace, "stuck", 3, nodes=2)
    faults.pod_fail(core_api, namespace, gang(core_api, namespace, "stuck", 3)[0].metadata.name, 1)
    st, _ = wait_until(lambda: (s := status(custom, namespace, "stuck")).get("phase") == "Failed" and s,
                       what="Failed")
    assert st["message"].startswith("no progress: 2 restarts without the checkpoint step advancing")


def test_operator_killed_mid_restart_ends_with_one_gang(local_cluster, core_api, custom, namespace, operator):
    from localcluster import faults
    start_and_run(core_api, custom, namespace, "kill", nodes=4, backoffSeconds=4)
    faults.pod_fail(core_api, namespace, gang(core_api, namespace, "kill", 1)[0].metadata.name, 1)
    wait_until(lambda: status(custom, namespace, "kill").get("phase") == "Restarting", what="Restarting")
    operator["proc"].send_signal(signal.SIGKILL)  # in the middle of the restart (teardown + backoff)
    operator["proc"].wait(10)
    operator["proc"] = start_operator(local_cluster, operator["log"], DEVICE_SETTLE)
    wait_running_gang(core_api, custom, namespace, "kill", 2, nodes=4)
    time.sleep(3)  # let any duplicate creation show up
    pods = core_api.list_namespaced_pod(namespace, label_selector="trainium.dev/run=kill").items
    assert sorted(p.metadata.name for p in pods) == [f"kill-a2-{i}" for i in range(4)]
    assert status(custom, namespace, "kill")["attempt"] == 2


def test_suspend_resume_and_delete_cleans_up(core_api, custom, namespace, operator):
    start_and_run(core_api, custom, namespace, "pause", nodes=2)
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "pause", {"spec": {"suspend": True}})
    wait_until(lambda: status(custom, namespace, "pause").get("phase") == "Suspended"
               and not gang(core_api, namespace, "pause"), what="suspended, no pods")
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "pause", {"spec": {"suspend": False}})
    wait_running_gang(core_api, custom, namespace, "pause", 2, nodes=2)
    assert not status(custom, namespace, "pause").get("restarts")  # suspending is not a failure
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "pause")
    wait_until(lambda: not core_api.list_namespaced_pod(namespace, label_selector="trainium.dev/run=pause").items
               and not core_api.list_namespaced_config_map(namespace, label_selector="trainium.dev/run=pause").items,
               what="children garbage-collected")


def test_metrics_endpoint(operator):
    import urllib.request
    body = urllib.request.urlopen(f"http://127.0.0.1:{operator['proc'].metrics_port}/metrics", timeout=5).read().decode()
    for series in ("trainium_run_phase", "trainium_reconcile_seconds", "trainium_run_effective_training_ratio"):
        assert series in body
    assert "\ntrainium_operator_api_unreachable 0.0\n" in body  # its probe reaches the local API server


def passes(operator, namespace: str, run: str) -> float:
    """The operator's trainium_reconcile_passes_total for the run (0 before its first pass)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    body = urllib.request.urlopen(f"http://127.0.0.1:{operator['proc'].metrics_port}/metrics", timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples
               if s.name == "trainium_reconcile_passes_total" and s.labels == {"namespace": namespace, "run": run})


def test_a_finished_run_passes_only_when_something_changes(core_api, custom, namespace, operator):
    """Issue 48: a finished run costs nothing. Once its pods are done and its status written, its
    loop has no tick: the pass count stands still; an edit of the run passes it again, once."""
    from localcluster import faults
    start_and_run(core_api, custom, namespace, "ends", nodes=2)
    assert passes(operator, namespace, "ends") >= 1
    for p in gang(core_api, namespace, "ends", 1):
        faults.pod_succeed(core_api, namespace, p.metadata.name)
    wait_until(lambda: status(custom, namespace, "ends").get("phase") == "Succeeded", what="Succeeded")
    time.sleep(2)  # its last writes observed, the loop settled
    settled = passes(operator, namespace, "ends")
    time.sleep(4)
    assert passes(operator, namespace, "ends") == settled, "a finished run kept passing every second"
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "ends",
                                          {"metadata": {"annotations": {"example.com/note": "looked at"}}})
    wait_until(lambda: passes(operator, namespace, "ends") > settled, timeout=10, what="a pass after the edit")
    time.sleep(3)
    assert passes(operator, namespace, "ends") <= settled + 2, "it went back to a tick"


def test_quarantine_keeps_a_taint_another_controller_adds_between_read_and_write(local_cluster, core_api):
    """Against the real API server: another controller (here the test, in the node lifecycle
    controller's place) taints the node after the operator read it and before it writes. The
    operator's write carries the resourceVersion it read, gets 409, reads again, and both taints
    are on the node. Only the interleaving is the test's; the API calls are real."""
    from localcluster.nodes import create_nodes
    from trainium_operator.kube import Kube

    node = create_nodes(core_api, 1, "trn1.32xlarge", "qrace-")[0]
    kube = Kube(local_cluster.api_client())
    real_read, reads = kube.core.read_node, []

    def read_then_someone_writes(name, **kwargs):
        current = real_read(name, **kwargs)
        reads.append(current.metadata.resource_version)
        if len(reads) == 1:
            other = [core_api.api_client.sanitize_for_serialization(t) for t in current.spec.taints or []]
            core_api.patch_node(name, {"spec": {"taints": [*other, {"key": "example.com/other-controller",
                                                                     "effect": "NoSchedule"}]}})
        return current

    kube.core.read_node = read_then_someone_writes
    try:
        kube.quarantine(node, "race-run", "crash")
        taints = {t.key for t in core_api.read_node(node).spec.taints or []}
        print(f"\nreads: {len(reads)}; taints now: {sorted(taints)}")
        assert {"example.com/other-controller", QUARANTINE} <= taints
        assert len(reads) == 2  # the first write was refused with 409 and retried
    finally:
        core_api.delete_node(node)


def test_a_quarantine_lands_only_on_the_node_object_it_was_decided_for(local_cluster, core_api):
    """Against the real API server: a node deleted and registered again under its name is
    another Node object (another uid), perhaps another machine (EKS names nodes by private IP).
    A quarantine decided for the first object leaves the second alone; one for the second
    taints it."""
    from localcluster.nodes import create_nodes
    from trainium_operator.kube import Kube

    node = create_nodes(core_api, 1, "trn1.32xlarge", "quid-")[0]
    kube = Kube(local_cluster.api_client())
    first = core_api.read_node(node).metadata.uid
    try:
        body = core_api.api_client.sanitize_for_serialization(core_api.read_node(node))
        core_api.delete_node(node)
        wait_until(lambda: node not in {n.metadata.name for n in core_api.list_node().items}, what="node deleted")
        body["metadata"] = {k: v for k, v in body["metadata"].items() if k in ("name", "labels", "annotations")}
        core_api.create_node(body)
        second = core_api.read_node(node).metadata.uid
        assert second != first
        kube.quarantine(node, "uid-run", "crash", uid=first)
        assert QUARANTINE not in {t.key for t in core_api.read_node(node).spec.taints or []}
        kube.quarantine(node, "uid-run", "crash", uid=second)
        assert QUARANTINE in {t.key for t in core_api.read_node(node).spec.taints or []}
    finally:
        core_api.delete_node(node)


def test_a_child_the_api_server_refuses_is_in_status_and_made_once_allowed(core_api, custom, namespace, operator):
    """A ResourceQuota of zero Services makes the real API server refuse the run's headless
    Service (403). The run must say so in its status, create no pod without it, and start once
    the quota is lifted: the children are ensured by every pass, not only the first."""
    core_api.create_namespaced_resource_quota(namespace, {"metadata": {"name": "no-services"},
                                                          "spec": {"hard": {"services": "0"}}})
    wait_until(lambda: core_api.read_namespaced_resource_quota("no-services", namespace).status.hard,
               what="the quota in force")
    create(custom, namespace, manifest("quota", nodes=2))

    def refused():
        cond = next((c for c in status(custom, namespace, "quota").get("conditions") or []
                     if c["type"] == "ChildrenCreated"), None)
        return cond if cond and cond["status"] == "False" else None
    cond, took = wait_until(refused, timeout=30, what="ChildrenCreated=False")
    print(f"\nrefused child in status after {took:.1f}s: {cond['message']}")
    assert "Service quota" in cond["message"] and "exceeded quota" in cond["message"]
    assert not gang(core_api, namespace, "quota")  # no pod without its Service
    assert core_api.list_namespaced_config_map(namespace, label_selector="trainium.dev/run=quota").items
    core_api.delete_namespaced_resource_quota("no-services", namespace)
    wait_running_gang(core_api, custom, namespace, "quota", 1, nodes=2)
    core_api.read_namespaced_service("quota", namespace)
    wait_until(lambda: next(c for c in status(custom, namespace, "quota")["conditions"]
                            if c["type"] == "ChildrenCreated")["status"] == "True", what="ChildrenCreated=True")


def test_a_run_created_suspended_starts_fully_when_resumed(core_api, custom, namespace, operator):
    body = manifest("later", nodes=2)
    body["spec"]["suspend"] = True
    create(custom, namespace, body)
    wait_until(lambda: status(custom, namespace, "later").get("phase") == "Suspended", what="phase Suspended")
    assert not gang(core_api, namespace, "later") and not status(custom, namespace, "later").get("createdTime")
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "later", {"spec": {"suspend": False}})
    wait_running_gang(core_api, custom, namespace, "later", 1, nodes=2)
    core_api.read_namespaced_service("later", namespace)
    core_api.read_namespaced_config_map("later-config", namespace)
    core_api.read_namespaced_service_account("trainium-trainer-later", namespace)
    assert status(custom, namespace, "later")["attempt"] == 1


def test_a_status_write_computed_from_an_old_version_is_refused(local_cluster, custom, namespace, operator):
    """The fence the reconcile pass relies on, against the real API server: a status merge patch
    that carries the resourceVersion it was computed from is applied to that version only."""
    from kubernetes.client.exceptions import ApiException

    from trainium_operator.applier import conflict
    from trainium_operator.kube import Kube
    body = manifest("fenced", nodes=2)
    body["spec"]["suspend"] = True
    create(custom, namespace, body)
    wait_until(lambda: status(custom, namespace, "fenced").get("phase") == "Suspended", what="phase Suspended")
    time.sleep(1)  # the operator has written what it writes for a suspended run; it stays quiet now
    read = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fenced")
    kube = Kube(local_cluster.api_client())
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fenced",
                                          {"metadata": {"labels": {"edited": "yes"}}})  # someone writes
    with pytest.raises(ApiException) as err:
        kube.patch_status(namespace, "fenced", {"message": "decided on the old version"},
                          read["metadata"]["resourceVersion"])
    assert conflict(err.value)
    now = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fenced")
    kube.patch_status(namespace, "fenced", {"message": "decided on the current one"}, now["metadata"]["resourceVersion"])
    assert status(custom, namespace, "fenced")["message"] == "decided on the current one"


def test_edits_of_a_live_run(local_cluster, core_api, custom, namespace, operator):
    """The API server refuses an edit of a field a running gang cannot follow, naming it; an
    edit it allows but the operator refuses shows as Valid=False, and the run is still
    supervised with the spec in force (a crashed rank is restarted)."""
    from localcluster import faults
    start_and_run(core_api, custom, namespace, "edited", nodes=2)
    res = local_cluster.kubectl("patch", "trainingrun", "edited", "-n", namespace, "--type=merge",
                                "-p", '{"spec":{"nodes":3}}', check=False)
    assert res.returncode != 0 and "spec.nodes" in res.stderr and "is immutable while the run exists" in res.stderr
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "edited",
                                          {"spec": {"faultTolerance": {"hangTimeoutSeconds": "soon"}}})

    def refused():
        valid = next(c for c in status(custom, namespace, "edited")["conditions"] if c["type"] == "Valid")
        return valid if valid["status"] == "False" else None
    valid, _ = wait_until(refused, what="Valid=False")
    assert valid["message"].startswith("spec.faultTolerance.hangTimeoutSeconds")
    victim = gang(core_api, namespace, "edited", 1)[1].metadata.name
    fail_and_measure(core_api, custom, namespace, "edited", lambda: faults.pod_fail(core_api, namespace, victim, 1),
                     "application", nodes=2)


def test_a_stale_ensure_never_moves_the_trainer_role_back_to_an_older_attempt(local_cluster, core_api, namespace):
    """CI saw a restarted operator's background re-check of the children, begun with attempt
    1's Role before the pass that started attempt 2, write attempt 1's pods back over attempt 2's
    Role: the new gang's trainers were refused their own pods (403) until the run ended, so
    the operator saw none of attempt 2's progress. Against the real API server: the newer
    attempt's Role stays."""
    from kubernetes import client

    from trainium_operator import plan
    from trainium_operator.kube import Kube
    from trainium_operator.spec import parse
    from tests.unit.test_operator_core import SPEC
    kube = Kube(local_cluster.api_client())
    rbac = client.RbacAuthorizationV1Api(local_cluster.api_client())
    owner = core_api.create_namespaced_config_map(namespace, {"metadata": {"name": "role-owner"}}).metadata
    run = {"apiVersion": "v1", "metadata": {"name": "r", "namespace": namespace, "uid": owner.uid}}
    spec = parse(SPEC)

    def role(attempt: int) -> dict:
        obj = plan.trainer_role(run, spec, attempt)
        obj["metadata"]["namespace"] = namespace
        obj["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "role-owner",
                                               "uid": owner.uid, "controller": True}]
        return obj

    def names() -> set:
        return {n for r in rbac.read_namespaced_role(role(1)["metadata"]["name"], namespace).rules or []
                if r.resources == ["pods"] for n in r.resource_names or []}
    older = role(2)  # an earlier operator's Role: no attempt label; it is given one
    older["metadata"]["labels"] = {k: v for k, v in older["metadata"]["labels"].items() if k != keys.ATTEMPT}
    kube.ensure(older)
    kube.ensure(role(2))
    assert rbac.read_namespaced_role(older["metadata"]["name"], namespace).metadata.labels[keys.ATTEMPT] == "2"
    assert names() == {plan.pod_name("r", 2, i) for i in range(spec.nodes)}
    kube.ensure(role(1))  # the stale re-check
    assert names() == {plan.pod_name("r", 2, i) for i in range(spec.nodes)}
    kube.ensure(role(3))  # and forward still moves it
    assert names() == {plan.pod_name("r", 3, i) for i in range(spec.nodes)}


def test_a_child_of_an_earlier_run_of_the_same_name_is_not_taken_for_ours(local_cluster, core_api, namespace):
    """A run deleted and created again under its name: the garbage collector may not have
    deleted the old run's ConfigMap yet. Against the real API server, the operator's ensure
    sees the name taken by another owner and says so (the pass waits) instead of counting the
    old config as the new run's; a ConfigMap of its own is left as it is."""
    from trainium_operator.kube import Kube, NotOurs
    kube = Kube(local_cluster.api_client())
    owners = [core_api.create_namespaced_config_map(namespace, {"metadata": {"name": f"owner-{i}"}}).metadata.uid
              for i in range(2)]

    def config(i: int, text: str) -> dict:  # the garbage collector checks an owner by name and uid
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
            "name": "same-config", "namespace": namespace,
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": f"owner-{i}", "uid": owners[i],
                                 "controller": True}]}, "data": {"run.yaml": text}}

    kube.ensure(config(0, "old: 1"))
    with pytest.raises(NotOurs, match="belongs to another object"):
        kube.ensure(config(1, "new: 2"))
    assert core_api.read_namespaced_config_map("same-config", namespace).data == {"run.yaml": "old: 1"}
    kube.ensure(config(0, "edited: 3"))  # ours: not rewritten (a live run's next restart reads it)
    assert core_api.read_namespaced_config_map("same-config", namespace).data == {"run.yaml": "old: 1"}


@pytest.mark.filterwarnings("ignore:Unverified HTTPS request")  # the tokens' client, as every client here
def test_a_trainer_token_reaches_only_its_runs_current_pods(local_cluster, core_api, custom, namespace, operator):
    """Each run's trainer identity (the operator running, real bound tokens): the run's own
    ServiceAccount, or one the spec names, is bound to a Role that allows get+patch of the pods
    of the run's current attempt only, rewritten when an attempt starts. The named account is
    not matched by the admission policy, so what it is refused here RBAC alone refuses."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from localcluster import faults
    from tests.cluster.test_trainer_policy import _client_for
    from trainium_api.spec import trainer_identity
    rbac = client.RbacAuthorizationV1Api(local_cluster.api_client())
    core_api.create_namespaced_service_account(namespace, {"metadata": {"name": "team-sa"}})
    start_and_run(core_api, custom, namespace, "own", nodes=2)
    body = manifest("named", nodes=2)
    body["spec"]["serviceAccountName"] = "team-sa"
    create(custom, namespace, body)
    wait_running_gang(core_api, custom, namespace, "named", 1, nodes=2)

    def allowed(run: str) -> set:
        rules = rbac.read_namespaced_role(trainer_identity(run), namespace).rules or []
        return {n for r in rules if r.resources == ["pods"] for n in r.resource_names or []}  # (and its gang order)
    own, named = gang(core_api, namespace, "own", 1), gang(core_api, namespace, "named", 1)
    assert {p.spec.service_account_name for p in own} == {trainer_identity("own")}
    assert {p.spec.service_account_name for p in named} == {"team-sa"}
    assert rbac.read_namespaced_role_binding(trainer_identity("named"), namespace).subjects[0].name == "team-sa"
    with pytest.raises(ApiException):  # a named account is the user's: the operator makes none
        core_api.read_namespaced_service_account(trainer_identity("named"), namespace)
    wait_until(lambda: allowed("named") == {p.metadata.name for p in named}, what="the Role names attempt 1's pods")
    # the RoleBinding is made after its Role (before it exists the API server refuses the binding)
    refused = [e.message for e in core_api.list_namespaced_event(namespace).items if e.reason == "CreateFailed"]
    assert not refused, refused

    def token(account: str, pod) -> client.CoreV1Api:
        return _client_for(local_cluster, core_api.create_namespaced_service_account_token(account, namespace, {
            "spec": {"expirationSeconds": 600, "boundObjectRef": {
                "kind": "Pod", "apiVersion": "v1", "name": pod.metadata.name, "uid": pod.metadata.uid}}}).status.token)

    def patch(api, pod_name: str):
        try:
            api.patch_namespaced_pod(pod_name, namespace, {"metadata": {"annotations": {keys.PROGRESS: "{}"}}})
        except ApiException as exc:
            return exc.status
        return 200
    named_token, own_token = token("team-sa", named[0]), token(trainer_identity("own"), own[0])
    assert patch(named_token, named[0].metadata.name) == 200  # its own pod: allowed
    assert patch(named_token, own[0].metadata.name) == 403  # another run's pod: RBAC refuses
    assert patch(own_token, own[0].metadata.name) == 200
    assert patch(own_token, named[0].metadata.name) == 403
    # a new attempt: the Role follows it, and names no pod of the old one
    faults.pod_fail(core_api, namespace, named[1].metadata.name, 1)
    wait_running_gang(core_api, custom, namespace, "named", 2, nodes=2)
    second = {p.metadata.name for p in gang(core_api, namespace, "named", 2)}
    wait_until(lambda: allowed("named") == second, what="the Role names attempt 2's pods")
    print(f"\ntrainer Roles: own {sorted(allowed('own'))}, named (team-sa) {sorted(allowed('named'))}")


@pytest.mark.parametrize("itype, key", [("trn2.48xlarge", "topology.k8s.aws/network-node-layer-3"),
                                        ("trn2u.48xlarge", "neuron.amazonaws.com/ultraserver-server-id-4")])
def test_a_gang_lands_inside_one_network_domain(core_api, custom, namespace, operator, itype, key):
    """Eight nodes as EKS labels them, four under each layer-3 network node (trn2u: four to an
    UltraServer, as the Neuron device plugin labels them): a four-node gang lands under one,
    by the kube-scheduler's own reading of the run's pod affinity (plan.gang_affinity: preferred
    for the network layers, required for a trn2u UltraServer)."""
    from localcluster.nodes import create_nodes, schedulable
    prefix = f"{itype.split('.')[0]}-topo-"
    names = create_nodes(core_api, 8, itype, prefix)
    # All eight free to choose from: Ready, and the not-ready taint taken off (a node still tainted
    # sent the fourth pod to the other domain once).
    wait_until(lambda: all(schedulable(core_api, n) for n in names), what="the eight nodes schedulable")
    try:
        body = manifest("together", 4)
        body["spec"]["instanceType"] = itype
        body["spec"]["parallelism"] = {"tensor": 8, "sequenceParallel": True, "zero1": True}
        create(custom, namespace, body)
        wait_running_gang(core_api, custom, namespace, "together", 1, 4)
        placed = {p.spec.node_name for p in gang(core_api, namespace, "together", 1)}
        domains = {core_api.read_node(n).metadata.labels[key] for n in placed}
        assert len(placed) == 4 and len(domains) == 1, (placed, domains)
    finally:  # (the namespace goes with its run and pods; the nodes with their labels)
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "together")
        for n in names:
            core_api.delete_node(n)


def test_a_dra_run_claims_its_nodes_devices_and_trn3_is_taken_through_dra_only(core_api, custom, namespace, operator):
    """The Neuron DRA driver's DeviceClass, and nodes whose devices it publishes as ResourceSlices
    (localcluster.nodes.publish_dra_devices; no extended resources): a run with resources DRA
    gets its ResourceClaimTemplate, each pod claims from it (a trn1 run beside it keeps the device
    plugin: its nodes have it), and Kubernetes' own resource claim
    controller and scheduler allocate every Neuron device of the pod's node to its claim. A trn3
    run is refused with resources DevicePlugin, naming the field, and placed through DRA with
    resources Auto."""
    from kubernetes import client
    from localcluster.nodes import create_nodes, install_dra_driver
    dra = client.ResourceV1Api(core_api.api_client)
    install_dra_driver(core_api)
    names = create_nodes(core_api, 2, "trn2.48xlarge", "dra-trn2-", dra=True) + create_nodes(core_api, 2, "trn3", "trn3-")
    try:
        body = manifest("claims", 2)
        body["spec"].update(instanceType="trn2.48xlarge", resources="DRA")
        create(custom, namespace, body)
        wait_running_gang(core_api, custom, namespace, "claims", 1, 2)
        template = dra.read_namespaced_resource_claim_template("claims-devices", namespace)
        # resources Auto on trn1, whose nodes have the device plugin: counted devices, no claim
        create(custom, namespace, manifest("plugin", 1))
        wait_running_gang(core_api, custom, namespace, "plugin", 1, 1)
        (plugin_pod,) = gang(core_api, namespace, "plugin", 1)
        assert not plugin_pod.spec.resource_claims
        assert plugin_pod.spec.containers[0].resources.limits["aws.amazon.com/neuron"] == "16"
        assert template.metadata.owner_references[0].kind == "TrainingRun"
        for pod in gang(core_api, namespace, "claims", 1):
            assert pod.spec.node_name.startswith("dra-trn2-")
            assert [(c.name, c.resource_claim_template_name) for c in pod.spec.resource_claims] == [
                ("devices", "claims-devices")]
            claim_name = pod.status.resource_claim_statuses[0].resource_claim_name
            claim = dra.read_namespaced_resource_claim(claim_name, namespace)
            results = claim.status.allocation.devices.results
            assert len(results) == 16 and {r.pool for r in results} == {pod.spec.node_name}
            assert not (pod.spec.containers[0].resources.limits or {}).get("aws.amazon.com/neuron")
        # trn3: DRA only
        refused = manifest("trn3-plugin", 2)
        refused["spec"].update(instanceType="trn3", processesPerNode=64, resources="DevicePlugin")
        create(custom, namespace, refused)
        st, _ = wait_until(lambda: next((c for c in status(custom, namespace, "trn3-plugin").get("conditions") or []
                                         if c["type"] == "Valid" and c["status"] == "False"), None), what="refused")
        assert "spec.resources" in st["message"], st
        trn3 = manifest("trn3", 2)
        trn3["spec"].update(instanceType="trn3", processesPerNode=64)
        create(custom, namespace, trn3)
        wait_running_gang(core_api, custom, namespace, "trn3", 1, 2)
        assert {p.spec.node_name[:5] for p in gang(core_api, namespace, "trn3", 1)} == {"trn3-"}
    finally:
        for run in ("claims", "plugin", "trn3-plugin", "trn3"):
            with contextlib.suppress(Exception):
                custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, run)
        for n in names:
            core_api.delete_node(n)
        dra.delete_device_class("neuron.aws.com")  # the other tests' clusters have no DRA driver
