"""The backend seam: one object per device kind, chosen once, that owns what differs between
devices. ``Trainer`` asks it and never branches on the backend's name.

``Backend``          the PyTorch backend on an eager device: CPU (gloo) and CUDA (NCCL), our
                     own tensor-parallel layers (``parallel.TPContext``), PyTorch's pipeline
                     schedule (``trainer.pipeline``).
``neuron.NeuronBackend``  Trainium through torch-xla and NxD (NxD's process groups, layers,
                     loss and pipeline; NxD's CPU mode runs the same calls on gloo).
``neuron.XlaBackend``     torch-xla's own device in one process with our layers (CI's XLA loop).

Everything that imports torch-xla, torch-neuronx or NxD stays in ``trainer.neuron``, imported
only when one of its backends is picked.
"""

from __future__ import annotations

import torch

from .config import ConfigError
from .parallel import ParallelState, TPContext, init_parallel


class Backend:
    """An eager PyTorch device: ``cpu`` or ``cuda``."""

    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        return self.name

    # Host tensors cannot travel on NCCL or XLA groups: the trainer makes a gloo group for
    # time-based save decisions unless the default group is gloo already.
    @property
    def default_group_carries_host_tensors(self) -> bool:
        return self.name == "cpu"

    def init_parallel(self, layout_fn, sequence_parallel: bool, precision: str, kv_replicas: int) -> ParallelState:
        return init_parallel(self.name, layout_fn, sequence_parallel, precision, kv_replicas)

    def prepare(self, micro_batch_size: int, ps: ParallelState) -> None:
        """Before the model is built: refuse what this backend cannot run (naming the field),
        set what its numerics need. CPU runs deterministic kernels (exact resume is tested
        bitwise there)."""
        if self.name == "cpu":
            torch.use_deterministic_algorithms(True)

    def layers(self, ps: ParallelState) -> TPContext:
        """The layer factory the model is built through."""
        return TPContext(ps.tp, ps.tp_rank, ps.tp_group, ps.sequence_parallel, ps.kv_group)

    def pipeline(self, model, ps: ParallelState, micro_batches: int, autocast):
        """The stage's schedule when the model is split into pipeline stages."""
        from .pipeline import Pipeline
        return Pipeline(model, ps, micro_batches, autocast)

    def peak_flops(self) -> float | None:
        """Dense BF16 peak FLOP/s of one rank's device, for MFU; None when unknown (CPUs have
        no meaningful published bf16 peak)."""
        if self.name != "cuda":
            return None
        from .metrics import PEAK_FLOPS
        name = torch.cuda.get_device_name()
        return next((peak for key, peak in PEAK_FLOPS.items() if key.startswith("cuda-") and key[5:] in name), None)


def pick(requested: str = "auto") -> Backend:
    """Neuron, then CUDA, then CPU: the one place that decides the device kind. ``xla``
    (torch-xla's own device, one process) is used only when asked for by name."""
    if requested in ("neuron", "auto"):
        from .neuron import NeuronBackend, neuron_available
        if neuron_available():
            return NeuronBackend()
        if requested == "neuron":
            raise ConfigError("backend", "neuron requested but torch-neuronx is not installed "
                                         "(use a Neuron training image: see the Dockerfile's trainer target)")
    if requested == "xla":
        from .neuron import XlaBackend
        return XlaBackend()
    if requested in ("cuda", "auto") and torch.cuda.is_available():
        return Backend("cuda")
    if requested == "cuda":
        raise ConfigError("backend", "cuda requested but no CUDA device is available")
    return Backend("cpu")
