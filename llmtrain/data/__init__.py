"""Data: sources -> tokenizer -> packed windows in one global order -> this rank's slice of batch k."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from llmtrain.config import DataConfig
from llmtrain.data.sources import TRAIN, VALIDATION, open_documents
from llmtrain.data.stream import GlobalBatches, RankSlice, TrainingWindows, validation_windows
from llmtrain.data.tokenizers import Tokenizer, build_bpe, load_tokenizer

# The BPE is trained on a fixed shuffle of the training documents, so it does not change with the run's seed.
TOKENIZER_TRAINING_SEED = 0


@dataclass
class Data:
    tokenizer: Tokenizer
    train: GlobalBatches
    val_windows: np.ndarray | None  # the fixed validation set, (n, seq_len + 1); None when eval is disabled


def build_tokenizer(data_cfg, is_main: bool, barrier: Callable[[], None]) -> Tokenizer:
    """Load the configured tokenizer; a BPE not yet cached is trained by rank 0 while the others wait."""
    bpe_path = None
    if data_cfg.tokenizer.kind == "bpe":
        if is_main:
            docs = open_documents(data_cfg, TRAIN).shuffle(
                seed=TOKENIZER_TRAINING_SEED, buffer_size=data_cfg.doc_shuffle_buffer
            )
            bpe_path = build_bpe(data_cfg, (ex["text"] for ex in docs))
        barrier()
    return load_tokenizer(data_cfg, bpe_path)


def build_data(
    data_cfg: DataConfig,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    seed: int,
    val_slice: RankSlice | None,
    position: dict | None = None,
) -> Data:
    """The training batch stream (global batches of `batch_size` windows of seq_len + 1 tokens in the order
    `seed` gives, started in the background, at `position` when resuming) and the validation windows all ranks
    share."""
    windows = TrainingWindows(
        open_documents(data_cfg, TRAIN),
        tokenizer,
        seq_len,
        seed,
        data_cfg.doc_shuffle_buffer,
        data_cfg.window_shuffle_buffer,
    )
    if position is not None:
        windows.load_state_dict(position)
    val = None
    if val_slice is not None:
        val = validation_windows(open_documents(data_cfg, VALIDATION), tokenizer, seq_len, val_slice.batch_size)
    return Data(tokenizer=tokenizer, train=GlobalBatches(windows, batch_size), val_windows=val)


__all__ = ["Data", "GlobalBatches", "RankSlice", "build_data", "build_tokenizer"]
