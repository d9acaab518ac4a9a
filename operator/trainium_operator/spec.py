"""The TrainingRun spec: parse, default, validate and derive. Pure; no API calls.

The fields, their types, constraints and defaults are the API's (trainium_api.spec); this
module applies the rules that span groups or need the instance type (processes per node,
backend, the parallel layout, the pod contract's reserved names). Every error is a
ConfigError naming the field, e.g. ``spec.parallelism.tensor: 3 does not divide ...``.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any, Mapping

from trainium_api.fields import ConfigError, api_fields
from trainium_api.layout import derive_layout
from trainium_api.load import build
from trainium_api.presets import apply_preset, finish

from . import pod_template
from .containers import DNS_SUBDOMAIN, check_env, check_mount_path
from trainium_api.launch import PREFLIGHT_PASSED_VOLUME
from trainium_api.spec import (
    CONTRACT_ADDED_LATER,
    CONTRACT_MOUNTS,
    COMMAND_TRAINER_FIELDS,
    CONTRACT_VOLUMES,
    GROUPS,
    INSTANCE_TYPES,
    TRAINER_IDENTITY,
    check_store_uri,
    TrainingRunSpec,
)




def _prefix(err: ConfigError) -> ConfigError:
    path = err.field if err.field.startswith("spec.") else f"spec.{err.field}"
    return ConfigError(path, err.message)


def parse(spec: Mapping[str, Any] | None, accepted_before: bool = False) -> TrainingRunSpec:
    """Parse and validate a TrainingRun spec (its camelCase dict). Raises ConfigError.
    ``accepted_before``: a run the operator accepted before (observer.spec_in_force supervises it
    with the spec it has): the mount-path rules newer than it are not applied, so that an
    upgrade never leaves a training run unsupervised for a path it was started with."""
    if not isinstance(spec, Mapping):
        raise ConfigError("spec", "must be an object")
    try:
        s = build(TrainingRunSpec, apply_preset(spec), "spec")
    except ConfigError as err:
        raise _prefix(err) from None
    itype = INSTANCE_TYPES[s.instance_type]
    neuron_type = itype["neuron"]
    if itype.get("dra_only") and s.resources == "DevicePlugin":
        raise ConfigError("spec.resources", f"{s.instance_type} takes its devices through DRA only (DRA or Auto), "
                                            "got DevicePlugin")
    if s.processes_per_node is None:
        if itype["processes"] is None:
            raise ConfigError("spec.processesPerNode", f"required on {s.instance_type} (ranks a node: one per "
                                                       "logical NeuronCore of the instance)")
        s.processes_per_node = itype["processes"]
    if neuron_type and itype["processes"] is not None and s.processes_per_node > itype["processes"]:
        raise ConfigError("spec.processesPerNode", f"at most {itype['processes']} on {s.instance_type} "
                                                   f"(one process per NeuronCore), got {s.processes_per_node}")
    if s.backend is None:
        s.backend = "neuron" if neuron_type else "cpu"
    if (s.backend == "neuron") != neuron_type and s.backend != "auto":
        raise ConfigError("spec.backend", f"{s.backend} does not run on instance type {s.instance_type}"
                          + ("" if neuron_type else " (it has no NeuronCores)"))
    try:
        s.trainer.validate()
        if s.trainer.is_command:
            _command_run(s, spec)
        else:
            finish(s)
            s.layout = derive_layout(s.world_size, s.model, s.parallelism, s.training, s.backend,
                                     s.processes_per_node)
        s.fault_tolerance.validate()
        s.compile_cache.validate()
    except ConfigError as err:
        raise _prefix(err) from None
    if s.compile_cache.precompile_steps and s.trainer.is_command:
        raise ConfigError("spec.compileCache.precompileSteps", "runs the builtin trainer's steps; with trainer.kind "
                                                               "command run neuron_parallel_compile in your command")
    if s.compile_cache.precompile_steps and s.backend != "neuron":
        raise ConfigError("spec.compileCache.precompileSteps", f"needs the neuron backend, got {s.backend}")
    if not s.checkpoint.uri:
        raise ConfigError("spec.checkpoint.uri", "is required: a restarted gang resumes from it")
    if s.fault_tolerance.spares and not s.in_place_on():
        raise ConfigError("spec.faultTolerance.spares", "needs in-place restarts (faultTolerance.inPlaceRestarts "
                          "above 0, and the builtin trainer): a spare takes a lost pod's place while the other "
                          "pods restart in place")
    if s.fault_tolerance.spares > s.nodes:
        raise ConfigError("spec.faultTolerance.spares", f"at most spec.nodes ({s.nodes}), got "
                          f"{s.fault_tolerance.spares}")
    check_checkpoint_uri(s.checkpoint.uri)
    if s.service_account_name is not None and not DNS_SUBDOMAIN.fullmatch(s.service_account_name):
        # found by the cluster tier's spec fuzzing: the RoleBinding naming it could never be made
        raise ConfigError("spec.serviceAccountName", f"{s.service_account_name!r} is not a ServiceAccount name "
                          "(lowercase letters, digits, '-' and '.', at most 253 characters)")
    if (s.service_account_name or "").startswith(TRAINER_IDENTITY + "-"):
        raise ConfigError("spec.serviceAccountName", f"{s.service_account_name}: names {TRAINER_IDENTITY}-* are the "
                          "operator's per-run trainer identities (another run's would reach its pods); leave the "
                          "field unset for this run's own")
    check_env(s.env, allowed=CONTRACT_ADDED_LATER if accepted_before else ())
    if not accepted_before:
        check_mount_path(s.compile_cache.path, "spec.compileCache.path")
    _check_volumes(s.volumes, s.volume_mounts, s.compile_cache.path, strict_paths=not accepted_before,
                   allowed=CONTRACT_ADDED_LATER if accepted_before else ())
    pod_template.check(s.pod_template, s.instance_type if neuron_type else None, pod_volume_names(s),
                       accepted_before)
    return s


def pod_volume_names(s: TrainingRunSpec) -> set[str]:
    """The volumes of the run's pods (plan.pod): the operator's and spec.volumes."""
    # (not the pre-flight list's: a pod has it only on some attempts)
    ours = {v for v in CONTRACT_VOLUMES if (v != "config" or not s.trainer.is_command) and v != PREFLIGHT_PASSED_VOLUME}
    return ours | {v["name"] for v in s.volumes}


def check_checkpoint_uri(uri: str) -> None:
    check_store_uri("spec.checkpoint.uri", uri)


def _command_run(s: TrainingRunSpec, raw: Mapping[str, Any]) -> None:
    """A command trainer reads only COMMAND_TRAINER_FIELDS of our trainer's groups. Any other
    field set to other than its default would be silently ignored, so it is refused (defaults
    are accepted: the API server fills them in). The model group is compared as given, before
    its preset is expanded."""
    for group, cls in GROUPS.items():
        if group not in raw:
            continue
        obj = build(cls, raw[group] or {}, group)
        allowed = COMMAND_TRAINER_FIELDS.get(group, ())
        default = cls()
        for f in api_fields(cls):
            if f.key not in allowed and getattr(obj, f.name) != getattr(default, f.name):
                where = f"{group}.{f.key}" if allowed else group
                raise ConfigError(where, "is read only by the builtin trainer; with trainer.kind command, "
                                  + (f"only {', '.join(allowed)} is read here" if allowed
                                     else "configure the script in trainer.command"))



def _check_volumes(volumes: list[dict], mounts: list[dict], cache_path: str, strict_paths: bool = True,
                   allowed: tuple[str, ...] = ()) -> None:
    """spec.volumes (each a Kubernetes Volume with a name and one source, passed through) and
    spec.volumeMounts (name, mountPath, optional readOnly, subPath) of the trainer container.
    ``allowed``: contract names and paths a run accepted before they were reserved may keep."""
    names: set[str] = set()
    for i, vol in enumerate(volumes):
        where = f"spec.volumes[{i}]"
        name = vol["name"]
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name):
            raise ConfigError(f"{where}.name", "must be a DNS label (lower case letters, digits, '-')")
        if (name in CONTRACT_VOLUMES and name not in allowed) or name in names:
            raise ConfigError(f"{where}.name", f"{name} is " + ("the operator's" if name in CONTRACT_VOLUMES
                                                                else "listed twice"))
        if len(vol) != 2:
            raise ConfigError(where, "needs exactly one volume source next to its name (e.g. persistentVolumeClaim)")
        names.add(name)
    paths: set[str] = set()
    for i, mount in enumerate(mounts):
        where = f"spec.volumeMounts[{i}]"
        if mount["name"] not in names:
            raise ConfigError(f"{where}.name", "must name one of spec.volumes")
        path = mount["mountPath"]
        if strict_paths:
            check_mount_path(path, f"{where}.mountPath", taken=(cache_path,))
        elif not path.startswith("/") or path.rstrip("/") in (*(m for m in CONTRACT_MOUNTS if m not in allowed),
                                                              cache_path):
            raise ConfigError(f"{where}.mountPath", f"{path} is not absolute, or is the operator's")
        if posixpath.normpath(path) in paths:
            raise ConfigError(f"{where}.mountPath", f"{path} is mounted twice")
        paths.add(posixpath.normpath(path))
