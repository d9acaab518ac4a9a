"""The typed API package on its own: declarations -> loader errors, lenient status reading,
the status patch, and that no fact is written twice."""

from __future__ import annotations

import pytest

from trainium_api import spec as api
from trainium_api.fields import ConfigError, api_fields
from trainium_api.load import build, changed_fields, lenient, to_dict
from trainium_api.status import CheckpointRef, FailureRecord, TrainingRunStatus
from trainium_operator.reconcile import read_status, reconcile_objects


@pytest.mark.parametrize("cls, data, field, words", [
    (api.ParallelConfig, {"tensor": 0}, "parallelism.tensor", "must be at least 1"),
    (api.ParallelConfig, {"tensor": 2.5}, "parallelism.tensor", "must be an integer"),
    (api.ParallelConfig, {"zero1": "yes"}, "parallelism.zero1", "true or false"),
    (api.ParallelConfig, {"activationCheckpointing": "some"}, "parallelism.activationCheckpointing",
     "must be one of none, selective, full"),
    (api.CheckpointConfig, {"keep": -1}, "checkpoint.keep", "must not be negative"),
    (api.FaultToleranceConfig, {"budgetWindowMinutes": 0}, "faultTolerance.budgetWindowMinutes", "must be positive"),
    (api.FaultToleranceConfig, {"hangTimeoutSeconds": True}, "faultTolerance.hangTimeoutSeconds", "number or a string"),
    (api.DataConfig, {"sources": "s3://x"}, "data.sources", "must be a list of {uri, weight, textField}"),
    (api.DataConfig, {"heldOut": 3}, "data.heldOut", "must be a uri, a list of them, or a list of {uri, weight, textField}"),
    (api.DataConfig, {"heldOut": [7]}, "data.heldOut[0]", "must be a mapping"),
    (api.DataConfig, {"heldOut": {"weight": 2}}, "data.heldOut[0].uri", "is required"),
    (api.DataConfig, {"sources": [{"weight": 1}]}, "data.sources[0].uri", "is required"),
    (api.DataConfig, {"sources": [{"uri": "x", "weight": 0}]}, "data.sources[0].weight", "must be positive"),
    (api.TrainerConfig, {"progressFormat": "json"}, "trainer.progressFormat", "must be one of '', nxd, nxdt, regex"),
    (api.TrainerConfig, {"script": "x"}, "trainer.script", "unknown field (known: "),
])
def test_the_loader_refuses_with_the_field_named(cls, data, field, words):
    with pytest.raises(ConfigError) as err:
        build(cls, data, field.split(".")[0])
    assert err.value.field == field and words in err.value.message, str(err.value)


def test_keys_are_camel_case_with_the_declared_exceptions_and_overrides_may_use_python_names():
    assert [f.key for f in api_fields(api.CheckpointConfig)][3] == "async"
    assert [f.key for f in api_fields(api.InitConfig)] == ["from"]
    for key in ("async", "async_save", "asyncSave"):
        assert build(api.CheckpointConfig, {key: False}).async_save is False
    assert build(api.DataConfig, {"sources": ["s3://b/p"]}).sources == [api.DataSource(uri="s3://b/p")]


@pytest.mark.parametrize("written", ["s3://b/eval/", {"uri": "s3://b/eval/"}, ["s3://b/eval/"],
                                     [{"uri": "s3://b/eval/"}], [{"uri": "s3://b/eval/", "weight": 1.0}]])
def test_one_uri_is_shorthand_for_one_unweighted_held_out_source(written):
    """`heldOut: s3://bucket/prefix/` (how a user writes one evaluation set), one source, a list
    of URIs and the long form all load to the same sources."""
    data = build(api.DataConfig, {"sources": ["s3://b/eval/"], "heldOut": written}, "data")
    assert data.sources == data.held_out == [api.DataSource(uri="s3://b/eval/", weight=1.0)]


def test_enumerations_have_one_source():
    from trainer.pod import watch
    from trainium_api import checkpoints
    assert watch.PROGRESS_FORMATS is api.PROGRESS_FORMATS and checkpoints.LAYOUTS is api.LAYOUTS
    assert api.CAUSES == ("application", "node", "neuron-device", "hang", "eviction", "scheduling", "startup",
                          "straggler", "preflight", "store")
    assert set(api.INSTANCE_TYPES) == set(next(f for f in api_fields(api.TrainingRunSpec)
                                               if f.name == "instance_type").enum)


FULL = {"phase": "Running", "attempt": 3, "createdTime": 1.0, "restarts": {"node": 2}, "restartCount": 2,
        "quarantinedNodes": ["n1"], "lastCheckpoint": {"tag": "step_10", "step": 10, "time": 5.0, "uri": "s3://c/step_10"},
        "conditions": [{"type": "Valid", "status": "True", "reason": "SpecValid", "message": "",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        "failures": [{"id": 1, "time": 9.0, "cause": "node", "action": "restart", "node": "n1", "message": "NotReady",
                      "recoveredTime": 12.0, "recoveredAfter": 3.0}],
        "failureCount": 1, "disruption": {"since": 3.0, "message": "3 of 4 nodes"},
        "goodput": {"wallSeconds": 10.0, "productiveSeconds": 8.0,
                    "lostSeconds": {"detect": 1.0, "teardown": 1.0, "schedule": 0.0, "recompute": 0.0,
                                    "preflight": 0.0, "restore": 0.0},
                    "effectiveRatio": 0.8,
                    "byRestart": {kind: {"detect": 1.0 if kind == "recreate" else 0.0, "teardown": 0.0, "schedule": 0.0,
                                         "recompute": 0.0, "preflight": 0.0, "restore": 0.0}
                                  for kind in ("inPlace", "replace", "recreate")}}}


def test_a_status_reads_into_its_types_and_back_unchanged():
    status = read_status(FULL)
    assert status.failures[0].recovered_after == 3.0 and status.last_checkpoint.step == 10
    assert to_dict(status, drop_none=True) | FULL == to_dict(status, drop_none=True)
    assert {k: v for k, v in to_dict(status, drop_none=True).items() if k in FULL} == FULL


def test_a_malformed_status_loses_only_its_malformed_fields_and_never_stops_reconcile():
    bad = {**FULL, "attempt": "three", "restarts": [1], "goodput": 7,
           "failures": [{"id": "x"}, FULL["failures"][0], "junk"], "lastCheckpoint": {"step": "ten"}}
    status = read_status(bad)
    assert status.attempt == 0 and status.restarts == {} and status.goodput is None
    assert [f.id for f in status.failures] == [1] and status.last_checkpoint.step is None
    run = {"metadata": {"name": "r", "namespace": "ns", "uid": "u", "generation": 1}, "status": bad,
           "spec": {"image": "i", "nodes": 1, "instanceType": "cpu", "checkpoint": {"uri": "/c"},
                    "data": {"sources": ["/d"], "tokenizer": "/t.json"}}}
    reconcile_objects(run, [], {}, now=20.0)  # does not raise
    assert read_status(None) == TrainingRunStatus()


def test_the_patch_holds_the_changed_fields_and_clears_with_null():
    old = read_status(FULL)
    new = read_status(FULL)
    assert changed_fields(old, new) == {}
    new.disruption, new.step = None, 42
    new.failures[0].teardown_done_time = 11.0
    new.last_checkpoint = CheckpointRef(tag="step_20", step=20, time=None, uri="s3://c/step_20")
    patch = changed_fields(old, new)
    assert set(patch) == {"disruption", "step", "failures", "lastCheckpoint"}
    assert patch["disruption"] is None and patch["step"] == 42
    # a merge patch merges objects (so a cleared key is written as null) and replaces lists whole
    assert patch["lastCheckpoint"]["time"] is None
    assert "resumedTime" not in patch["failures"][0] and patch["failures"][0]["teardownDoneTime"] == 11.0
    assert isinstance(new.failures[0], FailureRecord)


def test_a_failure_record_needs_only_its_identity_and_time():
    assert lenient(FailureRecord, {"id": 4, "time": 1.0}).cause == "application"
    # the cause is typed: one not in CAUSES (a status edited by hand) is read as the application's
    assert lenient(FailureRecord, {"id": 4, "time": 1.0, "cause": "cosmic-ray"}).cause == "application"
    with pytest.raises(ConfigError):
        lenient(FailureRecord, {"time": 1.0})


def test_fields_newer_than_older_trainer_images_are_left_out_of_their_config_at_default():
    """A run may name a trainer image older than the operator (docs/install.md), which refuses
    keys it does not know: the config the operator renders for it (load.to_dict older_words)
    carries a field marked Newer only when the run sets it away from its default."""
    import dataclasses

    from trainium_api.fields import Newer, api_fields
    from trainium_api.load import to_dict
    from trainium_api.spec import RunConfig
    from trainer.config import from_dict

    def newer_keys(cls, out):
        for f in api_fields(cls):
            if f.mark(Newer) is not None:
                out.add(f.key)
            for tp in (f.type, *getattr(f.type, "__args__", ())):
                if dataclasses.is_dataclass(tp):
                    newer_keys(tp, out)
        return out
    newer = newer_keys(RunConfig, set())
    assert {"textField", "headSize", "ropeScaling", "qkvBias", "qkNorm", "tieEmbeddings"} <= newer

    def keys(d, out):
        if isinstance(d, dict):
            for k, v in d.items():
                out.add(k)
                keys(v, out)
        elif isinstance(d, list):
            for v in d:
                keys(v, out)
        return out
    plain = from_dict({"model": {"preset": "llama2-7b"}, "data": {"sources": ["/c"], "tokenizer": "/t.json"}})
    assert not keys(to_dict(plain, older_words=True), set()) & (newer - {"textField"})  # data.textField is older
    assert "textField" not in keys(to_dict(plain, older_words=True)["data"]["sources"], set())
    used = from_dict({"model": {"preset": "llama3.1-8b"}, "data": {"sources": [{"uri": "/c", "textField": "body"}],
                                                                    "tokenizer": "/t.json"}})
    rendered = to_dict(used, older_words=True)
    assert rendered["model"]["ropeScaling"] == "llama3" and rendered["data"]["sources"][0]["textField"] == "body"
    assert "qkvBias" not in rendered["model"]  # still at its default
