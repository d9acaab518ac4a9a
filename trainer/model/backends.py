"""The backend seam: one object per device kind, chosen once, that owns what differs between
devices. ``Trainer`` asks it and never branches on the backend's name.

``eager.Backend``    the PyTorch backend on an eager device: CPU (gloo), CUDA (NCCL) and
                     Trainium through TorchNeuron (device and process group ``neuron``), our
                     own tensor-parallel layers (``parallel.TPContext``), PyTorch's pipeline
                     schedule (``trainer.model.pipeline``; not on TorchNeuron yet).
``neuron.NeuronBackend``  Trainium through torch-xla and NxD (NxD's process groups, layers,
                     loss and pipeline; NxD's CPU mode runs the same calls on gloo).
``neuron.XlaBackend``     torch-xla's own device in one process with our layers (CI's XLA loop).

Everything that imports torch-xla, torch-neuronx or NxD stays in ``trainer.model.neuron``, imported
only when one of its backends is picked.
"""

from __future__ import annotations

import torch

from ..config import ConfigError
from .eager import Backend, CheckCollectives, _torch_minor, torchneuron_available

__all__ = ["Backend", "CheckCollectives", "pick", "torchneuron_available"]


def pick(requested: str = "auto") -> Backend:
    """Neuron, then CUDA, then CPU: the one place that decides the device kind. On Neuron,
    TorchNeuron's native device when PyTorch reports it (trn2, trn3, SDK 2.33 and later), else
    torch-xla + NxD (trn1, and every SDK up to 2.29). ``xla`` (torch-xla's own device, one
    process) is used only when asked for by name."""
    if requested in ("neuron", "auto"):
        if torchneuron_available():
            return Backend("neuron", native=True)
        from .neuron import NeuronBackend, neuron_available, nxd_cpu_mode
        if neuron_available():
            # torch-neuronx's XLA path ends with PyTorch 2.9 (SDK 2.29); NxD's CPU mode runs on any
            if _torch_minor() > (2, 9) and not nxd_cpu_mode():
                if requested == "auto":  # not this machine's device: CUDA or CPU next
                    return _cuda_or_cpu("auto")
                raise ConfigError("backend", f"torch-neuronx is installed with PyTorch {torch.__version__} "
                                             "(TorchNeuron) but PyTorch reports no neuron accelerator: check that "
                                             "Neuron devices are visible and TORCH_DEVICE_BACKEND_AUTOLOAD is not 0")
            return NeuronBackend()
        if requested == "neuron":
            raise ConfigError("backend", "neuron requested but torch-neuronx is not installed "
                                         "(use a Neuron training image: see the Dockerfile's trainer target)")
    if requested == "xla":
        from .neuron import XlaBackend
        return XlaBackend()
    return _cuda_or_cpu(requested)


def _cuda_or_cpu(requested: str) -> Backend:
    if requested in ("cuda", "auto") and torch.cuda.is_available():
        return Backend("cuda")
    if requested == "cuda":
        raise ConfigError("backend", "cuda requested but no CUDA device is available")
    return Backend("cpu")
