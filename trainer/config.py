"""The trainer's configuration: load a YAML file (or the dict the operator renders) into the
typed groups of the TrainingRun API (trainium_api.spec), with presets and ``key=value``
overrides. The YAML file uses the API's camelCase keys: ``training.globalBatchSize`` is
``TrainingConfig.global_batch_size``. This module imports no torch (the trainer checks its
config before it loads torch). The preset and finishing steps are trainium_api.presets, which
the operator's spec validation runs too.

Every validation error is a :class:`ConfigError` that names the field, e.g.
``parallelism.tensor: 3 does not divide model.numHeads (32)``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

import yaml

from trainium_api.fields import ConfigError, camel
from trainium_api.layout import Layout, check_backend, derive_layout
from trainium_api.load import build, to_dict
from trainium_api.presets import apply_preset, finish
from trainium_api.spec import (
    BACKENDS,
    PRECISIONS,
    PRESETS,
    CheckpointConfig,
    DataConfig,
    DataSource,
    HealthConfig,
    InitConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)

__all__ = ["BACKENDS", "PRECISIONS", "PRESETS", "CheckpointConfig", "ConfigError", "DataConfig", "DataSource",
           "HealthConfig", "InitConfig", "Layout", "LoggingConfig", "ModelConfig", "ParallelConfig", "RunConfig",
           "TrainingConfig", "check_backend", "derive_layout", "from_dict", "load", "to_dict"]


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: ``3e-4`` is a number (YAML 1.1, and so
    PyYAML, read it as a string unless written ``3.0e-4``), as kubectl and the API server read
    the same manifest."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789"))


def _set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(dotted, "cannot set a field inside a non-mapping")
    node[parts[-1]] = value


def from_dict(raw: Mapping[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build and validate a RunConfig from its camelCase dict form plus ``key=value`` overrides."""
    raw = json.loads(json.dumps(raw or {}))  # deep copy, plain types
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "override must look like group.field=value")
        key, text = item.split("=", 1)
        key = ".".join(camel(p) if "_" in p else p for p in key.strip().split("."))
        _set_path(raw, key, yaml.load(text, Loader=YamlLoader) if text.strip() else "")
    return finish(build(RunConfig, apply_preset(raw), ""))


def load(path: str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a YAML config file (local path or fsspec URI)."""
    import fsspec

    try:
        with fsspec.open(path, "r") as fh:
            raw = yaml.load(fh, Loader=YamlLoader) or {}
    except FileNotFoundError:
        raise ConfigError("--config", f"file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("--config", f"{path} is not valid YAML: {exc}") from None
    return from_dict(raw, overrides)
