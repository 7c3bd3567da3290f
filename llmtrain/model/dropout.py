"""Dropout whose mask does not depend on how the tensor is split across ranks, and that compiles into one kernel.

The mask is counter-based: element i of the *whole* (unsplit) tensor is kept when hash(seed, i) clears the drop
threshold. A rank holding a chunk computes the hashes of its own elements' global indices only, so ranks holding
the same data drop the same elements, ranks holding different shards or sequences drop different ones, and a
tensor- or sequence-parallel run drops exactly what the single-process run drops, without any rank drawing the
whole mask. (JAX's partitionable threefry makes the same trade.)

The seed is one draw per call from the global CPU generator, kept as a tensor (no host read): the tensor-parallel
ranks of one data-parallel group advance that generator in lockstep (the job seeds it with seed + data-parallel
rank) and activation checkpointing restores it before a recompute, so a recomputed block drops the same elements.
Under torch.compile the draw and the hash become part of the block's graph (no break, no torch.Generator), and
the mask is made in registers by the fused kernel; eager mode pays a handful of integer kernels instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from llmtrain.model.counter_random import hashed


@dataclass(frozen=True)
class Split:
    """This rank holds chunk `rank` of `parts` equal chunks along dimension `dim`."""

    dim: int
    rank: int
    parts: int


def global_indices(shape: torch.Size, split: Split | None, device: torch.device) -> torch.Tensor:
    """Each element's position (row-major) in the unsplit tensor that this rank's `shape` is a chunk of."""
    local = torch.arange(shape.numel(), device=device, dtype=torch.int64).view(shape)
    if split is None or split.parts == 1:
        return local
    chunk = shape[split.dim :].numel()  # elements of one chunk per index of the dimensions before `dim`
    return local + (local // chunk) * ((split.parts - 1) * chunk) + split.rank * chunk


def keep_mask(
    shape: torch.Size, p: float, seed: torch.Tensor, split: Split | None, device: torch.device
) -> torch.Tensor:
    """True where an element survives dropout with probability `p`, the same for any split of the tensor."""
    return (hashed(global_indices(shape, split, device), seed) & 0xFFFFFFFF) >= int(p * 2**32)


def _split_of(x: DTensor) -> Split | None:
    """The chunk of the whole tensor a DTensor on a one-dimensional mesh holds (None: all of it)."""
    placement = x.placements[0]
    if not isinstance(placement, Shard):
        return None
    mesh = x.device_mesh
    return Split(dim=placement.dim % x.ndim, rank=mesh.get_local_rank(), parts=mesh.size())


class Dropout(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.split: Split | None = None  # set by tensor parallelism when the input is a shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        seed = torch.randint(0, 2**62, ())
        if isinstance(x, DTensor):  # inside a tensor-parallel layer (a low-rank adapter's input): its own chunk
            local, split = x.to_local(), _split_of(x)
            dropped = local * keep_mask(local.shape, self.p, seed, split, local.device) / (1 - self.p)
            return DTensor.from_local(dropped, x.device_mesh, x.placements, run_check=False)
        return x * keep_mask(x.shape, self.p, seed, self.split, x.device) / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, split={self.split}"
