"""What a training step optimizes. An Objective turns what its data source yields for this rank's slice of a global
batch (token rows; data=rl's prompts) into the micro-batches the layout trains on, names what the step records beside
its loss and what of it the console line shows, and validates. Every layout trains any objective
whose gradient is a weighted sum over target tokens (model/scoring.py's weighted targets: DPO's is one), so an
objective never touches the layout. The Trainer (loop.py) names none: train.objective picks a row of
llmtrain/catalog/objectives.py's OBJECTIVES, built here for the job's model and data."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llmtrain.catalog import OBJECTIVES, imported, objective_of
from llmtrain.config import RootConfig
from llmtrain.data import Data, RankSlice, SourceBatch
from llmtrain.data.tokenizers import token_byte_lengths
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.parallel.tensors import MicroBatches


@dataclass(frozen=True)
class PreparedStep:
    """One step's batch as the layout trains it, and what the step records of it."""

    micro_batches: MicroBatches  # what the layout's forward/backward trains on
    loss: torch.Tensor | None  # on the device: the loss the step records; None: the loss trained on
    # on the device, by name: what the step records beside its loss, each one value, read with the step's results
    metrics: dict[str, torch.Tensor]


class Objective:
    """What a step optimizes, for one job's model and data. Subclasses are built by (model, data, this rank's slices
    of a training and of a validation batch, config): whole when made, collectively (every rank builds its own at
    the same point)."""

    def prepared(self, batch: SourceBatch) -> PreparedStep:
        """Collective: what the data source yielded for this rank's slice of a global batch, as the layout trains
        it."""
        raise NotImplementedError

    def recorded(self, metrics: dict[str, float]) -> dict[str, Any]:
        """The step's record entries from its metrics, read on the host."""
        return dict(metrics)

    def console(self, record: dict[str, Any]) -> list[str]:
        """What a step's console line shows of this objective's entries of `record`, after its loss."""
        return []

    def validation(self) -> dict[str, float]:
        """Collective: the held-out data's losses (`val_loss`, ...), the model in eval mode."""
        raise NotImplementedError


def build_objective(
    config: RootConfig, model: ParallelModel, data: Data, train_slice: RankSlice, val_slice: RankSlice
) -> Objective:
    """Collective: train.objective's row built for this job (`auto`: the data's)."""
    name = objective_of(config.train.objective, config.data.source)
    return imported(OBJECTIVES[name].implementation)(model, data, train_slice, val_slice, config)


def token_rows(batch: SourceBatch) -> np.ndarray:
    """`batch` as the token rows (rows, seq_len + 1) of a source of text, conversations or pairs; a source of
    anything else (data=rl's prompts) feeds another objective, which the config's check makes sure of."""
    assert isinstance(batch, np.ndarray), f"token rows expected, not a {type(batch).__name__}"
    return batch


class NextToken(Objective):
    """The mean next-token cross-entropy over the targets the data trains; where it leaves some untrained
    (fine-tuning's prompts), each step records how many it trained (`trained_tokens`). Validation: each held-out
    set's loss, their mean weighted as the sets are (`val_loss`), its bits per UTF-8 byte (`val_bpb`: comparable
    across tokenizers) and each named set's own `val_loss/<source>`."""

    def __init__(
        self, model: ParallelModel, data: Data, train_slice: RankSlice, val_slice: RankSlice, config: RootConfig
    ):
        self._model, self._data, self._train_slice, self._val_slice = model, data, train_slice, val_slice
        self._val_bytes_per_token = self._measured_val_bytes_per_token()

    def _measured_val_bytes_per_token(self) -> list[float]:
        """Collective: per validation set, the UTF-8 bytes per scored token (every rank holds as many rows)."""
        if not self._data.validation:
            return []
        lengths = token_byte_lengths(self._data.tokenizer)
        mine = []
        for validation in self._data.validation:
            targets = token_rows(validation.rows)[:, 1:]
            scored = targets[targets >= 0]  # fine-tuning scores the assistant's tokens alone (data/packing.py)
            mine.append(float(lengths[scored].sum()) / max(scored.size, 1))
        device = self._model.runtime.device
        return self._model.reduce_mean(torch.tensor(mine, device=device)).tolist()

    def prepared(self, batch: SourceBatch) -> PreparedStep:
        device = self._model.runtime.device
        rows = token_rows(batch)
        micro_batches = self._train_slice.micro_batches(rows, device)
        if not self._data.masks_targets:
            return PreparedStep(micro_batches, None, {})
        # the targets trained in the global batch: counted on the host from this rank's rows, summed on the device
        mine = torch.full((), float((rows[:, 1:] >= 0).sum()), device=device)
        trained = self._model.reduce_mean(mine) * self._model.plan.dp_size
        return PreparedStep(micro_batches, None, {"trained_tokens": trained})

    def recorded(self, metrics: dict[str, float]) -> dict[str, Any]:
        return {name: round(value) for name, value in metrics.items()}

    def validation(self) -> dict[str, float]:
        device = self._model.runtime.device
        # One host read for all the sets: the device runs every set's forwards without waiting in between.
        losses = torch.stack(
            [
                self._model.reduce_mean(self._model.evaluate(self._val_slice.micro_batches(token_rows(v.rows), device)))
                for v in self._data.validation
            ]
        ).tolist()
        weights = [v.weight for v in self._data.validation]
        total = sum(weights)
        record = {"val_loss": sum(w * loss for w, loss in zip(weights, losses)) / total}
        if all(self._val_bytes_per_token):  # nats per token -> bits per byte
            bits = [loss / (math.log(2) * per_token) for loss, per_token in zip(losses, self._val_bytes_per_token)]
            record["val_bpb"] = sum(w * b for w, b in zip(weights, bits)) / total
        for v, loss in zip(self._data.validation, losses):
            if v.name is not None:
                record[f"val_loss/{v.name}"] = loss
        return record
