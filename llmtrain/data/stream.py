"""The streamed path: one global order of training windows, sliced per data-parallel rank.

Every rank reads the same seeded window stream and cuts global batch k out of it: windows
[k * batch_size, (k + 1) * batch_size). Data-parallel rank r keeps rows [r * per_rank, (r + 1) * per_rank) of that
batch and splits them into micro-batches. So which sequences form batch k depends only on the seed and the data
config, never on how many ranks share it or how it is split for accumulation (Megatron's global sample order).

The price is that every rank tokenises the whole stream: dp times the text it trains on. A prepared store
(llmtrain/data/prepared.py) keeps the same property while each rank reads only its own rows.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from datasets import IterableDataset

from llmtrain import faults
from llmtrain.data.packing import WindowPacker, pack_windows, tokenize_documents
from llmtrain.data.sources import read_with_retries
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.errors import ConfigError
from llmtrain.model.scoring import UNSCORED

# The source's position is copied after every this many documents read (a copy costs about 5 us, a tenth of reading
# and tokenising a short document): a source reopened after a network error goes on from the last copy, reading
# again the documents read since.
POSITION_EVERY = 64


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

    def rows(self, global_batch: np.ndarray) -> np.ndarray:
        """This rank's rows of a (batch_size, seq_len + 1) global batch."""
        return global_batch[self.dp_rank * self.per_rank : (self.dp_rank + 1) * self.per_rank]

    def micro_batches(
        self, rows: np.ndarray, device: torch.device | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) per micro-batch, from this rank's (per_rank, seq_len + 1) rows, on `device`. To a GPU
        the rows go in one copy from pinned memory that does not wait for the device (non_blocking): the step's
        kernels queue behind it instead of the CPU stalling on it."""
        mine = torch.from_numpy(np.ascontiguousarray(rows))
        if device is not None and device.type == "cuda":
            mine = mine.pin_memory().to(device, non_blocking=True)
        # A token stored negative is context only (packing.untrained): its id is ~value, and what predicts it is not
        # scored. On the device, without a host read.
        tokens = torch.where(mine < 0, ~mine, mine)
        targets = torch.where(mine[:, 1:] < 0, UNSCORED, mine[:, 1:])
        return list(zip(tokens[:, :-1].split(self.micro_batch_size), targets.split(self.micro_batch_size)))


class TrainingWindows:
    """The endless, seeded stream of (seq_len + 1)-token windows, whose position can be saved and restored exactly.

    Documents come in a seeded shard order (HF datasets' `shuffle`, reshuffled each epoch), pass a
    seeded document shuffle buffer, are tokenised with an end-of-text token, concatenated and cut into windows
    (a WindowPacker, as the validation windows are), and the windows pass a seeded shuffle buffer. Every stage keeps
    its state in plain attributes (the source's position is HF's own `state_dict`, the buffers are lists of
    immutable items, the generators numpy states), so `state_dict()` is a cheap snapshot and a resumed stream
    yields exactly the windows the original would have. A read of the source that fails with a network error is
    retried (sources.read_with_retries), the source reopened after the last document read: the windows are the
    same as if it had not failed. `source` names the source in the retries' warnings and the last one's error.
    """

    def __init__(
        self,
        documents: IterableDataset,
        tokenizer: Tokenizer,
        seq_len: int,
        seed: int,
        doc_shuffle_buffer: int,
        window_shuffle_buffer: int,
        tokenize_batch: int = 64,
        source: str = "the training documents",
    ):
        self.documents = documents.shuffle(seed=seed, buffer_size=1)  # shard order only; the buffer is ours
        self.tokenizer = tokenizer
        self.seed = seed
        self.doc_buffer_size, self.window_buffer_size = doc_shuffle_buffer, window_shuffle_buffer
        self.tokenize_batch = tokenize_batch
        self.source = source
        self.epoch = 0
        self.docs_in_epoch = 0
        self.doc_buffer: list[str] = []
        self.doc_rng = np.random.default_rng([seed, 0])
        self.packer = WindowPacker(seq_len + 1)  # tokens not yet cut, windows not yet in the shuffle buffer
        self.window_buffer: list[np.ndarray] = []
        self.window_rng = np.random.default_rng(seed)
        self._source: Iterator[dict] | None = None
        # Where a source reopened after a network error goes on: its state_dict at the last copy (None: the epoch's
        # start) and the documents read since.
        self._source_position: dict | None = None
        self._read_since_position = 0

    # -- position ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "docs_in_epoch": self.docs_in_epoch,
            "source": copy.deepcopy(self.documents.state_dict()) if self._source is not None else None,
            "doc_buffer": list(self.doc_buffer),
            "doc_rng": self.doc_rng.bit_generator.state,
            **self.packer.state_dict(),  # flat "tokens" and "windows", as before the packer: old checkpoints load
            "window_buffer": list(self.window_buffer),
            "window_rng": self.window_rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.docs_in_epoch = state["epoch"], state["docs_in_epoch"]
        self.doc_buffer, self.window_buffer = list(state["doc_buffer"]), list(state["window_buffer"])
        self.packer.load_state_dict(state)
        self.doc_rng.bit_generator.state = state["doc_rng"]
        self.window_rng.bit_generator.state = state["window_rng"]
        self._source = None
        if state["source"] is not None:
            self._source = self._open_source(at=state["source"])

    # -- the stream -------------------------------------------------------------------------------------------
    def __iter__(self) -> TrainingWindows:
        return self

    def __next__(self) -> np.ndarray:
        """The next window out of the window shuffle buffer."""
        if self.window_buffer_size <= 1:
            return self._next_window()
        while len(self.window_buffer) < self.window_buffer_size:
            self.window_buffer.append(self._next_window())
        i = int(self.window_rng.integers(self.window_buffer_size))
        window, self.window_buffer[i] = self.window_buffer[i], self._next_window()
        return window

    def _next_window(self) -> np.ndarray:
        """The next packed window, tokenising a batch of documents whenever the packer has none."""
        while (window := self.packer.take()) is None:
            texts = [self._next_document() for _ in range(self.tokenize_batch)]
            for tokens in tokenize_documents(texts, self.tokenizer, self.tokenize_batch):
                self.packer.add(tokens)
        return window

    def _next_document(self) -> str:
        """The next document out of the document shuffle buffer; an exhausted epoch starts the next one."""
        while True:
            example = read_with_retries(self._read_example, self._reopen_source, self.source)
            if example is None:
                if self.doc_buffer:  # drain the buffer before the next epoch
                    return self.doc_buffer.pop(int(self.doc_rng.integers(len(self.doc_buffer))))
                if self.docs_in_epoch == 0:
                    raise ConfigError(
                        "the training stream has no documents: check data.path / data.name and data.val_fraction"
                    )
                self.epoch, self.docs_in_epoch, self._source = self.epoch + 1, 0, None
                self.doc_rng = np.random.default_rng([self.seed, self.epoch])
                continue
            self.docs_in_epoch += 1
            if self.doc_buffer_size <= 1:
                return example["text"]
            if len(self.doc_buffer) < self.doc_buffer_size:
                self.doc_buffer.append(example["text"])
                continue
            i = int(self.doc_rng.integers(self.doc_buffer_size))
            text, self.doc_buffer[i] = self.doc_buffer[i], example["text"]
            return text

    def _read_example(self) -> dict | None:
        """The source's next document, None at the end of the epoch (its first read opens it)."""
        if self._source is None:
            self._source = self._open_source(at=None)
        faults.document_read(self.source)
        example = next(self._source, None)
        self._read_since_position += 1
        if self._read_since_position == POSITION_EVERY:
            self._source_position, self._read_since_position = self.documents.state_dict(), 0
        return example

    def _open_source(self, at: dict | None) -> Iterator[dict]:
        """This epoch's documents from `at` (a state_dict of the source; None: the epoch's start), which is also where
        the source reopens after a network error until its position is next copied."""
        self._source_position, self._read_since_position = at, 0
        return self._documents_from(at)

    def _reopen_source(self) -> None:
        """The source again, after the last document read: from the last copy of its position, past those read
        since."""
        documents = self._documents_from(self._source_position)
        for _ in itertools.islice(documents, self._read_since_position):
            pass
        self._source = documents

    def _documents_from(self, at: dict | None) -> Iterator[dict]:
        self.documents.set_epoch(self.epoch)
        documents = iter(self.documents)  # a generator: nothing is read before its first next, after the state loads
        if at is not None:
            self.documents.load_state_dict(at)
        return documents


def validation_windows(documents: IterableDataset, tokenizer: Tokenizer, seq_len: int, count: int) -> np.ndarray:
    """The first `count` windows of the (unshuffled) validation stream, or as many as it holds, as one
    (n, seq_len + 1) array; it is the same every eval."""
    texts = (ex["text"] for ex in documents)
    windows = list(itertools.islice(pack_windows(tokenize_documents(texts, tokenizer), seq_len + 1), count))
    return np.stack(windows) if windows else np.zeros((0, seq_len + 1), dtype=np.int64)


class StreamedBatches:
    """This rank's rows of global batch k, k = 0, 1, ...: the next batch_size windows of the stream, sliced."""

    def __init__(self, windows: TrainingWindows, rank_slice: RankSlice):
        self._windows = windows
        self._rank_slice = rank_slice

    def next(self) -> np.ndarray:
        """(per_rank, seq_len + 1) int64: this rank's rows of the next global batch."""
        return self._rank_slice.rows(np.stack(list(itertools.islice(self._windows, self._rank_slice.batch_size))))

    def state_dict(self) -> dict:
        return self._windows.state_dict()
