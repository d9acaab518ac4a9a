"""The Neuron backend's edges that run without Trainium: what each backend refuses (trainer and
operator, one list), the examples' pods selecting it, the pre-compilation flag, and the clear
fatal error when the Neuron SDK is missing. The XLA loop itself: tests/trainer/test_xla_backend.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from trainer.config import ConfigError, load
from trainer.pod.launch import _pop_flag, _pop_precompile
from trainium_api import exitcodes
from trainium_api.launch import AGENT_FLAG, PRECOMPILE_FLAG, PREFLIGHT_FLAG
from trainium_operator import plan
from trainium_operator.spec import parse

ROOT = Path(__file__).resolve().parents[2]
RUN = {"metadata": {"name": "r", "namespace": "ns", "uid": "u"}}


def example(name: str) -> dict:
    return next(yaml.safe_load_all((ROOT / "examples" / name).read_text()))["spec"]


@pytest.mark.parametrize("name", ["llama2-7b.yaml", "neox-20b.yaml", "continual-pretraining-llama3-8b.yaml",
                                  "continual-pretraining-llama2-7b.yaml", "llama3-8b-trn2.yaml"])
def test_trainium_examples_render_pods_whose_trainer_selects_neuron(name, tmp_path):
    spec = parse(example(name))
    rendered = yaml.safe_load(plan.rendered_config(spec))
    assert rendered["backend"] == "neuron"
    pod = plan.pod(RUN, spec, 0, 0, [])
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1" and "--cache_dir=" in env["NEURON_CC_FLAGS"]
    # The trainer accepts that config; what it would do next needs torch-neuronx (next test).
    path = tmp_path / "run.yaml"
    path.write_text(plan.rendered_config(spec))
    assert load(str(path)).backend == "neuron"


def test_trn2_pods_ask_for_the_whole_node_and_set_the_logical_neuroncore_config():
    """trn2.48xlarge: 16 devices and 16 EFA interfaces, 64 ranks (LNC 2), and the compiler's
    and runtime's LNC set alike (they must match); trn1 sets neither."""
    spec = parse(example("llama3-8b-trn2.yaml"))
    assert (spec.processes_per_node, spec.world_size, spec.layout.data) == (64, 1024, 256)
    container = plan.pod(RUN, spec, 1, 0, [])["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "2" and "--logical-nc-config=2" in env["NEURON_CC_FLAGS"]
    assert env["NEURON_RT_NUM_CORES"] == "64"
    assert container["resources"]["limits"] == {"aws.amazon.com/neuron": "16", "vpc.amazonaws.com/efa": "16"}
    trn1 = plan.pod(RUN, parse(example("llama2-7b.yaml")), 1, 0, [])["spec"]["containers"][0]
    trn1_env = {e["name"]: e.get("value") for e in trn1["env"]}
    assert "NEURON_LOGICAL_NC_CONFIG" not in trn1_env and "logical-nc-config" not in trn1_env["NEURON_CC_FLAGS"]
    with pytest.raises(ConfigError) as err:  # the operator's own setting: not the user's to change
        parse({**example("llama3-8b-trn2.yaml"), "env": [{"name": "NEURON_LOGICAL_NC_CONFIG", "value": "1"}]})
    assert err.value.field.startswith("spec.env")
    with pytest.raises(ConfigError) as err:  # at most one rank per logical core
        parse({**example("llama3-8b-trn2.yaml"), "processesPerNode": 128})
    assert err.value.field == "spec.processesPerNode"


def test_mfu_peak_follows_the_chip_torch_neuronx_names_and_never_stops_a_run(monkeypatch):
    """The Neuron backend's peak asks torch-neuronx which chip it runs on (stood in here: the SDK is not on
    the package index); an Enum answer is read by its value, and an SDK that cannot say leaves
    MFU unknown instead of failing the trainer's start."""
    import enum
    import types

    from trainer.model.metrics import PEAK_FLOPS
    from trainer.model.neuron import NeuronBackend

    class Target(enum.Enum):
        TRN2 = "trn2"
    answers = iter([Target.TRN2, "trn1", RuntimeError("cannot read the instance identity")])

    def get_platform_target():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer
    fake = types.ModuleType("torch_neuronx.utils")
    fake.get_platform_target = get_platform_target
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    monkeypatch.setitem(sys.modules, "torch_neuronx.utils", fake)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert NeuronBackend().peak_flops() == PEAK_FLOPS["neuron-trn2"] * 2  # LNC 2 by default on trn2
    assert NeuronBackend().peak_flops() == PEAK_FLOPS["neuron-trn1"]
    assert NeuronBackend().peak_flops() is None


def test_extra_compiler_flags_are_appended_but_not_the_operators_own():
    body = example("llama3-8b-trn2.yaml")
    spec = parse({**body, "compileCache": {**body["compileCache"], "extraFlags": "-O1"}})
    env = {e["name"]: e.get("value") for e in plan.pod(RUN, spec, 1, 0, [])["spec"]["containers"][0]["env"]}
    assert env["NEURON_CC_FLAGS"].endswith("--cache_dir=/var/tmp/neuron-compile-cache -O1")
    for flags in ("--cache_dir=/elsewhere", "--logical-nc-config=1"):
        with pytest.raises(ConfigError) as err:
            parse({**body, "compileCache": {**body["compileCache"], "extraFlags": flags}})
        assert err.value.field == "spec.compileCache.extraFlags"


def test_neuron_backend_without_the_sdk_exits_fatal_naming_the_package(tmp_path):
    """On a machine without torch-neuronx the Neuron backend stops at once with the fatal exit
    code and says what is missing (it used to refuse the backend as 'not in this release')."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"backend": "neuron", "model": {"preset": "tiny"},
                                   "data": {"sources": [{"uri": str(tmp_path)}], "tokenizer": "t.json"}}))
    res = subprocess.run([sys.executable, "-m", "trainer", "--config", str(cfg)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == exitcodes.FATAL, res.stderr[-2000:]
    assert "torch-neuronx is not installed" in res.stderr
    assert "not part of this release" not in res.stderr


def test_nxd_layers_without_nxd_fail_naming_the_package():
    from trainer.model.neuron import NxDLayers
    with pytest.raises(exitcodes.FatalError, match="neuronx-distributed"):
        NxDLayers(1, 0, None, False)


LAYOUT_REFUSALS = [  # what a backend cannot run: refused by the trainer and at submission alike
    ({"parallelism": {"tensor": 8, "pipeline": 4}, "training": {"globalBatchSize": 32}}, "training.globalBatchSize",
     "1F1B"),
    ({"parallelism": {"tensor": 64}, "model": {"preset": "neox-20b"}, "nodes": 4}, "parallelism.tensor",
     "processes per node"),
]


@pytest.mark.parametrize("patch, field, words", LAYOUT_REFUSALS)
def test_operator_refuses_what_the_neuron_backend_cannot_run(patch, field, words):
    body = {**example("llama2-7b.yaml"), "nodes": 16}
    for key, value in patch.items():
        body[key] = {**body[key], **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError) as err:
        parse(body)
    assert err.value.field == f"spec.{field}" and words in str(err.value)


@pytest.mark.parametrize("patch, field", [
    ({"processesPerNode": 64}, "spec.processesPerNode"),
    ({"backend": "cuda"}, "spec.backend"),
    ({"backend": "neuron", "instanceType": "cpu", "processesPerNode": 1}, "spec.backend"),
])
def test_operator_refuses_backends_the_instance_type_cannot_run(patch, field):
    with pytest.raises(ConfigError) as err:
        parse({**example("llama2-7b.yaml"), **patch})
    assert err.value.field == field


def test_xla_backend_is_one_process_only():
    body = {**example("tiny-cpu-run.yaml"), "backend": "xla", "nodes": 2}
    with pytest.raises(ConfigError) as err:
        parse(body)
    assert err.value.field == "spec.backend" and "one process" in str(err.value)
    assert parse({**body, "nodes": 1}).run.backend == "xla"


def test_pipeline_layouts_are_checked_alike_on_every_backend():
    """Pipeline stages run on cpu, cuda and neuron; what no schedule can run is refused by the
    trainer (fatal exit) and at submission alike, with the field named."""
    from trainer.config import ModelConfig, ParallelConfig, TrainingConfig, derive_layout
    model, train = ModelConfig(num_layers=4), TrainingConfig(global_batch_size=16, micro_batch_size=4)
    for backend in ("cpu", "cuda", "neuron", "auto"):
        layout = derive_layout(4, model, ParallelConfig(pipeline=2), train, backend)
        assert (layout.pipeline, layout.data, layout.grad_accum_steps) == (2, 2, 2)
        with pytest.raises(ConfigError, match="at least 2") as err:  # one micro-batch per step
            derive_layout(8, model, ParallelConfig(pipeline=2), train, backend)
        assert err.value.field == "training.globalBatchSize"
        with pytest.raises(ConfigError) as err:
            derive_layout(6, ModelConfig(num_layers=4), ParallelConfig(pipeline=3), train, backend)
        assert err.value.field == "parallelism.pipeline"


def test_precompile_steps_render_into_the_pod_command_on_neuron_only():
    body = example("llama2-7b.yaml")
    body["compileCache"] = {**body["compileCache"], "precompileSteps": 10}
    cmd = plan.pod(RUN, parse(body), 0, 0, [])["spec"]["containers"][0]["command"]
    assert cmd[:6] == ["python", "-m", "trainer.launch", AGENT_FLAG, PRECOMPILE_FLAG, "10"]
    argv = cmd[4:]
    assert _pop_precompile(argv) == 10 and argv[:2] == [PREFLIGHT_FLAG, "2,300,neuron"]  # on by default on trn1
    assert _pop_flag(argv, PREFLIGHT_FLAG) == "2,300,neuron" and argv[0] == "--nnodes"  # torchrun never sees either
    cpu = {**example("tiny-cpu-run.yaml"), "compileCache": {"precompileSteps": 2}}
    with pytest.raises(ConfigError, match="needs the neuron backend") as err:
        parse(cpu)
    assert err.value.field == "spec.compileCache.precompileSteps"
    with pytest.raises(ConfigError, match="negative"):
        parse({**body, "compileCache": {"precompileSteps": -1}})


def test_neuron_picks_torchneuron_when_pytorch_reports_its_device_else_the_xla_path(monkeypatch):
    """How the trainer tells TorchNeuron (trn2/trn3, SDK 2.33+) from the XLA + NxD path (trn1,
    SDK <= 2.29): TorchNeuron autoloads as PyTorch's accelerator ``neuron`` (stood in here by
    torch.accelerator's answer: no Trainium on this machine). The native path is the eager
    PyTorch backend on device and process group ``neuron``, our layers, no pipeline yet."""
    import torch

    from trainer.model import backends
    from trainer.config import ConfigError
    from trainer.model.parallel import EAGER_DEVICES

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    # (a stand-in answer: torch.device("neuron") exists only once TorchNeuron registered it)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: SimpleNamespace(type="neuron"))
    for requested in ("neuron", "auto"):
        picked = backends.pick(requested)
        assert type(picked) is backends.Backend and picked.native and picked.name == "neuron"
        assert str(picked) == "neuron (TorchNeuron, native)"
    assert EAGER_DEVICES["neuron"] == "neuron"  # torch.distributed backend "neuron", as AWS's examples
    with pytest.raises(ConfigError) as err:
        picked.prepare(1, SimpleNamespace(pp=2))
    assert err.value.field == "parallelism.pipeline"
    picked.prepare(1, SimpleNamespace(pp=1))
    monkeypatch.setenv("TRAINER_PRECOMPILE_STEPS", "2")  # neuron_parallel_compile is torch-xla's
    with pytest.raises(ConfigError) as err:
        picked.prepare(1, SimpleNamespace(pp=1))
    assert err.value.field == "compileCache.precompileSteps"
    monkeypatch.delenv("TRAINER_PRECOMPILE_STEPS")

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr("trainer.model.neuron.neuron_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        backends.pick("neuron")
    assert err.value.field == "backend" and "torch-neuronx is not installed" in str(err.value)
    monkeypatch.setattr("trainer.model.neuron.neuron_available", lambda: True)
    from trainer.model.neuron import NeuronBackend
    assert isinstance(backends.pick("neuron"), NeuronBackend)  # torch-neuronx without the native device
    monkeypatch.setattr(torch, "__version__", "2.14.0")  # TorchNeuron's torch, its device not reported
    with pytest.raises(ConfigError) as err:
        backends.pick("neuron")
    assert err.value.field == "backend" and "reports no neuron accelerator" in str(err.value)
    assert backends.pick("auto").name == "cpu"  # auto falls through to this machine's device


def test_nxd_cpu_mode_values_and_trainium_nodes_are_checked(monkeypatch):
    """NXD_CPU_MODE from a run's env: a value NxD's int() would crash on is refused naming the
    variable (a config error, not a crash loop), and CPU mode is refused where the container
    has Neuron devices (it would hold the NeuronCores and train on the CPU)."""
    import glob

    from trainer.model.neuron import nxd_cpu_mode, refuse_cpu_mode_on_trainium
    for value, on in (("1", True), ("0", False), ("2", True)):
        monkeypatch.setenv("NXD_CPU_MODE", value)
        assert nxd_cpu_mode() is on
    monkeypatch.setenv("NXD_CPU_MODE", "yes")
    with pytest.raises(ConfigError) as err:
        nxd_cpu_mode()
    assert err.value.field == "env NXD_CPU_MODE"
    monkeypatch.setattr(glob, "glob", lambda pattern: [])
    refuse_cpu_mode_on_trainium()
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/neuron0"] if "neuron" in pattern else [])
    with pytest.raises(ConfigError) as err:
        refuse_cpu_mode_on_trainium()
    assert err.value.field == "env NXD_CPU_MODE" and "Neuron devices" in str(err.value)


def test_torchneuron_is_imported_to_register_its_device(monkeypatch, tmp_path):
    """On a PyTorch past the XLA line an installed torch-neuronx is TorchNeuron, and AWS's
    distributed guide imports it to register the ``neuron`` device and process group backend:
    pick() does so before asking torch.accelerator. The package here is a stand-in that
    registers the answer on import (no Trainium on this machine)."""
    import sys

    import torch

    from trainer.model import backends
    (tmp_path / "torch_neuronx").mkdir()
    (tmp_path / "torch_neuronx" / "__init__.py").write_text(
        "import types, torch\n"
        "torch.accelerator.is_available = lambda: True\n"
        "torch.accelerator.current_accelerator = lambda: types.SimpleNamespace(type='neuron')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_neuronx", raising=False)
    # restored after the test: the stand-in replaces them on import
    monkeypatch.setattr(torch.accelerator, "is_available", torch.accelerator.is_available)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", torch.accelerator.current_accelerator)
    monkeypatch.setattr(torch, "__version__", "2.9.0")
    assert not backends.torchneuron_available()  # the XLA line: torch-neuronx is torch-xla's, not imported here
    assert "torch_neuronx" not in sys.modules
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    picked = backends.pick("auto")
    assert picked.native and picked.name == "neuron" and "torch_neuronx" in sys.modules
    monkeypatch.delitem(sys.modules, "torch_neuronx")
