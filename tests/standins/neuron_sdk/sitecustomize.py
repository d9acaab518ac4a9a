"""STAND-INS loaded at interpreter start (this directory is on PYTHONPATH in the NxD tier):

1. ``neuronx_distributed.trace`` (NxD's inference tracing).
2. ``torch_xla.core.xla_env_vars.HOST_WORLD_SIZE``: a constant Neuron's build of torch-xla has
   and upstream's dropped with XRT (upstream defined it as ``"XRT_HOST_WORLD_SIZE"``, the
   number of hosts); NxD's ``get_local_world_size`` (parallel_layers/utils.py) reads the
   environment variable it names (its checkpoint loader staggers readers by it). Whoever
   launches NxD here sets that variable, as a Neuron image's launch environment does.

On 1:
NxD's package ``__init__`` imports its trace package, which needs torch-neuronx's compiler
bindings (HLO protobufs, libneuronxla) that no stand-in could honestly provide. Training never
uses it: only ``neuronx_distributed/__init__.py`` imports from it. So the names that
``__init__`` imports are provided here, each raising when used, and NxD's read-only source is
not edited. Everything else under ``neuronx_distributed`` is NxD's own code."""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

_TRACE = "neuronx_distributed.trace"
_NAMES = {  # submodule -> the names neuronx_distributed/__init__.py imports from it
    "model_builder_v2": ["ModelBuilder"],
    "functions": ["shard_checkpoint"],
    "nxd_model": ["BaseNxDModel", "NxDModel", "TorchScriptNxDModel", "convert_nxd_model_to_torchscript_model"],
    "parallel_context": ["NxDParallelState"],
}


def _unavailable(name: str):
    def unavailable(*args, **kwargs):
        raise RuntimeError(f"{_TRACE}.{name} (inference tracing) needs torch-neuronx; "
                           "the NxD tier's stand-in does not provide it")
    unavailable.__name__ = name
    return unavailable


class _TraceStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == _TRACE or fullname.startswith(_TRACE + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == _TRACE)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name, "STAND-IN for NxD's inference tracing (tests/standins)")
        for name in _NAMES.get(spec.name.rpartition(".")[2], []):
            setattr(module, name, _unavailable(name))
        if spec.name == _TRACE:
            module.__path__ = []
        return module

    def exec_module(self, module):
        """Nothing to run: create_module already filled in the stand-in's names."""


class _XlaEnvVars(importlib.abc.MetaPathFinder):
    """Adds HOST_WORLD_SIZE (the variable's name, as upstream torch-xla had it) to upstream's
    torch_xla.core.xla_env_vars once it is imported; the module is otherwise unchanged."""

    NAME = "torch_xla.core.xla_env_vars"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.NAME:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            if not hasattr(module, "HOST_WORLD_SIZE"):
                module.HOST_WORLD_SIZE = "XRT_HOST_WORLD_SIZE"
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _TraceStandIn())
sys.meta_path.insert(0, _XlaEnvVars())
