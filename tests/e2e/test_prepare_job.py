"""examples/prepare-job.yaml on the local control plane: the Job controller creates the Indexed
Job's pods, the process-backed kubelet runs them (python -m trainer.data.prepare, real processes),
they read raw shards from the loopback S3 server and write token shards back; the pod that
completes the last shard writes the manifest. The output is byte for byte what the trainer's
own preparation of the same corpus makes (the e2e tier's runs train on that)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from localcluster import drill

pytestmark = pytest.mark.e2e
EXAMPLE = drill.ROOT / "examples" / "prepare-job.yaml"


def test_the_prepare_job_runs_on_the_control_plane(e2e, tiny_data):
    from kubernetes import client

    ns = e2e.namespace("prepare-job")
    s3 = e2e.s3.client
    s3.create_bucket(Bucket="corpus")
    raw = Path(tiny_data["stories"])
    for f in sorted(raw.iterdir()):
        s3.upload_file(str(f), "corpus", f"raw/stories/{f.name}")
    s3.upload_file(tiny_data["tokenizer"], "corpus", "tokenizer.json")

    job = yaml.safe_load(EXAMPLE.read_text())
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    example_parts = spec["completions"]
    spec["completions"] = spec["parallelism"] = 2
    pod.pop("serviceAccountName")  # the namespace's default identity; S3 credentials come from env
    container["image"] = "local"  # the process runner uses this machine's Python environment
    container["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"}}
    flags = {a.split("=", 1)[0]: a.split("=", 1)[1].split()[0] for a in container["args"]}
    assert int(flags["--parts"]) == example_parts  # the example's pods and parts agree
    flags.update({"--source": "s3://corpus/raw/stories/", "--tokenizer": "s3://corpus/tokenizer.json",
                  "--out": "s3://corpus/prepared/stories/", "--parts": "2"})
    container["args"] = [f"{k}={v}" for k, v in flags.items()]
    container["env"] = [*container.get("env", []), *({"name": k, "value": v} for k, v in e2e.s3.env.items())]

    batch = client.BatchV1Api(e2e.cluster.api_client())
    t0 = time.monotonic()
    batch.create_namespaced_job(ns, job)
    name = job["metadata"]["name"]
    deadline = time.monotonic() + 180
    while True:
        status = batch.read_namespaced_job_status(name, ns).status
        done = {c.type: c.status for c in status.conditions or []}
        if done.get("Complete") == "True":
            break
        assert done.get("Failed") != "True", f"the Job failed: {status}"
        assert time.monotonic() < deadline, f"the Job did not complete: {status}"
        time.sleep(0.5)
    print(f"\nprepare Job complete in {time.monotonic() - t0:.1f} s ({status.succeeded} pods)")
    assert status.succeeded == 2

    pods = e2e.core.list_namespaced_pod(ns, label_selector=f"job-name={name}").items
    logs = {p.metadata.annotations["batch.kubernetes.io/job-completion-index"]:
            e2e.core.read_namespaced_pod_log(p.metadata.name, ns) for p in pods}
    assert sorted(logs) == ["0", "1"]
    assert "this part (0 of 2): 2" in logs["0"] and "this part (1 of 2): 2" in logs["1"], logs
    assert any("prepared.json written" in text for text in logs.values()), logs

    local = Path(tiny_data["stories_prepared"])
    manifest = json.loads(s3.get_object(Bucket="corpus", Key="prepared/stories/prepared.json")["Body"].read())
    want = json.loads((local / "prepared.json").read_text())
    strip = [{k: v for k, v in s.items() if k != "source"} for s in manifest["shards"]]
    assert strip == [{k: v for k, v in s.items() if k != "source"} for s in want["shards"]]
    assert manifest["tokenizer_sha256"] == want["tokenizer_sha256"]
    for shard in want["shards"]:
        for ext in (".bin", ".idx"):
            got = s3.get_object(Bucket="corpus", Key=f"prepared/stories/{shard['name']}{ext}")["Body"].read()
            assert got == (local / (shard["name"] + ext)).read_bytes(), shard["name"] + ext
