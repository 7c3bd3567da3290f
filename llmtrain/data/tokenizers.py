"""Tokenizers behind one small interface: encode a batch of texts, decode, and name the end-of-text token.

- `byte`: UTF-8 bytes plus an end-of-text id (257 tokens); needs no files.
- `bpe`: a byte-level BPE trained with `tokenizers` on the start of the training stream, cached on disk under a
  key of the data and tokenizer config, so every later run (and every rank) loads the same file.
- `hf`: any `transformers` tokenizer by hub name or local directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer as HFCoreTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from llmtrain.errors import ConfigError, first_line
from llmtrain.hub import from_hub

EOS_TOKEN = "<|endoftext|>"


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    vocab_size = 257
    eos_id = 256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class FastTokenizer:
    """A `tokenizers` tokenizer (trained here) or a `transformers` one (loaded by name or path)."""

    def __init__(self, backend, eos_id: int, vocab_size: int):
        self.backend = backend
        self.eos_id = eos_id
        self.vocab_size = vocab_size

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if isinstance(self.backend, HFCoreTokenizer):
            encodings = [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        else:
            encodings = self.backend(texts, add_special_tokens=False)["input_ids"]
        return [np.asarray(ids, dtype=np.int64) for ids in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(list(ids))


def _byte_characters() -> list[str]:
    """The printable character GPT-2's byte-level BPE writes for each byte: printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 up, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    characters, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            characters.append(chr(byte))
        else:
            characters.append(chr(256 + shifted))
            shifted += 1
    return characters


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """Bytes of UTF-8 text each token id stands for (0 for end-of-text and ids the tokenizer does not define): what
    bits per byte divides by. A byte-level BPE token's characters are one byte each (GPT-2's alphabet, above);
    another tokenizer's token is measured by decoding it alone."""
    lengths = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    if isinstance(tokenizer, ByteTokenizer):
        lengths[:256] = 1
        return lengths
    assert isinstance(tokenizer, FastTokenizer)
    backend = tokenizer.backend
    alphabet = set(_byte_characters())
    to_token = backend.id_to_token if isinstance(backend, HFCoreTokenizer) else backend.convert_ids_to_tokens
    for token_id in range(tokenizer.vocab_size):
        piece = to_token(token_id)
        if piece is None or token_id == tokenizer.eos_id:
            continue
        lengths[token_id] = len(piece) if set(piece) <= alphabet else len(tokenizer.decode([token_id]).encode())
    return lengths


def byte_tokenizer_backend() -> HFCoreTokenizer:
    """ByteTokenizer as a `tokenizers` tokenizer with the same ids (byte b is token b, end-of-text 256): a
    byte-level BPE without merges."""
    vocab = {char: byte for byte, char in enumerate(_byte_characters())}
    vocab[EOS_TOKEN] = ByteTokenizer.eos_id
    tok = HFCoreTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    return tok


def save_for_transformers(tokenizer: Tokenizer, directory: str) -> None:
    """Files `transformers.AutoTokenizer.from_pretrained(directory)` loads as this tokenizer (same ids). A
    `tokenizers` tokenizer is written directly (tokenizer.json and a config naming the end-of-text token), which
    spares a checkpoint the import of transformers."""
    backend = tokenizer.backend if isinstance(tokenizer, FastTokenizer) else byte_tokenizer_backend()
    if not isinstance(backend, HFCoreTokenizer):  # already a transformers tokenizer
        backend.save_pretrained(directory)
        return
    os.makedirs(directory, exist_ok=True)
    backend.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "bos_token": EOS_TOKEN}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def vocabulary_sha256(tokenizer: Tokenizer) -> str:
    """A hash of what each id stands for (the tokens in id order): the same for one tokenizer wherever it was
    loaded from, unlike the bytes of its tokenizer.json, which change with the library version that wrote them."""
    backend = tokenizer.backend if isinstance(tokenizer, FastTokenizer) else byte_tokenizer_backend()
    tokens = sorted(backend.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFCoreTokenizer:
    """A GPT-2-style byte-level BPE: every byte is in the alphabet, so no text is ever out of vocabulary."""
    tok = HFCoreTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _take_chars(texts: Iterable[str], n_chars: int) -> Iterable[str]:
    total = 0
    for text in texts:
        yield text[: n_chars - total]
        total += len(text)
        if total >= n_chars:
            return


def bpe_cache_path(data_cfg) -> str:
    """Where the BPE for this data + tokenizer config lives: a hash of everything that changes its training text."""
    sources = ("source", "path", "name", "subset", "split", "val_split", "val_path", "val_fraction", "text_field")
    key = {k: getattr(data_cfg, k) for k in sources}
    # version 2: validation is held out by chunk, which changes the training text
    key.update(vocab_size=data_cfg.tokenizer.vocab_size, train_chars=data_cfg.tokenizer.train_chars, version=2)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser(data_cfg.cache_dir), "tokenizers", f"bpe-{digest}.json")


def build_bpe(data_cfg, training_texts: Iterable[str]) -> str:
    """Train the BPE from the first `train_chars` characters of the stream and cache it atomically."""
    path = bpe_cache_path(data_cfg)
    if not os.path.exists(path):
        tok = train_bpe(_take_chars(training_texts, data_cfg.tokenizer.train_chars), data_cfg.tokenizer.vocab_size)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        tok.save(tmp)
        os.replace(tmp, path)
    return path


def load_tokenizer(data_cfg, bpe_path: str | None = None) -> Tokenizer:
    kind = data_cfg.tokenizer.kind
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        core = HFCoreTokenizer.from_file(bpe_path or bpe_cache_path(data_cfg))
        eos_id = core.token_to_id(EOS_TOKEN)
        assert eos_id is not None, "train_bpe adds the end-of-text token"
        return FastTokenizer(core, eos_id=eos_id, vocab_size=core.get_vocab_size())
    from transformers import AutoTokenizer

    name = data_cfg.tokenizer.name
    if os.path.isdir(os.path.expanduser(name)):
        try:
            pretrained = AutoTokenizer.from_pretrained(os.path.expanduser(name))
        except (OSError, ValueError) as error:  # what transformers raises for files it cannot use
            raise ConfigError(
                f"data.tokenizer.name={name!r}: transformers cannot load a tokenizer from it "
                f"({first_line(error)}): point it at a directory save_pretrained wrote"
            ) from None
    else:
        pretrained = from_hub("data.tokenizer.name", name, lambda: AutoTokenizer.from_pretrained(name))
    if pretrained.eos_token_id is None:
        pretrained.add_special_tokens({"eos_token": EOS_TOKEN})
    return FastTokenizer(pretrained, eos_id=pretrained.eos_token_id, vocab_size=len(pretrained))


def load_saved_tokenizer(directory: str, kind: str, eos_id: int, vocab_size: int) -> Tokenizer:
    """A tokenizer `save_for_transformers` wrote: the byte tokenizer itself, else its tokenizer.json read with
    `tokenizers` alone (the same ids as the transformers tokenizer, without importing transformers), else, for a
    tokenizer with no fast version, transformers."""
    if kind == "byte":
        return ByteTokenizer()
    tokenizer_json = os.path.join(directory, "tokenizer.json")
    if os.path.isfile(tokenizer_json):
        return FastTokenizer(HFCoreTokenizer.from_file(tokenizer_json), eos_id=eos_id, vocab_size=vocab_size)
    from transformers import AutoTokenizer

    return FastTokenizer(AutoTokenizer.from_pretrained(directory), eos_id=eos_id, vocab_size=vocab_size)
