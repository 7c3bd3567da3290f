"""What every model family is: a stack of blocks the layouts can count, initialise and checkpoint. What the layouts
do to a family (its tensor-parallel plan, its pipeline cut, how it takes a shard of each sequence) names its
modules, so it lives with parallelism (llmtrain/parallel/family.py), and the model imports nothing of it."""

from __future__ import annotations

import torch
from torch import nn


class LayeredModel(nn.Module):
    """A stack of blocks (`blocks`, named "0".."n-1" as in the whole model) between an input and an output part.
    Subclasses build their modules, then implement the methods below."""

    blocks: nn.ModuleDict

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
