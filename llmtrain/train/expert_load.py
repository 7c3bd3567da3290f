"""The experts' load, for a model with mixture-of-experts blocks: slots routed to each expert in each step over the
whole global batch, and how unevenly (`expert_load`, `expert_imbalance` in the step's record). A step observer
(observers.py), so the loop names no model's feature: its counts come over with the step's one host read."""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.train.observers import StepObserver


class ExpertLoad(StepObserver):
    """Adds each step's expert load to its record."""

    def __init__(self, model: ParallelModel):
        self._model = model

    def values_to_read(self, step: int) -> torch.Tensor | None:
        return self._model.expert_load()

    def results_read(self, step: int, values: list[float] | None, record: dict[str, Any]) -> None:
        if values:
            record["expert_load"] = [round(value) for value in values]
            record["expert_imbalance"] = max(values) * len(values) / max(sum(values), 1)
