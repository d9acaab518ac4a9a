"""From a written config to a complete one, the steps around ``load.build`` that the trainer's
config loader (trainer.config) and the operator's spec validation (trainium_operator.spec)
share: :func:`apply_preset` before building (the model preset expanded), :func:`finish`
after (cross-field rules, derived defaults).
"""

from __future__ import annotations

from typing import Any, Mapping

from .fields import ConfigError, camel
from .spec import PRESETS, ModelConfig, RunConfig


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
