"""One global order of training windows, sliced per data-parallel rank.

Every rank reads the same seeded window stream and cuts global batch k out of it: windows
[k * batch_size, (k + 1) * batch_size). Data-parallel rank r keeps rows [r * per_rank, (r + 1) * per_rank) of that
batch and splits them into micro-batches. So which sequences form batch k depends only on the seed and the data
config, never on how many ranks share it or how it is split for accumulation (Megatron's global sample order).
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from datasets import IterableDataset

from llmtrain.config import ConfigError
from llmtrain.data.packing import pack_windows, shuffle_windows, tokenize_documents
from llmtrain.data.tokenizers import Tokenizer


@dataclass(frozen=True)
class RankSlice:
    """Which part of each global batch this rank computes on."""
    batch_size: int  # global sequences per step
    micro_batch_size: int
    dp_rank: int
    dp_size: int

    @property
    def per_rank(self) -> int:
        return self.batch_size // self.dp_size

    @property
    def accumulation(self) -> int:
        return self.per_rank // self.micro_batch_size

    def micro_batches(self, global_batch: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) per micro-batch for this rank, from a (batch_size, seq_len + 1) array."""
        mine = torch.from_numpy(np.ascontiguousarray(
            global_batch[self.dp_rank * self.per_rank:(self.dp_rank + 1) * self.per_rank]))
        return [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(self.micro_batch_size)]


def training_windows(documents: IterableDataset, tokenizer: Tokenizer, seq_len: int, seed: int,
                     doc_shuffle_buffer: int, window_shuffle_buffer: int) -> Iterator[np.ndarray]:
    """An endless, seeded stream of (seq_len + 1)-token windows: epoch e reshuffles the documents with seed + e."""
    def epochs() -> Iterator[np.ndarray]:
        shuffled = documents.shuffle(seed=seed, buffer_size=doc_shuffle_buffer)
        for epoch in itertools.count():
            shuffled.set_epoch(epoch)
            empty = True
            for tokens in tokenize_documents((ex["text"] for ex in shuffled), tokenizer):
                empty = False
                yield tokens
            if empty:
                raise ConfigError("the training stream has no documents: check data.path / data.name and "
                                 "data.val_fraction")

    return shuffle_windows(pack_windows(epochs(), seq_len + 1), window_shuffle_buffer, seed)


def validation_windows(documents: IterableDataset, tokenizer: Tokenizer, seq_len: int, count: int) -> np.ndarray:
    """The first `count` windows of the (unshuffled) validation stream, as one array; it is the same every eval."""
    texts = (ex["text"] for ex in documents)
    windows = list(itertools.islice(pack_windows(tokenize_documents(texts, tokenizer), seq_len + 1), count))
    if len(windows) < count:
        raise ConfigError(f"the validation stream holds only {len(windows)} windows of {seq_len + 1} tokens, "
                         f"{count} needed: lower train.eval_batches or raise data.val_fraction")
    return np.stack(windows)


class GlobalBatches:
    """Global batch k, built in a background thread so tokenisation overlaps the training step."""

    def __init__(self, windows: Iterator[np.ndarray], batch_size: int, prefetch: int = 2):
        self._windows = windows
        self._batch_size = batch_size
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._thread = threading.Thread(target=self._produce, daemon=True, name="llmtrain-data")
        self._thread.start()

    def _produce(self) -> None:
        try:
            while True:
                rows = list(itertools.islice(self._windows, self._batch_size))
                self._queue.put(np.stack(rows))
        except BaseException as error:  # surfaced to the training thread, which owns error handling
            self._queue.put(error)

    def next(self) -> np.ndarray:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

