"""Training on a prepared store (`data=prepared data.path=DIR`): each rank reads only its own rows, by index.

The global sample order is a seeded permutation of the split's windows, a new one each epoch: global batch k is
samples [k * batch_size, (k + 1) * batch_size) of it, and data-parallel rank r reads rows
[r * per_rank, (r + 1) * per_rank) of that batch straight from the file. So batch k depends only on the seed,
the store and seq_len (never on the number of ranks), no rank reads or decodes a token it does not train on, and
the position is one integer: a resume at step 10,000 costs what one at step 10 does.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from llmtrain.data.sources import TRAIN, VALIDATION
from llmtrain.data.store import TOKENIZER_DIR, TokenWindows, read_manifest
from llmtrain.data.stream import RankSlice
from llmtrain.data.tokenizers import Tokenizer, load_saved_tokenizer
from llmtrain.errors import ConfigError

# The keys of data.tokenizer that decide the ids, per kind: the ones a data=prepared config may repeat.
_IDENTIFYING_KEYS = {"byte": ("kind",), "bpe": ("kind", "vocab_size", "train_chars"), "hf": ("kind", "name")}


def store_tokenizer(data_cfg) -> Tokenizer:
    """The tokenizer the store at data.path was tokenised with; a data.tokenizer key set to something else is a
    one-line error (the ids on disk would mean other text)."""
    manifest = read_manifest(data_cfg.path)
    stored = manifest["tokenizer"]
    for key in _IDENTIFYING_KEYS[stored["kind"]]:
        wanted = getattr(data_cfg.tokenizer, key)
        if wanted is not None and wanted != stored[key]:
            raise ConfigError(
                f"data.tokenizer.{key}={wanted!r} disagrees with the store at data.path={data_cfg.path!r}, "
                f"tokenised with {key}={stored[key]!r}: drop the data.tokenizer override (a prepared store brings "
                f"its own tokenizer) or prepare the data again with it"
            )
    return load_saved_tokenizer(
        os.path.join(data_cfg.path, TOKENIZER_DIR), stored["kind"], stored["eos_id"], stored["size"]
    )


class PreparedBatches:
    """This rank's rows of global batch k, k = 0, 1, ..., read from the store's training split."""

    def __init__(self, directory: str, seq_len: int, seed: int, rank_slice: RankSlice, position: dict[str, Any] | None):
        manifest = read_manifest(directory)
        self.windows = TokenWindows(directory, TRAIN, seq_len + 1, manifest)
        if self.windows.count == 0:
            raise ConfigError(
                f"the store at data.path={directory!r} holds {manifest['splits'][TRAIN]['tokens']} training tokens, "
                f"less than one window of train.seq_len + 1 = {seq_len + 1}: lower train.seq_len or prepare more text"
            )
        self.tokenizer_kind = manifest["tokenizer"]["kind"]
        self.seed = seed
        self.rank_slice = rank_slice
        self.next_sample = 0  # global sample index of the next batch's first row
        self._epoch = -1
        self._order = np.zeros(0, dtype=np.int64)
        if position is not None:
            self.load_state_dict(position)

    def _order_of(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.windows.count)
        return self._order

    def next(self) -> np.ndarray:
        """(per_rank, seq_len + 1) int64: this rank's rows of the next global batch."""
        first = self.next_sample + self.rank_slice.dp_rank * self.rank_slice.per_rank
        samples = np.arange(first, first + self.rank_slice.per_rank)
        epochs, offsets = np.divmod(samples, self.windows.count)
        indices = np.array([self._order_of(int(e))[o] for e, o in zip(epochs, offsets)], dtype=np.int64)
        self.next_sample += self.rank_slice.batch_size
        return self.windows.read(indices)

    def state_dict(self) -> dict[str, Any]:
        return {"next_sample": self.next_sample, "windows": self.windows.count, "window": self.windows.window}

    def load_state_dict(self, position: dict[str, Any]) -> None:
        if "next_sample" not in position:
            raise ConfigError(
                "the checkpoint's data position is a streamed source's, this run reads a prepared store: resume "
                "with the data config it was saved with, or start afresh with checkpoint.resume=none"
            )
        if (position["windows"], position["window"]) != (self.windows.count, self.windows.window):
            raise ConfigError(
                f"the checkpoint was saved reading {position['windows']} windows of {position['window']} tokens, "
                f"this store gives {self.windows.count} of {self.windows.window}: resume with the data.path and "
                f"train.seq_len it was saved with"
            )
        self.next_sample = position["next_sample"]


def prepared_validation_rows(directory: str, seq_len: int, val_slice: RankSlice) -> np.ndarray:
    """This rank's rows of the validation set: the first val_slice.batch_size windows of the validation split."""
    manifest = read_manifest(directory)
    windows = TokenWindows(directory, VALIDATION, seq_len + 1, manifest)
    if windows.count < val_slice.batch_size:
        raise ConfigError(
            f"the store at data.path={directory!r} holds {windows.count} validation windows of {seq_len + 1} "
            f"tokens, {val_slice.batch_size} needed: lower train.eval_batches, or prepare again with a larger "
            f"data.val_fraction (or data.val_path)"
        )
    start = val_slice.dp_rank * val_slice.per_rank
    return windows.read(np.arange(start, start + val_slice.per_rank))
