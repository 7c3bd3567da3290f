"""What every model family is: a stack of blocks the layouts can count, initialise and checkpoint, finished (its
base frozen and quantized, as its config says) once its class and every subclass have built their modules, and what
it offers a decoder (its context, its vocabulary, a step over a KV cache: the sampler, the chat and GRPO's rollouts
decode every family through it alone). What the
layouts do to a family (its tensor-parallel plan, its pipeline cut, how it takes a shard of each sequence) names its
modules, so it lives with parallelism (llmtrain/parallel/family.py), and the model imports nothing of it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from llmtrain.model.kv_cache import KVCache


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

    # -- what a decoder asks of the model (llmtrain/model/sampling.py; laid out: llmtrain/parallel/sampling.py) ------
    @property
    def context_length(self) -> int:
        """The most positions a row may hold, prompt and answer together."""
        raise NotImplementedError(self._cannot_decode())

    @property
    def vocab_size(self) -> int:
        """The tokens its logits score (the head's padding rows left out)."""
        raise NotImplementedError(self._cannot_decode())

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The last position's logits (rows, 1, vocabulary, under tensor parallelism a DTensor over its shards) after
        the next columns `tokens` (rows, t) of `cache`'s rows, its `filled` columns before them; their keys and values
        written to the cache, no gradient kept. The caller advances the cache."""
        raise NotImplementedError(self._cannot_decode())

    def _cannot_decode(self) -> str:
        return (
            f"{type(self).__name__} does not decode: implement LayeredModel's context_length, vocab_size and decode "
            f"(llmtrain/model/base.py) to sample, chat or run GRPO on it"
        )
