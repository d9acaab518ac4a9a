"""The PyTorch backend on an eager device (CPU, CUDA, Trainium through TorchNeuron), and what
every backend gives the pre-flight check (``CheckCollectives``). trainer.model.backends picks a
backend; trainer.model.neuron's XLA backends build on ``Backend``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import ConfigError
from ..contract.podenv import PodEnv
from .parallel import EAGER_DEVICES, ParallelState, TPContext, eager_device, init_parallel
from .trainium import neuron_rank_peak

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckCollectives:
    """Where the pre-flight check (trainer.pod.preflight) times its matmuls and all-reduces: the
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

    def init_parallel(self, layout_fn, sequence_parallel: bool, precision: str, kv_replicas: int,
                      env: PodEnv | None = None) -> ParallelState:
        return init_parallel(self.name, layout_fn, sequence_parallel, precision, kv_replicas, env)

    def check_collectives(self, env: PodEnv | None = None) -> CheckCollectives:
        """The pre-flight check's device (made current) and collectives: the trainer's
        (``EAGER_DEVICES``). Local: no process group is made here."""
        device = eager_device(self.name, (env or PodEnv.from_environ()).local_rank)
        if self.name == "cuda":
            sync = torch.cuda.synchronize
        elif self.native:  # TorchNeuron registers its device with torch.accelerator
            sync = torch.accelerator.synchronize
        else:
            def sync() -> None:
                """CPU work is done when the call returns."""
        backend = EAGER_DEVICES[self.name]
        return CheckCollectives(device, sync, backend, backend, f"{backend} on {device.type}")

    def prepare(self, micro_batch_size: int, ps: ParallelState, env: PodEnv | None = None) -> None:
        """Before the model is built: refuse what this backend cannot run (naming the field),
        set what its numerics need. CPU runs deterministic kernels (exact resume is tested
        bitwise there)."""
        if self.name == "cpu":
            torch.use_deterministic_algorithms(True)
        if self.native and ps.pp > 1:
            raise ConfigError("parallelism.pipeline", "TorchNeuron does not support pipeline parallelism yet "
                                                      "(AWS: 'will be available soon'); use tensor and data "
                                                      "parallelism, or the XLA path on an SDK 2.29 image")
        if self.native and (env or PodEnv.from_environ()).precompile_steps:
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
