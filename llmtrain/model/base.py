"""What a model family tells the parallel layouts about itself: the data-parallel, pipeline and context-parallel
steps work on any `LayeredModel`. A family's tensor-parallel plan names its modules, so it lives with tensor
parallelism (llmtrain/parallel/tp.py), and the model imports nothing of it."""

from __future__ import annotations

from collections.abc import Sequence

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

    def shard_sequence(self, sequence) -> None:
        """Run on a shard of every sequence: `sequence` gives the positions this rank holds and the attention that
        reaches the other shards (context parallelism, llmtrain/parallel/context.py)."""
        raise NotImplementedError

    def take_expert_load(self, device: torch.device) -> torch.Tensor | None:
        """Slots routed to each expert by this model's (or part's) mixture blocks since the last call, summed over
        the blocks; zeros (on `device`) when the model has experts but this part none; None for a dense model."""
        return None

    def pipeline_part(self, layers: Sequence[int], first: bool, last: bool) -> LayeredModel:
        """A pipeline rank's part on the meta device: the blocks `layers`, the input part when it runs the first
        stage, the output part when it runs the last (its own copy of a tied parameter)."""
        raise NotImplementedError

    def stage_view(self, layers: Sequence[int], first: bool, last: bool) -> LayeredModel:
        """The module that runs one pipeline stage, made of this part's own modules (shared, not copied)."""
        raise NotImplementedError

    def init_parameter(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full`, the whole (unsplit) tensor of parameter `name`, with its initial value."""
        raise NotImplementedError
