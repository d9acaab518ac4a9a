"""The TrainingRun spec: parse, default, validate and derive. Pure; no API calls.

The trainer's groups (model, parallelism, training, data, checkpoint, health, logging) are the
trainer's own dataclasses (trainer.config), so one schema serves the CRD, the operator and the
trainer. The operator adds the placement and fault-tolerance groups defined here. Every error
is a ConfigError naming the field, e.g. ``spec.parallelism.tensor: 3 does not divide ...``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from trainer import ckpt_store, watch
from trainer.config import (_GROUPS, CheckpointConfig, ConfigError, Layout, LoggingConfig, RunConfig, _build,
                            camel, derive_layout, from_dict, yaml_key)

API_GROUP, API_VERSION, KIND, PLURAL = "trainium.dev", "v1alpha1", "TrainingRun", "trainingruns"

# Instance types: NeuronCores (= trainer processes) per node and the extended resources a pod asks for.
INSTANCE_TYPES: dict[str, dict[str, Any]] = {
    "trn1.32xlarge": {"processes": 32, "resources": {"aws.amazon.com/neuron": "16", "vpc.amazonaws.com/efa": "8"},
                      "neuron": True},
    "trn1n.32xlarge": {"processes": 32, "resources": {"aws.amazon.com/neuron": "16", "vpc.amazonaws.com/efa": "16"},
                       "neuron": True},
    "cpu": {"processes": 1, "resources": {}, "neuron": False},
    "gpu": {"processes": 8, "resources": {"nvidia.com/gpu": "8"}, "neuron": False},
}

DEFAULT_TRAINER_SA = "trainium-trainer"
# The pod contract's variables (docs/architecture.md 3.2; plan.pod sets them): spec.env may not override them.
CONTRACT_ENV = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE", "TRAINING_RUN", "ATTEMPT",
                "CHECKPOINT_URI", "RESUME", "NEURON_COMPILE_CACHE_URL", "POD_NAME", "POD_NAMESPACE")
ENV_SOURCES = ("secretKeyRef", "configMapKeyRef", "fieldRef")  # the valueFrom kinds spec.env accepts
CAUSES = ("application", "node", "neuron-device", "hang", "eviction", "scheduling")
# Causes the job itself may be behind; the others are the infrastructure's, with their own budgets.
JOB_CAUSES = ("application", "hang")


@dataclass
class RestartBudget:
    application: int = 5
    """Restarts after a rank crashed (non-fatal exit code)."""
    node: int = 10
    """Restarts after a node went NotReady, unreachable or away."""
    neuron_device: int = 10
    """Restarts after a NeuronHealth error or lost Neuron devices."""
    hang: int = 3
    """Restarts after no progress for the hang timeout."""
    eviction: int = 10
    """Restarts after a pod was evicted or deleted from outside."""
    scheduling: int = 3
    """Restarts after the gang could not be scheduled within the schedule timeout."""

    def for_cause(self, cause: str) -> int:
        return getattr(self, cause.replace("-", "_"))


@dataclass
class FaultToleranceConfig:
    restart_budget: RestartBudget = field(default_factory=RestartBudget)
    """Restarts allowed per cause within budgetWindowMinutes; one more and the run fails."""
    budget_window_minutes: float = 60.0
    backoff_seconds: float = 0.0
    """Wait before the first restart; doubles with each restart in the window (0 = none)."""
    max_backoff_seconds: float = 300.0
    hang_timeout_seconds: str = "auto"
    """Seconds without step progress in any pod before the gang is restarted, or 'auto':
    hangTimeoutFactor x the slowest observed step time, at least hangTimeoutFloorSeconds."""
    hang_timeout_factor: float = 10.0
    hang_timeout_floor_seconds: float = 600.0
    startup_timeout_seconds: float = 3600.0
    """Time from gang Running to the first progress report (compilation and loading)."""
    schedule_timeout_seconds: float = 600.0
    """Time for the whole gang to be scheduled before it counts as a scheduling failure."""
    quarantine: bool = True
    """Taint and label a node whose failure caused a restart, so no attempt lands there again."""
    max_quarantined_nodes: int = 0
    """Beyond this many quarantined nodes the run fails as 'cluster unhealthy' (0 = nodes / 4, at least 1)."""
    no_progress_restarts: int = 3
    """Fail after this many consecutive restarts for application errors or hangs without the
    checkpoint step advancing (node, Neuron device, eviction and scheduling failures are the
    infrastructure's: they spend their own budgets and neither count nor break the streak)."""
    teardown_grace_seconds: float = 30.0
    """Grace period for a gang's pods to exit on SIGTERM before they are force-deleted."""

    def validate(self) -> None:
        h = self.hang_timeout_seconds
        if h != "auto":
            try:
                if float(h) <= 0:
                    raise ValueError
            except (TypeError, ValueError):
                raise ConfigError("spec.faultTolerance.hangTimeoutSeconds",
                                  f"must be 'auto' or a positive number of seconds, got {h!r}") from None
        for name in ("budget_window_minutes", "hang_timeout_factor", "hang_timeout_floor_seconds",
                     "startup_timeout_seconds", "schedule_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"spec.faultTolerance.{camel(name)}", "must be positive")
        for name in ("backoff_seconds", "max_backoff_seconds", "teardown_grace_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"spec.faultTolerance.{camel(name)}", "must not be negative")
        if self.no_progress_restarts < 1:
            raise ConfigError("spec.faultTolerance.noProgressRestarts", "must be at least 1")
        for f in dataclasses.fields(RestartBudget):
            if getattr(self.restart_budget, f.name) < 0:
                raise ConfigError(f"spec.faultTolerance.restartBudget.{camel(f.name)}", "must not be negative")


@dataclass
class CompileCacheConfig:
    path: str = "/var/tmp/neuron-compile-cache"
    """Node-local directory (a hostPath) for the Neuron persistent compile cache. Never a shared
    file system: it chokes at scale."""
    precompile_steps: int = 0
    """Before each attempt trains, run neuron_parallel_compile over this many steps: it extracts
    every graph without executing it and compiles them all in parallel into the cache (0: off;
    Neuron backend only). Costs one graph-extraction pass per attempt; saves the serial
    just-in-time compilation of the first steps on nodes whose cache is cold."""

    def validate(self) -> None:
        if self.precompile_steps < 0:
            raise ConfigError("compileCache.precompileSteps", "must not be negative")


TRAINER_KINDS = ("builtin", "command")
# A command trainer's checkpoint layout follows from its progress format unless given.
LAYOUT_OF_FORMAT = {"nxd": "nxd", "nxdt": "nxdt"}
# With a command, the only fields of our trainer's groups the operator still reads.
COMMAND_TRAINER_FIELDS = {"checkpoint": ("uri",), "logging": ("progressIntervalSeconds",)}


@dataclass
class TrainerConfig:
    kind: str = "builtin"
    """builtin: this project's trainer (python -m trainer), configured by the model, parallelism,
    training, data, checkpoint, health, logging and init groups. command: your own script (e.g. an
    NxD example or NxD Training's training_orchestrator.py) run unmodified under torchrun with the
    same pod contract; the operator reads its progress from its log and its checkpoints from
    checkpoint.uri."""
    command: list[str] = field(default_factory=list)
    """With kind command: what torchrun runs in every process, a Python script or -m module,
    then its arguments. $(VAR) references to the pod's environment are expanded
    (e.g. --checkpoint_dir $(CHECKPOINT_URI))."""
    working_dir: str = ""
    """With kind command: the container's working directory (default: the image's)."""
    progress_format: str = ""
    """With kind command: how progress is read from the log. nxd: NxD examples' `LOG ... (epoch,
    step) step_loss : ...` lines; nxdt: NxD Training's progress bar (global_step=...); regex:
    progressRegex."""
    progress_regex: str = ""
    """With progressFormat regex: a Python regular expression with the named group step and
    optionally loss and throughput (samples per second), searched in every log line."""
    checkpoint_layout: str = ""
    """With kind command: how checkpoints under checkpoint.uri are found (trainer, nxd, nxdt;
    default: the progress format's, nxd or nxdt). With nxdt the operator appends
    exp_manager.resume_from_checkpoint=<newest complete checkpoint> to the command on every start."""
    tokens_per_sample: int = 0
    """With kind command: sequence length, so tokens per second = samples per second x this (0: not reported)."""
    samples_per_step: int = 0
    """With kind command: global batch size in samples, so status.tokens = step x samplesPerStep x
    tokensPerSample (0: not reported)."""

    @property
    def is_command(self) -> bool:
        return self.kind == "command"

    @property
    def layout(self) -> str:
        """The checkpoint layout the operator reads."""
        return self.checkpoint_layout or LAYOUT_OF_FORMAT.get(self.progress_format, "trainer")

    def validate(self) -> None:
        if self.kind not in TRAINER_KINDS:
            raise ConfigError("trainer.kind", f"must be one of {', '.join(TRAINER_KINDS)}, got {self.kind!r}")
        if self.checkpoint_layout and self.checkpoint_layout not in ckpt_store.LAYOUTS:
            raise ConfigError("trainer.checkpointLayout",
                              f"must be one of {', '.join(ckpt_store.LAYOUTS)}, got {self.checkpoint_layout!r}")
        for name in ("tokens_per_sample", "samples_per_step"):
            if getattr(self, name) < 0:
                raise ConfigError(f"trainer.{camel(name)}", "must not be negative")
        if not self.is_command:
            for name in ("command", "working_dir", "progress_format", "progress_regex", "checkpoint_layout"):
                if getattr(self, name):
                    raise ConfigError(f"trainer.{camel(name)}", "needs trainer.kind: command")
            return
        if not self.command or not self.command[0].strip():
            raise ConfigError("trainer.command", "is required with trainer.kind command: the script (or -m "
                                                 "module) torchrun runs, then its arguments")
        if self.progress_format not in watch.PROGRESS_FORMATS:
            raise ConfigError("trainer.progressFormat", f"must be one of {', '.join(watch.PROGRESS_FORMATS)} "
                                                        f"with trainer.kind command, got {self.progress_format!r}")
        if self.progress_format == "regex":
            why = watch.check_regex(self.progress_regex)
            if why:
                raise ConfigError("trainer.progressRegex", why)
            if not self.checkpoint_layout:
                raise ConfigError("trainer.checkpointLayout", "is required with progressFormat regex "
                                                              f"({', '.join(ckpt_store.LAYOUTS)})")
        elif self.progress_regex:
            raise ConfigError("trainer.progressRegex", "needs progressFormat regex")


@dataclass
class TrainingRunSpec:
    image: str
    nodes: int
    instance_type: str
    processes_per_node: int
    run: RunConfig
    fault_tolerance: FaultToleranceConfig
    compile_cache: CompileCacheConfig
    suspend: bool
    service_account: str
    layout: Layout | None
    """Our trainer's parallel layout; None with a command trainer (its layout is its own)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    env: list[dict] = field(default_factory=list)
    """Extra container environment (Kubernetes EnvVar objects), after the contract's."""
    volumes: list[dict] = field(default_factory=list)
    """Extra pod volumes (Kubernetes Volume objects), e.g. the shared file system a script reads."""
    volume_mounts: list[dict] = field(default_factory=list)
    """Where the trainer container mounts them (Kubernetes VolumeMount objects)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def tokens_per_step(self) -> int | None:
        if self.layout is not None:
            return self.layout.tokens_per_step
        return (self.trainer.samples_per_step * self.trainer.tokens_per_sample) or None

    def quarantine_limit(self) -> int:
        return self.fault_tolerance.max_quarantined_nodes or max(1, self.nodes // 4)


_TRAINER_GROUPS = ("model", "parallelism", "training", "data", "checkpoint", "health", "logging", "init")
_OPERATOR_FIELDS = ("image", "nodes", "instanceType", "processesPerNode", "faultTolerance", "compileCache",
                    "suspend", "serviceAccountName", "backend", "env", "trainer", "volumes", "volumeMounts")
# Volumes and mount paths of the pod contract (plan.pod); spec.volumes may not reuse them.
CONTRACT_VOLUMES = ("config", "dshm", "compile-cache")
CONTRACT_MOUNTS = ("/etc/trainium", "/dev/shm")


def _prefix(err: ConfigError) -> ConfigError:
    path = err.field if err.field.startswith("spec.") else f"spec.{err.field}"
    return ConfigError(path, err.message)


def parse(spec: Mapping[str, Any] | None) -> TrainingRunSpec:
    """Parse and validate a TrainingRun spec (its camelCase dict). Raises ConfigError."""
    if not isinstance(spec, Mapping):
        raise ConfigError("spec", "must be an object")
    unknown = sorted(set(spec) - set(_TRAINER_GROUPS) - set(_OPERATOR_FIELDS))
    if unknown:
        raise ConfigError(f"spec.{unknown[0]}", "unknown field")
    image = spec.get("image")
    if not isinstance(image, str) or not image:
        raise ConfigError("spec.image", "is required (the trainer container image)")
    nodes = spec.get("nodes")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError("spec.nodes", f"must be an integer of at least 1, got {nodes!r}")
    itype = spec.get("instanceType", "trn1.32xlarge")
    if not isinstance(itype, str) or itype not in INSTANCE_TYPES:
        raise ConfigError("spec.instanceType", f"must be one of {', '.join(INSTANCE_TYPES)}, got {itype!r}")
    ppn = spec.get("processesPerNode", INSTANCE_TYPES[itype]["processes"])
    if isinstance(ppn, bool) or not isinstance(ppn, int) or ppn < 1:
        raise ConfigError("spec.processesPerNode", f"must be an integer of at least 1, got {ppn!r}")
    trainer_part = {k: spec[k] for k in _TRAINER_GROUPS if k in spec}
    backend = spec.get("backend", "neuron" if INSTANCE_TYPES[itype]["neuron"] else "cpu")
    neuron_type = INSTANCE_TYPES[itype]["neuron"]
    if neuron_type and ppn > INSTANCE_TYPES[itype]["processes"]:
        raise ConfigError("spec.processesPerNode", f"at most {INSTANCE_TYPES[itype]['processes']} on {itype} "
                                                   f"(one process per NeuronCore), got {ppn}")
    if (backend == "neuron") != neuron_type and backend != "auto":
        raise ConfigError("spec.backend", f"{backend} does not run on instance type {itype}"
                                          + ("" if neuron_type else " (it has no NeuronCores)"))
    try:
        trainer = _build(TrainerConfig, spec.get("trainer") or {}, "trainer")
        trainer.validate()
        if trainer.is_command:
            run, layout = _command_run(trainer_part, backend), None
        else:
            run = from_dict({**trainer_part, "backend": backend})
            layout = derive_layout(nodes * ppn, run.model, run.parallelism, run.training, backend, ppn)
        ft = _build(FaultToleranceConfig, _normalise_ft(spec.get("faultTolerance") or {}), "faultTolerance")
        ft.validate()
        cache = _build(CompileCacheConfig, spec.get("compileCache") or {}, "compileCache")
        cache.validate()
    except ConfigError as err:
        raise _prefix(err) from None
    if cache.precompile_steps and trainer.is_command:
        raise ConfigError("spec.compileCache.precompileSteps", "runs the builtin trainer's steps; with trainer.kind "
                                                               "command run neuron_parallel_compile in your command")
    if cache.precompile_steps and backend != "neuron":
        raise ConfigError("spec.compileCache.precompileSteps", f"needs the neuron backend, got {backend}")
    if not run.checkpoint.uri:
        raise ConfigError("spec.checkpoint.uri", "is required: a restarted gang resumes from it")
    suspend = spec.get("suspend", False)
    if not isinstance(suspend, bool):
        raise ConfigError("spec.suspend", f"must be true or false, got {suspend!r}")
    return TrainingRunSpec(image=image, nodes=nodes, instance_type=itype, processes_per_node=ppn, run=run,
                           fault_tolerance=ft, compile_cache=cache, suspend=suspend,
                           service_account=spec.get("serviceAccountName", DEFAULT_TRAINER_SA), layout=layout,
                           trainer=trainer, env=_env(spec.get("env", [])),
                           **_volumes(spec.get("volumes", []), spec.get("volumeMounts", []), cache.path))


def _command_run(groups: Mapping[str, Any], backend: str) -> RunConfig:
    """A command trainer's RunConfig: only the fields the operator reads (COMMAND_TRAINER_FIELDS).
    Any other field of our trainer's groups set to other than its default would be silently
    ignored, so it is refused (defaults are accepted: the API server fills them in)."""
    built = {}
    for group, value in groups.items():
        cls = _GROUPS[group]
        obj = built[group] = _build(cls, value or {}, group)
        allowed = COMMAND_TRAINER_FIELDS.get(group, ())
        default = cls()
        for f in dataclasses.fields(cls):
            if yaml_key(f.name) not in allowed and getattr(obj, f.name) != getattr(default, f.name):
                where = f"{group}.{yaml_key(f.name)}" if allowed else group
                raise ConfigError(where, "is read only by the builtin trainer; with trainer.kind command, "
                                  + (f"only {', '.join(allowed)} is read here" if allowed
                                     else "configure the script in trainer.command"))
    return RunConfig(checkpoint=built.get("checkpoint", CheckpointConfig()),
                     logging=built.get("logging", LoggingConfig()), backend=backend)


def checkpoint_layout(raw_spec: Mapping[str, Any] | None) -> str:
    """The checkpoint layout of a spec that may be invalid (the handler lists checkpoints before
    reconcile parses): the trainer group's, else ours."""
    try:
        trainer = _build(TrainerConfig, (raw_spec or {}).get("trainer") or {}, "trainer")
    except (ConfigError, TypeError, AttributeError):
        return "trainer"
    return trainer.layout if trainer.is_command and trainer.layout in ckpt_store.LAYOUTS else "trainer"


_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")


def _volumes(volumes: Any, mounts: Any, cache_path: str) -> dict:
    """spec.volumes (each a Kubernetes Volume with a name and one source, passed through) and
    spec.volumeMounts (name, mountPath, optional readOnly, subPath) of the trainer container."""
    if not isinstance(volumes, list):
        raise ConfigError("spec.volumes", "must be a list of Kubernetes volumes ({name, <source>})")
    if not isinstance(mounts, list):
        raise ConfigError("spec.volumeMounts", "must be a list of {name, mountPath}")
    names: set[str] = set()
    for i, vol in enumerate(volumes):
        where = f"spec.volumes[{i}]"
        name = vol.get("name") if isinstance(vol, Mapping) else None
        if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name):
            raise ConfigError(f"{where}.name", "must be a DNS label (lower case letters, digits, '-')")
        if name in CONTRACT_VOLUMES or name in names:
            raise ConfigError(f"{where}.name", f"{name} is " + ("the operator's" if name in CONTRACT_VOLUMES
                                                                else "listed twice"))
        if len(vol) != 2:
            raise ConfigError(where, "needs exactly one volume source next to its name (e.g. persistentVolumeClaim)")
        names.add(name)
    reserved = (*CONTRACT_MOUNTS, cache_path)
    paths: set[str] = set()
    for i, mount in enumerate(mounts):
        where = f"spec.volumeMounts[{i}]"
        if not isinstance(mount, Mapping) or mount.get("name") not in names:
            raise ConfigError(f"{where}.name", "must name one of spec.volumes")
        extra = sorted(set(mount) - {"name", "mountPath", "readOnly", "subPath"})
        if extra:
            raise ConfigError(f"{where}.{extra[0]}", "unknown field")
        path = mount.get("mountPath")
        if not isinstance(path, str) or not path.startswith("/"):
            raise ConfigError(f"{where}.mountPath", "must be an absolute path")
        if path.rstrip("/") in reserved or path in paths:
            raise ConfigError(f"{where}.mountPath", f"{path} is " + ("the operator's" if path.rstrip("/") in reserved
                                                                     else "mounted twice"))
        paths.add(path)
    return {"volumes": [dict(v) for v in volumes], "volume_mounts": [dict(m) for m in mounts]}


def _env(raw: Any) -> list[dict]:
    """spec.env: Kubernetes EnvVars with a value or a valueFrom (secretKeyRef, configMapKeyRef:
    name and key; fieldRef: fieldPath), names unique and none of the contract's."""
    if not isinstance(raw, list):
        raise ConfigError("spec.env", "must be a list of {name, value} or {name, valueFrom}")
    seen: set[str] = set()
    out = []
    for i, item in enumerate(raw):
        where = f"spec.env[{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str) or not _ENV_NAME.fullmatch(item["name"]):
            raise ConfigError(f"{where}.name", "must be a valid environment variable name")
        name = item["name"]
        if name in CONTRACT_ENV:
            raise ConfigError(f"{where}.name", f"{name} is set by the operator (the pod contract) and cannot be overridden")
        if name in seen:
            raise ConfigError(f"{where}.name", f"{name} is listed twice")
        seen.add(name)
        extra = sorted(set(item) - {"name", "value", "valueFrom"})
        if extra:
            raise ConfigError(f"{where}.{extra[0]}", "unknown field")
        if ("value" in item) == ("valueFrom" in item):
            raise ConfigError(where, "needs exactly one of value or valueFrom")
        if "value" in item and not isinstance(item["value"], str):
            raise ConfigError(f"{where}.value", f"must be a string, got {item['value']!r}")
        if "valueFrom" in item:
            vf = item["valueFrom"]
            kinds = sorted(vf) if isinstance(vf, Mapping) else []
            if len(kinds) != 1 or kinds[0] not in ENV_SOURCES:
                raise ConfigError(f"{where}.valueFrom", f"must have exactly one of {', '.join(ENV_SOURCES)}")
            ref = vf[kinds[0]]
            needed = ("fieldPath",) if kinds[0] == "fieldRef" else ("name", "key")
            for key in needed:
                if not isinstance(ref, Mapping) or not isinstance(ref.get(key), str) or not ref[key]:
                    raise ConfigError(f"{where}.valueFrom.{kinds[0]}.{key}", "is required")
        out.append(dict(item))
    return out


def _normalise_ft(raw: Any) -> dict:
    if not isinstance(raw, Mapping):
        raise ConfigError("faultTolerance", f"must be an object, got {raw!r}")
    raw = dict(raw)
    if "restartBudget" in raw:
        budget = raw["restartBudget"]
        if not isinstance(budget, Mapping):
            raise ConfigError("faultTolerance.restartBudget", "must be an object")
        raw["restartBudget"] = _build(RestartBudget, budget, "faultTolerance.restartBudget")
    if "hangTimeoutSeconds" in raw and not isinstance(raw["hangTimeoutSeconds"], str):
        raw["hangTimeoutSeconds"] = str(raw["hangTimeoutSeconds"])
    return raw
