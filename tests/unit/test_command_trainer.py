"""spec.trainer kind command, in the operator's pure core: validation with the field named,
the pod's command (watch -> launch -> script; the watch lists the store from the pod and adds the
resume override), no ConfigMap, the same pod spec for every attempt, the resume point recorded
from the pods' reports, and the examples."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer.config import ConfigError
from trainium_api.status import CheckpointRef
from trainium_operator import plan
from trainium_operator.reconcile import reconcile_objects
from trainium_operator.spec import parse

ROOT = Path(__file__).resolve().parents[2]
NXDT = {"image": "img", "nodes": 2, "instanceType": "cpu", "processesPerNode": 2,
        "trainer": {"kind": "command", "progressFormat": "nxdt", "workingDir": "/workspace",
                    "command": ["training_orchestrator.py", "--config-path=conf", "--config-name=hf_llama_7B_config"],
                    "tokensPerSample": 4096, "samplesPerStep": 1024},
        "checkpoint": {"uri": "/shared/exp/checkpoints"}, "logging": {"progressIntervalSeconds": 2}}
RUN = {"metadata": {"name": "r", "namespace": "ns", "uid": "u-1", "generation": 1}, "spec": NXDT, "status": {}}
CKPT = {"tag": "hf_llama--step=20-consumed_samples=20480.0.ckpt", "step": 20, "time": 5.0,
        "uri": "/shared/exp/checkpoints/hf_llama--step=20-consumed_samples=20480.0.ckpt"}
REF = CheckpointRef(**CKPT)


def _with(base: dict, **trainer) -> dict:
    return {**base, "trainer": {**base["trainer"], **trainer}}


@pytest.mark.parametrize("patch,field,words", [
    ({"trainer": {"kind": "command", "progressFormat": "nxd"}}, "spec.trainer.command", "is required"),
    ({"trainer": {"kind": "command", "command": [""], "progressFormat": "nxd"}}, "spec.trainer.command", "is required"),
    ({"trainer": {"kind": "command", "command": ["x.py"]}}, "spec.trainer.progressFormat", "must be one of"),
    ({"trainer": {"kind": "command", "command": ["x.py"], "progressFormat": "regex", "progressRegex": "(?P<step>\\d+",
                  "checkpointLayout": "nxd"}}, "spec.trainer.progressRegex", "invalid regular expression"),
    ({"trainer": {"kind": "command", "command": ["x.py"], "progressFormat": "regex", "progressRegex": "step (\\d+)",
                  "checkpointLayout": "nxd"}}, "spec.trainer.progressRegex", "named group 'step'"),
    ({"trainer": {"kind": "command", "command": ["x.py"], "progressFormat": "regex",
                  "progressRegex": "(?P<step>\\d+)"}}, "spec.trainer.checkpointLayout", "is required"),
    ({"trainer": {"kind": "command", "command": ["x.py"], "progressFormat": "nxd", "progressRegex": "(?P<step>\\d+)"}},
     "spec.trainer.progressRegex", "needs progressFormat regex"),
    ({"trainer": {"kind": "script"}}, "spec.trainer.kind", "must be one of builtin, command"),
    ({"trainer": {"kind": "command", "command": "x.py --a", "progressFormat": "nxd"}}, "spec.trainer.command",
     "list of strings"),
    ({"trainer": {"kind": "command", "command": ["x.py"], "progressFormat": "nxd", "checkpointLayout": "megatron"}},
     "spec.trainer.checkpointLayout", "must be one of"),
    ({"trainer": {"command": ["x.py"]}}, "spec.trainer.command", "needs trainer.kind: command"),
    ({"model": {"preset": "llama2-7b"}}, "spec.model", "read only by the builtin trainer"),
    ({"data": {"sources": [{"uri": "s3://d/"}]}}, "spec.data", "read only by the builtin trainer"),
    ({"checkpoint": {"uri": "/c", "intervalSteps": 5}}, "spec.checkpoint.intervalSteps", "only uri is read"),
    ({"checkpoint": {"uri": ""}}, "spec.checkpoint.uri", "is required"),
    ({"compileCache": {"precompileSteps": 2}}, "spec.compileCache.precompileSteps", "neuron_parallel_compile"),
    ({"trainer": {"kind": "command", "command": ["x.py"], "progressFormat": "nxd", "tokensPerSample": -1}},
     "spec.trainer.tokensPerSample", "must not be negative"),
])
def test_command_specs_are_refused_with_the_field_named(patch, field, words):
    body = {**NXDT, **patch}
    if "instanceType" not in patch and patch.get("compileCache"):
        body.update(instanceType="trn1.32xlarge", processesPerNode=32)
    with pytest.raises(ConfigError) as err:
        parse(body)
    assert err.value.field == field and words in err.value.message, str(err.value)


def test_a_command_spec_needs_none_of_the_trainer_groups():
    s = parse(NXDT)
    assert s.layout is None and s.trainer.layout == "nxdt" and s.run.checkpoint.uri == "/shared/exp/checkpoints"
    assert s.tokens_per_step == 4096 * 1024
    assert parse(_with(NXDT, progressFormat="nxd")).trainer.layout == "nxd"
    assert parse(_with(NXDT, progressFormat="regex", progressRegex=r"(?P<step>\d+)",
                       checkpointLayout="trainer")).trainer.layout == "trainer"


def test_pod_runs_the_script_under_the_watch_which_lists_the_store_from_the_pod():
    s = parse(NXDT)
    pod = plan.pod(RUN, s, attempt=2, index=1, excluded_nodes=[])
    c = pod["spec"]["containers"][0]
    cmd = c["command"]
    split = cmd.index("--")
    assert cmd[:split] == ["python", "-m", "trainer.watch", "--format", "nxdt", "--interval", "2.0",
                           "--tokens-per-sample", "4096", "--checkpoint-layout", "nxdt"]
    assert cmd[split + 1:split + 4] == ["python", "-m", "trainer.launch"]
    assert cmd[cmd.index("--node_rank") + 1] == "1" and cmd[cmd.index("--nproc_per_node") + 1] == "2"
    # the resume override is the watch's (trainer.pod.store_watch), from what the pod lists
    tail = cmd[cmd.index("--master_port") + 2:]
    assert tail == ["training_orchestrator.py", "--config-path=conf", "--config-name=hf_llama_7B_config"]
    assert c["workingDir"] == "/workspace"
    assert all(m["name"] != "config" for m in c["volumeMounts"])  # no rendered trainer config
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["CHECKPOINT_URI"] == "/shared/exp/checkpoints" and env["ATTEMPT"] == "2"
    nxd = plan.pod(RUN, parse(_with(NXDT, progressFormat="nxd")), 2, 0, [])["spec"]["containers"][0]["command"]
    assert nxd[nxd.index("--checkpoint-layout") + 1] == "nxd" and nxd[-1] == "--config-name=hf_llama_7B_config"


def test_reconcile_starts_no_configmap_and_each_attempt_records_the_checkpoint_the_pods_reported():
    r = reconcile_objects(RUN, [], {}, now=0.0, checkpoint=None)
    kinds = [e.obj["kind"] for e in r.effects if e.kind == "ensure"]
    assert "ConfigMap" not in kinds and kinds.count("Pod") == 2
    assert r.after.current.resume_checkpoint is None and "dataParallel" not in r.status
    first = r.ensured("Pod")
    run = {**RUN, "status": {**r.status, "phase": "Restarting", "attempt": 1, "current": {"restartNotBefore": 0},
                             "conditions": [{"type": "Valid", "status": "True"}]}}
    r = reconcile_objects(run, [], {}, now=10.0, checkpoint=REF)
    pods = r.ensured("Pod")
    assert r.status["attempt"] == 2 and r.status["current"]["resumeCheckpoint"] == CKPT and len(pods) == 2
    # the same command as the first attempt's: the pods find the checkpoint themselves
    assert [p["spec"]["containers"][0]["command"] for p in pods] == \
        [p["spec"]["containers"][0]["command"] for p in first]


@pytest.mark.parametrize("name", ["nxd-llama2-7b.yaml", "nxdt-llama-7b.yaml"])
def test_script_examples_are_valid_and_use_the_published_recipe(name):
    body = next(yaml.safe_load_all((ROOT / "examples" / name).read_text()))
    s = parse(body["spec"])
    assert s.trainer.is_command and s.instance_type == "trn1.32xlarge" and s.processes_per_node == 32
    cmd = " ".join(s.trainer.command)
    if name.startswith("nxd-"):
        assert s.nodes == 128 and s.trainer.layout == "nxd"
        for flag in ("--tensor_parallel_size 8", "--seq_len 4096", "--lr 3.0e-4", "--warmup_steps 100",
                     "--max_steps 10000", "--loading_step latest_if_exists", "--checkpoint_dir $(CHECKPOINT_URI)"):
            assert flag in cmd, flag
        # grad_accum_usteps = GBS / MBS / DP = 1024 / 1 / (128 x 32 / 8)
        assert f"--grad_accum_usteps {1024 // (128 * 32 // 8)}" in cmd
    else:
        assert s.trainer.layout == "nxdt" and "--config-name=hf_llama_7B_config" in cmd
        assert "trainer.num_nodes=$(NNODES)" in cmd and "trainer.devices=$(NPROC_PER_NODE)" in cmd


def test_volumes_are_mounted_and_contract_names_and_paths_refused():
    vols = {"volumes": [{"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-claim"}}],
            "volumeMounts": [{"name": "fsx", "mountPath": "/fsx", "readOnly": False}]}
    c = plan.pod(RUN, parse({**NXDT, **vols}), 1, 0, [])["spec"]
    assert {"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-claim"}} in c["volumes"]
    assert {"name": "fsx", "mountPath": "/fsx", "readOnly": False} in c["containers"][0]["volumeMounts"]
    for patch, field in [({"volumes": [{"name": "dshm", "emptyDir": {}}]}, "spec.volumes[0].name"),
                         ({"volumes": [{"name": "Bad_Name", "emptyDir": {}}]}, "spec.volumes[0].name"),
                         ({"volumes": [{"name": "a"}]}, "spec.volumes[0]"),
                         ({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, "spec.volumeMounts[0].name"),
                         ({**vols, "volumeMounts": [{"name": "fsx", "mountPath": "fsx"}]}, "spec.volumeMounts[0].mountPath"),
                         ({**vols, "volumeMounts": [{"name": "fsx", "mountPath": "/dev/shm"}]},
                          "spec.volumeMounts[0].mountPath"),
                         ({**vols, "volumeMounts": [{"name": "fsx", "mountPath": "/f", "propagation": 1}]},
                          "spec.volumeMounts[0].propagation")]:
        with pytest.raises(ConfigError) as err:
            parse({**NXDT, **patch})
        assert err.value.field == field, (patch, str(err.value))
