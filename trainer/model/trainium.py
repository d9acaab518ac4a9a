"""What the trainer knows of Trainium without importing the Neuron SDK: NxD's CPU mode
(``NXD_CPU_MODE``), the chip generation torch-neuronx names, and one rank's peak FLOP/s for MFU.
The eager backend (TorchNeuron) and the XLA backends (trainer.model.neuron) both ask here.
"""

from __future__ import annotations

import importlib

from ..config import ConfigError
from ..contract.podenv import NXD_CPU_MODE_ENV, PodEnv
from .metrics import PEAK_FLOPS


def platform_target(env: PodEnv | None = None) -> str | None:
    """The chip generation this process runs on ("trn1", "trn2", ...): torch-neuronx's own
    answer (``torch_neuronx.utils.get_platform_target``), which NxD also asks to pick kernels.
    None when it cannot say (an SDK without it, an unreadable instance identity): it feeds only
    the MFU figure, which must never stop a run. None in NxD's CPU mode too: no NeuronCore
    computes there."""
    try:
        if nxd_cpu_mode(env):
            return None
        target = importlib.import_module("torch_neuronx.utils").get_platform_target()
    except Exception:  # noqa: BLE001 - whatever broke, MFU is merely unknown
        return None
    target = getattr(target, "value", target)  # some Neuron packages answer with an Enum
    return str(target).lower() if target else None


def nxd_cpu_mode(env: PodEnv | None = None) -> bool:
    """Whether NxD runs in its CPU mode (``NXD_CPU_MODE=1``; NxD's own answer,
    src/neuronx_distributed/utils/__init__.py ``cpu_mode``): its process groups are gloo groups
    and its layers, mappings, loss and pipeline communication run on CPU tensors. The Neuron
    backend then runs eagerly on the CPU with NxD's real code: how CI tests it without
    Trainium, and how a user checks a Neuron layout before renting the nodes."""
    # NxD 2.29's own rule (int(value) > 0), read here without importing NxD: importing it
    # imports torch-neuronx, which must come after the runtime's variables are set. A value
    # NxD's int() would crash on is refused here, naming the variable, instead.
    value = (env or PodEnv.from_environ()).nxd_cpu_mode
    try:
        return int(value) > 0
    except ValueError:
        raise ConfigError(f"env {NXD_CPU_MODE_ENV}", f"must be an integer (1: NxD's CPU mode, 0: off), got {value!r}") from None


def neuron_rank_peak(env: PodEnv | None = None) -> float | None:
    """Dense BF16 peak FLOP/s of one rank on Trainium: the chip torch-neuronx names, its
    per-core peak times the logical NeuronCore config (1 on trn1, 2 by default on trn2)."""
    env = env or PodEnv.from_environ()
    generation = platform_target(env)
    per_core = PEAK_FLOPS.get(f"neuron-{generation}") if generation else None
    lnc = int(env.neuron_logical_nc_config or (1 if generation == "trn1" else 2))
    return per_core * lnc if per_core else None
