"""Dropout whose mask does not depend on how the tensor is split across ranks.

Each call draws one seed from the global CPU generator, which the tensor-parallel ranks of one data-parallel
group advance in lockstep (the job seeds it with seed + data-parallel rank) and activation checkpointing restores
before a recompute; it then draws the mask of the *whole* (unsplit) tensor from that seed and keeps the part this
rank holds. So ranks holding the same data drop the same elements, ranks holding different shards or sequences
drop different ones, a recomputed block drops the same elements again, and a tensor-parallel run drops exactly
what the single-process run drops. The price: each rank draws the full mask (t times the random numbers of its
shard), paid only when dropout is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Split:
    """This rank holds chunk `rank` of `parts` equal chunks along dimension `dim`."""

    dim: int
    rank: int
    parts: int


class Dropout(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.split: Split | None = None  # set by tensor parallelism when the input is a shard

    def _keep_mask(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        seed = int(torch.randint(0, 2**62, (1,)))
        full_shape = list(shape)
        if self.split is not None:
            full_shape[self.split.dim] *= self.split.parts
        generator = torch.Generator(device=device).manual_seed(seed)
        keep = torch.rand(full_shape, generator=generator, device=device) >= self.p
        if self.split is not None:
            local = shape[self.split.dim]
            keep = keep.narrow(self.split.dim, self.split.rank * local, local)
        return keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return x * self._keep_mask(x.shape, x.device) / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, split={self.split}"
