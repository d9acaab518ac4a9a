"""Tokenizer files checkpoints ship (trainer.data.tokenizer): a tokenizers JSON, a SentencePiece
tokenizer.model, or a Hugging Face directory holding either.

The SentencePiece model is trained here by sentencepiece itself (BPE, as Llama 2's and
Mistral's are), and the reference for its tokens is transformers' LlamaTokenizer reading the
same file: a document's ids are the model tokenizer's, BOS included, then data.eosToken.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from trainer.config import ConfigError, from_dict
from trainer.data.packed import PackedDataset
from trainer.data.prepare import main as prepare_main
from trainer.data.tokenizer import read_tokenizer

TEXTS = [f"the {animal} ran {n} times across the {place}." for n in range(60)
         for animal, place in [("cat", "field"), ("dog", "river"), ("fox", "hill")][n % 3:n % 3 + 1]]


def train_spm(directory: Path, vocab_size: int, byte_fallback: bool = True) -> Path:
    import sentencepiece  # a trainer dependency

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 3), model_writer=out, vocab_size=vocab_size, model_type="bpe",
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, byte_fallback=byte_fallback, hard_vocab_limit=False,
        # Llama 2's normalizer spec (what transformers' conversion assumes): text as it is
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    (directory / "tokenizer.model").write_bytes(out.getvalue())
    return directory / "tokenizer.model"


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    return train_spm(tmp_path_factory.mktemp("spm"), 300)


def corpus(tmp_path: Path) -> str:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return str(tmp_path / "corpus")


def first_rows(uri: str, tokenizer: str, rows=4, **data):
    ds = PackedDataset(from_dict({"data": {"sources": [uri], "tokenizer": tokenizer, "shuffle": False,
                                           **data}}).data, 16, 1, 512)
    return ds.next_batch(rows)[0]


def hf_directory(tmp_path: Path, spm_model: Path, add_bos: bool) -> Path:
    """A Hugging Face tokenizer directory as Llama 2 and Mistral ship it: the model and its config."""
    directory = tmp_path / f"hf-bos-{add_bos}"
    directory.mkdir()
    shutil.copy(spm_model, directory / "tokenizer.model")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "add_bos_token": add_bos, "eos_token": "</s>"}))
    return directory


@pytest.mark.parametrize("add_bos", [True, False])
def test_sentencepiece_ids_are_the_llama_tokenizers(spm_model, tmp_path, add_bos):
    transformers = pytest.importorskip("transformers")
    directory = hf_directory(tmp_path, spm_model, add_bos)
    ours, _ = read_tokenizer(str(directory), "</s>")  # no tokenizer.json there: the model
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    # (text that begins with spaces is left out: there transformers' conversion, legacy=False, and
    # sentencepiece, the library Meta's own Llama code tokenizes with, place the first "▁" apart;
    # ours is sentencepiece's)
    for text in TEXTS[:10] + ["unseen wörds ünïcode 🙂", "two  spaces\nand a line  "]:
        assert ours.encode_batch([text])[0].ids == theirs.encode(text)
    assert ours.token_to_id("</s>") == theirs.eos_token_id == 2
    assert ours.token_to_id("<not-a-piece>") is None
    assert ours.get_vocab_size() == theirs.vocab_size
    # a bare model file has no config: LlamaTokenizer's default, and Llama 2's and Mistral's, adds BOS
    bare, _ = read_tokenizer(str(spm_model), "</s>")
    assert bare.encode_batch([TEXTS[0]])[0].ids[0] == 1


def test_rows_from_a_directory_equal_rows_from_its_file(tmp_path, tiny_data, spm_model):
    src = corpus(tmp_path)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    shutil.copy(tiny_data["tokenizer"], hf_dir / "tokenizer.json")
    shutil.copy(spm_model, hf_dir / "tokenizer.model")  # tokenizer.json wins when both are there
    assert torch.equal(first_rows(src, str(hf_dir)), first_rows(src, tiny_data["tokenizer"]))
    spm_only = tmp_path / "spm-only"
    spm_only.mkdir()
    shutil.copy(spm_model, spm_only / "tokenizer.model")
    # init.from a directory names <dir>/tokenizer.json: a SentencePiece-only directory reads its model
    assert torch.equal(first_rows(src, str(spm_only / "tokenizer.json")), first_rows(src, str(spm_model)))
    assert torch.equal(first_rows(src, f"{spm_only}/"), first_rows(src, str(spm_model)))
    # a file of another name (Tokenizer.save takes any; read by these rules before SentencePiece
    # came): JSON by its first byte, else SentencePiece
    shutil.copy(tiny_data["tokenizer"], tmp_path / "llama3-tok")
    shutil.copy(spm_model, tmp_path / "spm.bin")
    assert torch.equal(first_rows(src, str(tmp_path / "llama3-tok")), first_rows(src, tiny_data["tokenizer"]))
    assert torch.equal(first_rows(src, str(tmp_path / "spm.bin")), first_rows(src, str(spm_model)))


def test_what_is_not_a_tokenizer_names_the_field(tmp_path, spm_model):
    with pytest.raises(ConfigError) as err:
        read_tokenizer(str(tmp_path), "</s>")
    assert err.value.field == "data.tokenizer" and "tokenizer.model" in err.value.message
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a sentencepiece model")
    with pytest.raises(ConfigError) as err:
        read_tokenizer(str(bad), "</s>")
    assert err.value.field == "data.tokenizer" and str(bad) in err.value.message
    with pytest.raises(ConfigError) as err:
        read_tokenizer(str(spm_model), "<|end_of_text|>")
    assert err.value.field == "data.eosToken"


def test_prepared_data_checks_a_sentencepiece_model_by_its_bytes(tmp_path, spm_model):
    src = corpus(tmp_path)
    assert prepare_main(["--source", src, "--tokenizer", str(spm_model), "--out", str(tmp_path / "prep")]) == 0
    copy = tmp_path / "elsewhere" / "tokenizer.model"
    copy.parent.mkdir()
    shutil.copy(spm_model, copy)
    # the same bytes elsewhere match, and the prepared rows are the raw rows
    assert torch.equal(first_rows(str(tmp_path / "prep"), str(copy)), first_rows(src, str(spm_model)))
    (tmp_path / "other").mkdir()
    other = train_spm(tmp_path / "other", 64, byte_fallback=False)  # another vocabulary: the prepared ids mean other tokens
    with pytest.raises(ConfigError) as err:
        first_rows(str(tmp_path / "prep"), str(other))
    assert err.value.field == "data.tokenizer"


def test_convert_carries_a_sentencepiece_tokenizer_both_ways(spm_model, tmp_path):
    """from-hf of a directory with only tokenizer.model (Llama 2's and Mistral's layout) records the
    model as the run's tokenizer; to-hf writes it back, and transformers reads the same ids."""
    transformers = pytest.importorskip("transformers")
    from trainer.checkpoint.convert import from_hf, to_hf

    hf_dir = hf_directory(tmp_path, spm_model, add_bos=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64,
        tie_word_embeddings=False)).save_pretrained(hf_dir)
    tag = from_hf(str(hf_dir), str(tmp_path / "ours"))
    meta = json.loads((Path(tag) / "meta.json").read_text())
    assert meta["tokenizer"] == f"{tag}/tokenizer.model"
    assert (Path(tag) / "tokenizer_config.json").exists()
    back = tmp_path / "back"
    to_hf(tag, str(back))
    assert sorted(p.name for p in back.iterdir() if p.name.startswith("tokenizer")) == \
        ["tokenizer.model", "tokenizer_config.json"]
    ours, _ = read_tokenizer(meta["tokenizer"], "</s>")
    theirs = transformers.AutoTokenizer.from_pretrained(str(back))
    assert ours.encode_batch([TEXTS[7]])[0].ids == theirs.encode(TEXTS[7])
    assert json.loads((back / "config.json").read_text())["eos_token_id"] == 2


def test_data_prepared_without_bos_is_not_taken_by_a_run_that_adds_it(spm_model, tmp_path):
    """Review finding: the ids depend on the directory's add_bos_token too, so the digest does."""
    src = corpus(tmp_path)
    no_bos = hf_directory(tmp_path, spm_model, add_bos=False)
    assert prepare_main(["--source", src, "--tokenizer", str(no_bos), "--out", str(tmp_path / "prep")]) == 0
    assert torch.equal(first_rows(str(tmp_path / "prep"), str(no_bos)), first_rows(src, str(no_bos)))
    with pytest.raises(ConfigError) as err:
        first_rows(str(tmp_path / "prep"), str(spm_model))  # the bare model adds BOS
    assert err.value.field == "data.tokenizer"
    # the usual BOS keeps the file's own digest (data prepared before this check still matches)
    import hashlib
    assert read_tokenizer(str(spm_model), "</s>")[1] == hashlib.sha256(spm_model.read_bytes()).hexdigest()


def test_a_tokenizer_file_changed_under_the_same_name_is_refused_at_resume(tmp_path, tiny_data, spm_model):
    """A raw source's position counts its tokens: a checkpoint records the tokenizer's digest,
    and another file under the same data.tokenizer is refused like another tokenizer (the case
    found by review: a directory whose tokenizer.json went away reads its tokenizer.model)."""
    from trainer.loop.train import changed_data

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    shutil.copy(tiny_data["tokenizer"], hf_dir / "tokenizer.json")
    shutil.copy(spm_model, hf_dir / "tokenizer.model")
    data = from_dict({"data": {"sources": [corpus(tmp_path)], "tokenizer": f"{hf_dir}/tokenizer.json",
                               "eosToken": "</s>"}}).data
    saved = PackedDataset(data, 16, 1, 512)
    meta = {"tokenizer": data.tokenizer, "tokenizerDigest": saved.tokenizer_digest}
    assert changed_data(meta, data, tokenizer_digest=saved.tokenizer_digest) is None
    (hf_dir / "tokenizer.json").unlink()
    now = PackedDataset(data, 16, 1, 512)
    field, then, later = changed_data(meta, data, tokenizer_digest=now.tokenizer_digest)
    assert field == "data.tokenizer" and "its file changed" in later, (then, later)
    assert changed_data({"tokenizer": data.tokenizer}, data, tokenizer_digest=now.tokenizer_digest) is None  # older
