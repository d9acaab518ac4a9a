"""The tokenizer files checkpoints ship, read into one interface the data readers use.

``data.tokenizer`` names one of:

- a Hugging Face ``tokenizers`` JSON file (``tokenizer.json``), read by ``tokenizers``;
- a SentencePiece model (``tokenizer.model``, Llama 2's and Mistral's), read by ``sentencepiece``,
  the library that wrote it;
- a Hugging Face tokenizer or model directory: its ``tokenizer.json``, else its
  ``tokenizer.model``;
- a file of another name (``Tokenizer.save`` takes any): JSON when it starts with ``{``, else a
  SentencePiece model.

Either way a document's tokens are what the model's own tokenizer makes of it, special tokens
included (a ``tokenizer.json``'s post-processor adds Llama 3's ``<|begin_of_text|>``; a
SentencePiece model adds its BOS as Hugging Face's ``LlamaTokenizer`` does, unless the
directory's ``tokenizer_config.json`` says ``add_bos_token: false``), then ``data.eosToken``.
The digest that prepared data is checked against is the sha256 of the file's bytes (of the text
for JSON, as before), so a copy elsewhere still matches.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

from ..config import ConfigError
from ..store import node_reads
from .prepared import tokenizer_digest

JSON_NAME, SENTENCEPIECE_NAME, CONFIG_NAME = "tokenizer.json", "tokenizer.model", "tokenizer_config.json"


@dataclass
class Encoded:
    """What ``tokenizers.Encoding`` gives the readers: the ids."""

    ids: list[int]


class SentencePieceTokenizer:
    """A SentencePiece model behind the ``tokenizers.Tokenizer`` methods the readers call."""

    def __init__(self, model: bytes, add_bos: bool = True):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_proto=model)
        self.bos = [self.sp.bos_id()] if add_bos and self.sp.bos_id() >= 0 else []

    def get_vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None  # an unknown piece maps to <unk>

    def encode_batch(self, texts: list[str]) -> list[Encoded]:
        return [Encoded(self.bos + ids) for ids in self.sp.encode(texts)]


def _candidates(uri: str) -> list[str]:
    if uri.endswith("/" + JSON_NAME):  # what init.from a directory names: SentencePiece-only ones too
        return [uri, uri[:-len(JSON_NAME)] + SENTENCEPIECE_NAME]
    if uri.endswith((".json", ".model")):
        return [uri]
    root = uri.rstrip("/")
    # a file of any other name (tokenizers' Tokenizer.save takes any), else a directory
    return [uri, f"{root}/{JSON_NAME}", f"{root}/{SENTENCEPIECE_NAME}"]


def is_sentencepiece(path: str, data: bytes) -> bool:
    """Whether the tokenizer file ``path`` holding ``data`` is a SentencePiece model (a
    protobuf) rather than a tokenizers JSON file: by its name, else by its first byte."""
    if path.endswith((".model", ".json")):
        return path.endswith(".model")
    return data.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] != b"{"


def find(uri: str) -> tuple[str, bytes]:
    """(path, bytes) of the file data.tokenizer ``uri`` reads: a directory's tokenizer.json, else
    its tokenizer.model. FileNotFoundError naming what was tried when none is there; the store's
    other errors (trainer.store.errors) as they come."""
    tried = _candidates(uri)
    for path in tried:
        try:
            return path, node_reads.read_object(path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):  # the store: not there
            continue
    raise FileNotFoundError(f"no tokenizer at {uri} (tried {', '.join(tried)})")


def config_beside(path: str) -> bytes | None:
    """The tokenizer_config.json beside the tokenizer file ``path`` (add_bos_token, the
    tokenizer class transformers reads), None where there is none."""
    try:
        return node_reads.read_object(f"{path.rsplit('/', 1)[0]}/{CONFIG_NAME}")
    except FileNotFoundError:
        return None


def _add_bos(path: str) -> bool:
    """``add_bos_token`` of the tokenizer_config.json beside ``path`` (Hugging Face's default: true)."""
    try:
        config = json.loads(config_beside(path) or b"{}")
    except ValueError:
        return True
    value = config.get("add_bos_token", True) if isinstance(config, dict) else True
    return value if isinstance(value, bool) else True


def read_tokenizer(uri: str, eos_token: str):
    """(tokenizer, digest). Read once per node (trainer.store.node_reads), retried while the
    store's errors are transient; what cannot be a tokenizer names data.tokenizer."""
    from tokenizers import Tokenizer

    try:
        path, data = find(uri)
    except FileNotFoundError as exc:
        raise ConfigError("data.tokenizer", f"{exc}: name a tokenizers JSON file, a SentencePiece .model, "
                          f"or a directory holding either") from None
    except OSError as exc:  # a refusal that persisted, an invalid request (trainer.store.errors)
        raise ConfigError("data.tokenizer", f"cannot read tokenizer {uri}: {exc}") from None
    try:
        if is_sentencepiece(path, data):
            add_bos = _add_bos(path) if path.endswith("/" + SENTENCEPIECE_NAME) else True
            tok = SentencePieceTokenizer(data, add_bos)
            # the ids it makes depend on the BOS choice too: data prepared without BOS is not taken
            # for a run that adds it (a model's usual BOS keeps the file's own digest)
            digest = tokenizer_digest(data if add_bos else data + b"\0add_bos_token=false")
        else:
            # decoded as fsspec's text mode did (the locale's encoding, universal newlines), so the
            # digest of a tokenizer is the one manifests already record
            text = io.TextIOWrapper(io.BytesIO(data)).read()
            tok, digest = Tokenizer.from_str(text), tokenizer_digest(text)
    except Exception as exc:  # tokenizers and sentencepiece raise plain Exception subclasses on bad files
        raise ConfigError("data.tokenizer", f"cannot read tokenizer {path}: {exc}") from None
    if tok.token_to_id(eos_token) is None:
        raise ConfigError("data.eosToken", f"{eos_token!r} is not in the tokenizer {path}")
    return tok, digest
