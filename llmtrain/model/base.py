"""What every model family is: a stack of blocks the layouts can count, initialise and checkpoint, finished (its
base frozen and quantized, as its config says) once its class and every subclass have built their modules. What the
layouts do to a family (its tensor-parallel plan, its pipeline cut, how it takes a shard of each sequence) names its
modules, so it lives with parallelism (llmtrain/parallel/family.py), and the model imports nothing of it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _FinishedWhenBuilt(type):
    """Calls a new model's `finish` after the most derived class's __init__ returns: a family that swaps in modules
    of its own after its base class's __init__ has them frozen and quantized like the rest, with nothing to replay."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        model = super().__call__(*args, **kwargs)
        model.finish()
        return model


class LayeredModel(nn.Module, metaclass=_FinishedWhenBuilt):
    """A stack of blocks (`blocks`, named "0".."n-1" as in the whole model) between an input and an output part.
    Subclasses build their modules, then implement the methods below."""

    blocks: nn.ModuleDict

    def finish(self) -> None:
        """What the whole model needs once every module is built (called on construction: _FinishedWhenBuilt)."""
        return None

    @property
    def tied_parameters(self) -> dict[str, str]:
        """Parameter name -> the name of the parameter it is (a head tied to the embedding), also on a pipeline
        part that holds it as its own copy: checkpoints store it once, under the source."""
        return {}

    def take_expert_load(self, device: torch.device) -> torch.Tensor | None:
        """Slots routed to each expert by this model's (or part's) mixture blocks since the last call, summed over
        the blocks; zeros (on `device`) when the model has experts but this part none; None for a dense model."""
        return None

    def init_parameter(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full`, the whole (unsplit) tensor of parameter `name`, with its initial value."""
        raise NotImplementedError
