import pytest

from trainer.config import PRESETS, ConfigError, derive_layout, from_dict, load, to_dict

DATA = {"sources": [{"uri": "x"}], "tokenizer": "t.json"}


def cfg(**groups):
    return from_dict({"data": DATA, **groups})


def test_presets_have_published_shapes():
    c = cfg(model={"preset": "llama2-7b"})
    assert (c.model.hidden_size, c.model.num_layers, c.model.num_heads, c.model.vocab_size) == (4096, 32, 32, 32000)
    assert 6.6e9 < c.model.num_params() < 6.8e9  # Llama 2 7B: 6.74B
    assert 68e9 < cfg(model={"preset": "llama2-70b"}).model.num_params() < 70e9
    assert 7.9e9 < cfg(model={"preset": "llama3-8b"}).model.num_params() < 8.1e9
    p = cfg(model={"preset": "pythia-6.9b"}).model
    assert p.family == "neox" and p.rotary_pct == 0.25 and 6.8e9 < p.num_params() < 6.9e9
    assert 20.4e9 < cfg(model={"preset": "neox-20b"}).model.num_params() < 20.7e9
    assert set(PRESETS) >= {"tiny", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "neox-20b", "pythia-6.9b"}


def test_fields_override_preset_and_overrides_apply():
    c = from_dict({"model": {"preset": "llama2-7b", "numLayers": 2}, "data": DATA},
                  ["training.steps=7", "training.betas=[0.9, 0.99]", "checkpoint.async=false"])
    assert c.model.num_layers == 2 and c.model.hidden_size == 4096
    assert c.training.steps == 7 and c.training.betas == [0.9, 0.99] and c.checkpoint.async_save is False


def test_llama2_7b_128_node_recipe_layout():
    c = cfg(model={"preset": "llama2-7b"}, parallelism={"tensor": 8, "sequenceParallel": True, "zero1": True},
            training={"seqLen": 4096, "globalBatchSize": 1024, "microBatchSize": 1})
    lay = derive_layout(128 * 32, c.model, c.parallelism, c.training)
    assert (lay.data, lay.grad_accum_steps, lay.tokens_per_step) == (512, 2, 1024 * 4096)


@pytest.mark.parametrize("groups, field", [
    ({"model": {"preset": "nope"}}, "model.preset"),
    ({"model": {"hiddenSize": 100, "numHeads": 3}}, "model.numHeads"),
    ({"training": {"precision": "fp8"}}, "training.precision"),
    ({"training": {"steps": "many"}}, "training.steps"),
    ({"training": {"stepz": 3}}, "training.stepz"),
    ({"checkpoint": {"keep": -1}}, "checkpoint.keep"),
    ({"health": {"nanPolicy": "ignore"}}, "health.nanPolicy"),
    ({"data": {"sources": [], "tokenizer": "t"}}, "data.sources"),
    ({"data": {"sources": [{"uri": "x", "weight": 0}], "tokenizer": "t"}}, "data.sources[0].weight"),
    ({"parallelism": {"activationCheckpointing": "some"}}, "parallelism.activationCheckpointing"),
])
def test_invalid_fields_are_named(groups, field):
    with pytest.raises(ConfigError) as err:
        from_dict({"data": DATA, **groups})
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")


@pytest.mark.parametrize("world, par, train, field, words", [
    (4, {"tensor": 3}, {}, "parallelism.tensor", "world size"),
    (3, {"tensor": 3}, {}, "parallelism.tensor", "numHeads"),
    (4, {"tensor": 2}, {"globalBatchSize": 6, "microBatchSize": 2}, "training.globalBatchSize", "not divisible"),
    (2, {"tensor": 2, "sequenceParallel": True}, {"seqLen": 127}, "training.seqLen", "sequence parallel"),
])
def test_layout_errors_name_the_field(world, par, train, field, words):
    c = cfg(parallelism=par, training=train)
    with pytest.raises(ConfigError) as err:
        derive_layout(world, c.model, c.parallelism, c.training)
    assert err.value.field == field and words in str(err.value)


def test_roundtrip_and_digest(tmp_path):
    c = cfg(training={"steps": 5})
    path = tmp_path / "run.yaml"
    import yaml
    path.write_text(yaml.safe_dump(to_dict(c)))
    again = load(str(path))
    assert again == c and again.digest() == c.digest()
    assert cfg(training={"steps": 9}).digest() == c.digest()  # steps do not change the sample order
    assert cfg(training={"seed": 9}).digest() != c.digest()


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="--config: file not found"):
        load(str(tmp_path / "absent.yaml"))


def test_exponent_floats_read_as_numbers_as_kubectl_reads_them(tmp_path):
    """`lr: 3e-4` is a float in YAML 1.2 (kubectl, the API server); PyYAML's 1.1 rules would
    make it the string '3e-4' and the run would be refused."""
    import yaml
    raw = yaml.safe_load(yaml.safe_dump(to_dict(cfg())))
    text = yaml.safe_dump(raw).replace("lr: 0.003", "lr: 3e-3").replace("minLr: 0.0003", "minLr: 3e-4")
    assert "lr: 3e-3" in text
    path = tmp_path / "run.yaml"
    path.write_text(text)
    loaded = load(str(path))
    assert loaded.training.lr == 3e-3 and loaded.training.min_lr == 3e-4
    assert load(str(path), ["training.lr=1e-2"]).training.lr == 1e-2
