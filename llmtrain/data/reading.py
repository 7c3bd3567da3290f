"""What the data gives a job: this rank's training batches (token rows, or a source's own kind: data=rl's prompts),
its validation rows, the tokenizer and a description; and what a source reader is told of this rank's place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from llmtrain.data.prefetch import Prefetched
from llmtrain.data.rl import PromptBatch
from llmtrain.data.stream import RankSlice
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.model.scoring import TokenMarks

# What a source yields for this rank's slice of a global batch: (rows, seq_len + 1) token rows (text, conversations,
# pairs), or data=rl's completion slots. The objective the source feeds reads it (train/objectives.py).
SourceBatch: TypeAlias = "np.ndarray | PromptBatch"


@dataclass(frozen=True)
class ValidationSet:
    """This rank's part of a fixed validation set: the run's one (name None), or a mixture source's (`val_loss` is
    then the weighted mean over the sources, each also logged as `val_loss/<name>`)."""

    name: str | None
    weight: float
    rows: SourceBatch


@dataclass(frozen=True)
class DataReading:
    """Where this rank reads: its rows of each global training batch (`train`) and of the validation set
    (`validation`; None when eval is off), from `position` (a checkpoint's) when resuming."""

    train: RankSlice
    validation: RankSlice | None = None
    position: dict | None = None


@dataclass
class Data:
    tokenizer: Tokenizer
    train: Prefetched[SourceBatch]
    validation: list[ValidationSet]  # empty when eval is disabled
    description: str  # for the start summary
    masks_targets: bool = False  # some tokens are context only, their targets untrained (fine-tuning, packing.py)
    separator: int | None = None  # the token between packed documents where it is not the tokenizer's end-of-text

    @property
    def document_separator(self) -> int:
        """The token after which a packed document ends (model/documents.py)."""
        return self.tokenizer.eos_id if self.separator is None else self.separator

    @property
    def marks(self) -> TokenMarks:
        """What a step needs of these tokens: their document separator, whether they leave targets untrained."""
        return TokenMarks(self.document_separator, self.masks_targets)

    def close(self) -> None:
        self.train.close()

    def source_tokens(self, seq_len: int) -> dict[str, int]:
        """`tokens/<source>`: the tokens trained on from each source of a mixture so far ({} for one source)."""
        sources = self.train.state_dict().get("sources", {})
        return {f"tokens/{name}": entry["taken"] * seq_len for name, entry in sources.items()}
