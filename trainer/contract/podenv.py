"""The environment a trainer pod's processes read, read in one place (docs/architecture.md 3.2).

``PodEnv.from_environ()`` is the trainer's one reader of its environment: each process reads it
at its entry (``python -m trainer``, the launcher and its agent, the pre-flight check, the watch
around a command trainer, ``trainer.data.prepare``) and passes it down. A function that a test or
a benchmark also calls on its own takes ``env=None`` and reads it then.

The names the operator sets are the API's (trainium_api.podenv); torchrun sets RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK and TORCHELASTIC_* for each worker; the rest are the
trainer's own, named below, or the Neuron SDK's and Kubernetes' own.

Values keep the spelling the code that uses them has always checked (a NXD_CPU_MODE NxD would
refuse is refused where the backend is chosen, naming the variable, not here).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from trainium_api import podenv as names

# Neuron pre-compilation: `--neuron-precompile-steps N` first runs the same command under
# `neuron_parallel_compile`, which executes no graph but extracts every graph of N steps and
# compiles them in parallel into the node-local cache; then the real run starts. The trainer
# sees this variable in that pass and writes nothing (no checkpoint, progress or losses).
# trainer.pod.launch sets it; PRECOMPILE_FLAG is in trainium_api.launch (the operator writes it
# into the pod command).
PRECOMPILE_ENV = "TRAINER_PRECOMPILE_STEPS"
# Where a rank's checkpoints in node memory live (trainer.checkpoint.memtier; tests point it at a
# directory of their own). Default in a pod: /dev/shm's.
MEMORY_DIR_ENV = "TRAINER_MEMORY_DIR"
# Where one reader per node keeps what it read (trainer.store.node_reads). Default: the temp dir.
STORE_CACHE_ENV = "TRAINER_STORE_CACHE"
# The deferred (lazy) step runtime, for tests of the XLA path's graph boundaries.
LAZY_STEPS_ENV = "TRAINER_LAZY_STEPS"
# A fault the tests inject: seconds each checkpoint file write waits (a slow store).
FAULT_CKPT_WRITE_DELAY_ENV = "TRAINER_FAULT_CKPT_WRITE_DELAY"
NXD_CPU_MODE_ENV = "NXD_CPU_MODE"  # NxD's own (trainer.model.trainium.nxd_cpu_mode)


@dataclass(frozen=True)
class PodEnv:
    """One process's environment, typed. Every field has the value the trainer assumes outside a
    pod (one process, no operator)."""

    # torchrun's, per worker
    rank: int = 0
    local_rank: int = 0
    has_local_rank: bool = False  # LOCAL_RANK set: a torchrun worker
    world_size: int = 1
    local_world_size: int | None = None  # None: not under torchrun
    group_rank: int | None = None  # the node's rank as torchrun numbers it
    torchelastic_run_id: str = ""
    torchelastic_restart_count: str = "0"
    # the operator's (trainium_api.podenv)
    node_rank: str = "0"
    training_run: str = ""  # "": not run by the operator
    training_run_created: str = ""
    attempt: str = ""  # the pod's, or the agent's order; "warm" for a parked launcher
    checkpoint_uri: str = ""
    pod_name: str = ""  # "": not in a pod (no reports)
    pod_namespace: str = "default"
    node_name: str = ""
    termination_log: str = ""  # "": nowhere to write the termination message
    preflight_devices: str = ""  # the Neuron devices the pre-flight check expects ("": no device check)
    preflight_passed: frozenset[str] = frozenset()  # node_tokens of the nodes that passed recently
    preflight_seconds: float | None = None  # what this attempt's pre-flight check took
    preflight_seconds_file: str = ""
    preflight_heartbeats: str = ""  # where the check's ranks beat (trainer.pod.liveness)
    await_start: bool = False
    warm_workers: bool = True
    busy_dir: str = ""
    neuron_logical_nc_config: str = ""
    neuron_rt_num_cores: str = "2"
    neuron_compile_cache_url: str = ""
    neuron_cc_flags: str = ""
    # the trainer's own
    precompile_steps: str | None = None  # None: not the pre-compilation pass
    lazy_steps: bool = False
    fault_ckpt_write_delay: float = 0.0
    memory_dir: str = ""
    store_cache: str = ""
    nxd_cpu_mode: str = "0"
    # Kubernetes' and the host's
    kubernetes_service_host: str = ""
    kubeconfig: str = ""
    omp_num_threads: str | None = None
    job_completion_index: int = 0  # an Indexed Job's (trainer.data.prepare)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> PodEnv:
        """This process's environment (or ``environ``), read once."""
        e = os.environ if environ is None else environ
        return cls(
            rank=_number(e, "RANK", 0),
            local_rank=_number(e, "LOCAL_RANK", 0),
            has_local_rank="LOCAL_RANK" in e,
            world_size=_number(e, "WORLD_SIZE", 1),
            local_world_size=_number(e, "LOCAL_WORLD_SIZE", None),
            group_rank=_number(e, "GROUP_RANK", None),
            torchelastic_run_id=e.get("TORCHELASTIC_RUN_ID", ""),
            torchelastic_restart_count=e.get("TORCHELASTIC_RESTART_COUNT", "0"),
            node_rank=e.get(names.NODE_RANK, "0"),
            training_run=e.get(names.TRAINING_RUN, ""),
            training_run_created=e.get(names.TRAINING_RUN_CREATED, ""),
            attempt=e.get(names.ATTEMPT, ""),
            checkpoint_uri=e.get(names.CHECKPOINT_URI, ""),
            pod_name=e.get(names.POD_NAME, ""),
            pod_namespace=e.get(names.POD_NAMESPACE, "default"),
            node_name=e.get(names.NODE_NAME, ""),
            termination_log=e.get(names.TERMINATION_LOG_ENV, ""),
            preflight_devices=e.get(names.PREFLIGHT_DEVICES_ENV, ""),
            preflight_passed=_passed_nodes(e.get(names.PREFLIGHT_PASSED_FILE_ENV, "")),
            preflight_seconds=_number(e, names.PREFLIGHT_SECONDS_ENV, None, float),
            preflight_seconds_file=e.get(names.PREFLIGHT_SECONDS_FILE_ENV, ""),
            preflight_heartbeats=e.get(names.PREFLIGHT_HEARTBEATS_ENV, ""),
            await_start=e.get(names.AWAIT_START_ENV) == "1",
            warm_workers=e.get(names.WARM_ENV, "1") != "0",
            busy_dir=e.get(names.BUSY_DIR_ENV, ""),
            neuron_logical_nc_config=e.get(names.NEURON_LOGICAL_NC_CONFIG, ""),
            neuron_rt_num_cores=e.get(names.NEURON_RT_NUM_CORES, "2"),
            neuron_compile_cache_url=e.get(names.NEURON_COMPILE_CACHE_URL, ""),
            neuron_cc_flags=e.get(names.NEURON_CC_FLAGS, ""),
            precompile_steps=e.get(PRECOMPILE_ENV),
            lazy_steps=e.get(LAZY_STEPS_ENV) == "1",
            fault_ckpt_write_delay=_number(e, FAULT_CKPT_WRITE_DELAY_ENV, 0.0, float),
            memory_dir=e.get(MEMORY_DIR_ENV, ""),
            store_cache=e.get(STORE_CACHE_ENV, ""),
            nxd_cpu_mode=e.get(NXD_CPU_MODE_ENV, "0"),
            kubernetes_service_host=e.get("KUBERNETES_SERVICE_HOST", ""),
            kubeconfig=e.get("KUBECONFIG", ""),
            omp_num_threads=e.get("OMP_NUM_THREADS"),
            job_completion_index=_number(e, "JOB_COMPLETION_INDEX", 0),
        )

    @property
    def epoch(self) -> tuple[int, int] | None:
        """This gang's (run creation, attempt), for fencing; None outside the operator."""
        if not self.attempt.isdigit():
            return None
        created = self.training_run_created
        return (int(created) if created.isdigit() else 0, int(self.attempt))

    @property
    def attempt_number(self) -> int | None:
        """The attempt these workers belong to (> 0), None outside the operator or when parked."""
        return int(self.attempt) if self.attempt.isdigit() and int(self.attempt) > 0 else None

    @property
    def precompiling(self) -> int:
        """The pre-compilation pass's steps; 0 outside it."""
        return int(self.precompile_steps or 0)


def _passed_nodes(path: str) -> frozenset[str]:
    """The tokens (trainium_api.launch.node_token) of the nodes that passed the run's pre-flight
    check recently, from the file the operator's annotation is projected to; none when there is
    no file or it cannot be read (the check then runs: trusting too little only costs its time)."""
    if not path:
        return frozenset()
    try:
        with open(path) as fh:
            return frozenset(line.strip() for line in fh if line.strip())
    except OSError:
        return frozenset()


def _number(environ: Mapping[str, str], name: str, default, kind=int):
    """``name``'s value as a number; unset or empty: ``default``. A value that is no number is
    said and ignored, never raised: these names are not the pod contract's, so a run's spec.env
    may set them, and torchrun sets its own for the workers, where they are read."""
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        print(f"trainer: ignoring {name}={raw[:40]!r}: not a number", file=sys.stderr, flush=True)
        return default


def child_environ(**extra: str) -> dict[str, str]:
    """The environment a child process starts with: this process's, with ``extra`` set."""
    return {**os.environ, **extra}
