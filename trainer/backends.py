"""The backend seam: one object per device kind, chosen once, that owns what differs between
devices. ``Trainer`` asks it and never branches on the backend's name.

``Backend``          the PyTorch backend on an eager device: CPU (gloo), CUDA (NCCL) and
                     Trainium through TorchNeuron (device and process group ``neuron``), our
                     own tensor-parallel layers (``parallel.TPContext``), PyTorch's pipeline
                     schedule (``trainer.pipeline``; not on TorchNeuron yet).
``neuron.NeuronBackend``  Trainium through torch-xla and NxD (NxD's process groups, layers,
                     loss and pipeline; NxD's CPU mode runs the same calls on gloo).
``neuron.XlaBackend``     torch-xla's own device in one process with our layers (CI's XLA loop).

Everything that imports torch-xla, torch-neuronx or NxD stays in ``trainer.neuron``, imported
only when one of its backends is picked.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from .config import ConfigError
from .launch import PRECOMPILE_ENV
from .parallel import EAGER_DEVICES, ParallelState, TPContext, eager_device, init_parallel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckCollectives:
    """Where the pre-flight check (trainer.preflight) times its matmuls and all-reduces: the
    trainer's own device and collectives. ``device`` holds the tensors; ``sync()`` waits for
    the device's queued work (a timing means nothing before it); ``collectives`` is the
    process-group backend of the gang all-reduce (the check makes that group on top of its gloo
    default group: "gloo" uses the default); ``pair_backend`` the node pairs' (gloo: host
    tensors)."""

    device: torch.device
    sync: Callable[[], None]
    collectives: str
    pair_backend: str
    described: str


class Backend:
    """An eager PyTorch device: ``cpu``, ``cuda``, or Trainium's ``neuron`` device through
    TorchNeuron (``Backend("neuron", native=True)``): one code path, so the code CI runs on
    CPU with gloo is the code trn2 and trn3 would run (the device and its collectives differ)."""

    def __init__(self, name: str, native: bool = False):
        self.name = name
        self.native = native  # TorchNeuron: the neuron backend on its native path

    def __str__(self) -> str:
        return f"{self.name} (TorchNeuron, native)" if self.native else self.name

    # Host tensors cannot travel on NCCL or XLA groups: the trainer makes a gloo group for
    # time-based save decisions unless the default group is gloo already.
    @property
    def default_group_carries_host_tensors(self) -> bool:
        return self.name == "cpu"

    def init_parallel(self, layout_fn, sequence_parallel: bool, precision: str, kv_replicas: int) -> ParallelState:
        return init_parallel(self.name, layout_fn, sequence_parallel, precision, kv_replicas)

    def check_collectives(self) -> CheckCollectives:
        """The pre-flight check's device (made current) and collectives: the trainer's
        (``EAGER_DEVICES``). Local: no process group is made here."""
        device = eager_device(self.name, int(os.environ.get("LOCAL_RANK", "0")))
        if self.name == "cuda":
            sync = torch.cuda.synchronize
        elif self.native:  # TorchNeuron registers its device with torch.accelerator
            sync = torch.accelerator.synchronize
        else:
            def sync() -> None:
                """CPU work is done when the call returns."""
        backend = EAGER_DEVICES[self.name]
        return CheckCollectives(device, sync, backend, backend, f"{backend} on {device.type}")

    def prepare(self, micro_batch_size: int, ps: ParallelState) -> None:
        """Before the model is built: refuse what this backend cannot run (naming the field),
        set what its numerics need. CPU runs deterministic kernels (exact resume is tested
        bitwise there)."""
        if self.name == "cpu":
            torch.use_deterministic_algorithms(True)
        if self.native and ps.pp > 1:
            raise ConfigError("parallelism.pipeline", "TorchNeuron does not support pipeline parallelism yet "
                                                      "(AWS: 'will be available soon'); use tensor and data "
                                                      "parallelism, or the XLA path on an SDK 2.29 image")
        if self.native and os.environ.get(PRECOMPILE_ENV):
            raise ConfigError("compileCache.precompileSteps", "pre-compiling runs neuron_parallel_compile, a "
                                                              "torch-xla tool; TorchNeuron compiles as it runs: "
                                                              "set precompileSteps to 0")

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
        if self.native:
            from .neuron import neuron_rank_peak
            return neuron_rank_peak()
        if self.name != "cuda":
            return None
        from .metrics import PEAK_FLOPS
        name = torch.cuda.get_device_name()
        return next((peak for key, peak in PEAK_FLOPS.items() if key.startswith("cuda-") and key[5:] in name), None)


def torchneuron_available() -> bool:
    """Whether TorchNeuron registered Trainium as PyTorch's accelerator: the PrivateUse1
    device named ``neuron``, which ``torch.accelerator`` reports. It autoloads (aws-neuron-sdk
    frameworks/torch/pytorch-native-overview.rst), and AWS's distributed guide imports
    ``torch_neuronx`` first to register the device and the ``neuron`` process group backend
    (torch/guides/torch-distributed.html): so do we, on a PyTorch past the XLA line (2.9), where
    an installed torch-neuronx is TorchNeuron."""
    if _torch_minor() > (2, 9) and importlib.util.find_spec("torch_neuronx") is not None:
        try:
            importlib.import_module("torch_neuronx")
        except Exception as exc:  # noqa: BLE001 - said here; pick() then says what is missing
            log.warning("torch-neuronx is installed but does not import: %s: %s", type(exc).__name__, exc)
    accelerator = getattr(torch, "accelerator", None)
    try:
        current = accelerator.current_accelerator() if accelerator and accelerator.is_available() else None
    except Exception:  # noqa: BLE001 - an accelerator that cannot answer is not TorchNeuron
        return False
    return current is not None and current.type == "neuron"


def _torch_minor() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


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
