"""The prepared token store: what `llmtrain.data.prepare` writes and `data=prepared` reads.

    <dir>/manifest.json      written last: the tokenizer (with a hash of its vocabulary), token and document
                             counts per split, the data config
    <dir>/tokenizer/         the tokenizer, in the format `transformers.AutoTokenizer` loads
    <dir>/train.bin          every training document's token ids, each followed by end-of-text, as one flat
    <dir>/validation.bin     array of uint16 (uint32 for vocabularies above 65,536), in document order

A flat array of fixed-width ids (nanoGPT's and llm.c's shards, Megatron's .bin; `np.memmap` opens it for a look) is
the cheapest thing to read at random: window i of w tokens is bytes [i * w * itemsize, (i + 1) * w * itemsize), one
read, no decoding and no index. Arrow (HF `datasets`) would add a per-document offsets column and a copy out of its list
arrays for windows that cross documents, which is most of them.
"""

from __future__ import annotations

import json
import os
from typing import Any, BinaryIO

import numpy as np

from llmtrain.errors import ConfigError

MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
STORE_VERSION = 1
# The manifest's tokenizer key holding tokenizers.vocabulary_sha256 (stores prepared before it was recorded lack it).
VOCAB_HASH = "vocab_sha256"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def split_file(directory: str, split: str) -> str:
    return os.path.join(directory, f"{split}.bin")


class SplitWriter:
    """Appends documents' token ids to one split's file and counts them."""

    def __init__(self, path: str, dtype: np.dtype):
        self.path = path
        self.dtype = dtype
        self.tokens = 0
        self.documents = 0
        self._file: BinaryIO = open(path, "wb")

    def append(self, tokens: np.ndarray, documents: int) -> None:
        """The ids of `documents` consecutive documents, each ending in end-of-text."""
        self._file.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.tokens += len(tokens)
        self.documents += documents

    def close(self) -> dict[str, Any]:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return {"file": os.path.basename(self.path), "tokens": self.tokens, "documents": self.documents}


def read_manifest(directory: str) -> dict[str, Any]:
    """The manifest of a complete store; a one-line error names what is wrong with anything else."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise ConfigError(
            f"data.path={directory!r} is not a prepared store (no {MANIFEST}): write one with "
            f"`python -m llmtrain.data.prepare data=<source> prepare.out={directory}`"
        )
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("version") != STORE_VERSION:
        raise ConfigError(
            f"data.path={directory!r} holds a store of version {manifest.get('version')}, this llmtrain reads "
            f"version {STORE_VERSION}: prepare it again"
        )
    return manifest


class TokenWindows:
    """One split of a store as consecutive, non-overlapping windows of `window` tokens, read one positional read
    per window. Not a memory map: on current kernels a mapped page-cache folio counts whole towards the process
    (measured: ~1.1 MiB of resident memory per 258-byte window read at random), so a long run would appear to hold
    the store. Read this way, a process holds the rows it asked for and the page cache (shared by every rank of
    a node) holds the rest."""

    def __init__(self, directory: str, split: str, window: int, manifest: dict[str, Any]):
        entry = manifest["splits"][split]
        path = os.path.join(directory, entry["file"])
        self.dtype = np.dtype(manifest["dtype"])
        if os.path.getsize(path) != entry["tokens"] * self.dtype.itemsize:
            raise ConfigError(
                f"{path} holds {os.path.getsize(path)} bytes, its manifest says {entry['tokens']} tokens of "
                f"{self.dtype.name}: the store is damaged, prepare it again"
            )
        self._file = open(path, "rb")  # read for the object's lifetime
        self.window = window
        self.count = entry["tokens"] // window

    def read(self, indices: np.ndarray) -> np.ndarray:
        """Windows `indices` as a (len(indices), window) int64 array."""
        rows = np.empty((len(indices), self.window), dtype=self.dtype)
        row_bytes = self.window * self.dtype.itemsize
        for row, index in zip(rows, indices):
            if os.preadv(self._file.fileno(), [row], int(index) * row_bytes) != row_bytes:
                raise ConfigError(
                    f"{self._file.name} ended before window {index}: the store is damaged, prepare it again"
                )
        return rows.astype(np.int64)
