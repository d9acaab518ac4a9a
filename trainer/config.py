"""The trainer's configuration: load a YAML file (or the dict the operator renders) into the
typed groups of the TrainingRun API (trainium_api.spec), with presets and ``key=value``
overrides. The YAML file uses the API's camelCase keys: ``training.globalBatchSize`` is
``TrainingConfig.global_batch_size``. This module imports no torch: the operator uses the same
code to validate a TrainingRun before anything is scheduled.

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


def apply_preset(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with its model group's preset expanded: the preset's shape, then the fields given."""
    model = raw.get("model") or {}
    if not isinstance(model, Mapping):
        raise ConfigError("model", f"must be a mapping, got {type(model).__name__}")
    model = dict(model)
    preset = model.get("preset", ModelConfig.preset)
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError("model.preset", f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    merged = {camel(k): v for k, v in PRESETS[preset].items()}
    merged.update(model)
    merged["preset"] = preset
    return {**raw, "model": merged}


def finish(cfg: RunConfig) -> RunConfig:
    """Check the cross-field rules and fill in what follows from other fields."""
    cfg.validate()
    if not cfg.data.tokenizer and cfg.init.is_hf():  # the model's own tokenizer
        cfg.data.tokenizer = cfg.init.from_.rstrip("/") + "/tokenizer.json"
    return cfg


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
