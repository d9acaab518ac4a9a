"""Enumerations a user writes in YAML: Kubernetes' CamelCase words, none a YAML 1.1 boolean, the
older words still accepted (fields.Aliases)."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from trainium_api.fields import Aliases, ConfigError, api_fields
from trainium_api.load import build
from trainium_api.schema import spec_schema
from trainium_api.spec import CheckpointConfig, FaultToleranceConfig, RunConfig, TrainingRunSpec
from trainium_operator.spec import parse

from .passes import SPEC

# what a YAML 1.1 reader (kubectl's, PyYAML's) turns into a boolean when it is not quoted
YAML_BOOLEANS = {w for word in ("y", "yes", "n", "no", "true", "false", "on", "off")
                 for w in (word, word.capitalize(), word.upper())}


def _enum_fields(cls: type, path: str = ""):
    for f in api_fields(cls):
        if f.enum is not None:
            yield f"{path}{f.key}", f
        for tp in (f.type, *typing.get_args(f.type)):
            if dataclasses.is_dataclass(tp) and not getattr(tp, "KUBE_OBJECT", False):
                yield from _enum_fields(tp, f"{path}{f.key}.")


def test_no_enumeration_word_is_a_yaml_boolean():
    for path, f in _enum_fields(TrainingRunSpec):
        assert not set(f.enum) & YAML_BOOLEANS, f"spec.{path}: {f.enum} (an unquoted word would be a boolean)"
        # the default is one of the current words, and the older words only stand for current ones
        aliases = f.mark(Aliases)
        if aliases is not None:
            assert f.default in f.enum, path
            assert {new for _, new in aliases.words} <= set(f.enum), path


@pytest.mark.parametrize("field, words", [
    ("faultTolerance.preflight", {"Auto": "Auto", "Enabled": "Enabled", "Disabled": "Disabled",
                                  "auto": "Auto", "on": "Enabled", "off": "Disabled"}),
    ("faultTolerance.stragglers", {"Report": "Report", "Replace": "Replace", "Disabled": "Disabled",
                                   "report": "Report", "replace": "Replace", "off": "Disabled"}),
    ("checkpoint.memory", {"Auto": "Auto", "Peers": "Peers", "Disabled": "Disabled",
                           "auto": "Auto", "peers": "Peers", "off": "Disabled"}),
])
def test_current_and_older_words_load_as_the_current_word(field, words):
    group, key = field.split(".")
    for written, meant in words.items():
        raw = {**SPEC, group: {**SPEC.get(group, {}), key: written}}
        group_of = parse(raw).fault_tolerance if group == "faultTolerance" else parse(raw).checkpoint
        assert getattr(group_of, key) == meant, written
    with pytest.raises(ConfigError) as err:
        parse({**SPEC, group: {**SPEC.get(group, {}), key: "sometimes"}})
    assert err.value.field == f"spec.{field}"


def test_the_crd_lists_the_current_words_then_the_older_ones():
    ft = spec_schema()["properties"]["faultTolerance"]["properties"]
    assert ft["preflight"]["enum"] == ["Auto", "Enabled", "Disabled", "auto", "on", "off"]
    assert ft["preflight"]["default"] == "Auto"


def test_a_config_file_read_as_yaml_11_gives_booleans_that_mean_the_words():
    # `python -m trainer --config run.yaml` reads YAML 1.1: an unquoted off is False
    raw = yaml.safe_load("checkpoint: {uri: /ckpt, memory: off}\n")
    assert raw["checkpoint"]["memory"] is False
    assert build(RunConfig, raw).checkpoint.memory == "Disabled"
    ft = build(FaultToleranceConfig, yaml.safe_load("preflight: on\nstragglers: off\n"))
    assert (ft.preflight, ft.stragglers) == ("Enabled", "Disabled")
    with pytest.raises(ConfigError) as err:  # true has no meaning for stragglers: refused, named
        build(FaultToleranceConfig, {"stragglers": True}, "faultTolerance")
    assert err.value.field == "faultTolerance.stragglers"


def test_objects_made_in_code_with_an_older_word_hold_the_current_one():
    assert FaultToleranceConfig(stragglers="replace", preflight="on").stragglers == "Replace"
    assert FaultToleranceConfig(preflight="on").preflight == "Enabled"
    assert CheckpointConfig(memory="off").memory == "Disabled"


def test_the_rendered_trainer_config_uses_the_words_every_trainer_release_reads():
    # a run's image may hold a trainer older than the CamelCase words: its run.yaml says peers
    from trainium_operator.plan import rendered_config
    spec = parse({**SPEC, "checkpoint": {**SPEC["checkpoint"], "memory": "Peers"}})
    cfg = yaml.safe_load(rendered_config(spec))
    assert cfg["checkpoint"]["memory"] == "peers"
    assert build(RunConfig, cfg).checkpoint.memory == "Peers"  # and this release reads it back
