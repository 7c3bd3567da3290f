"""The context-parallel step (`parallel.cp` > 1): every sequence of a batch is split across the cp ranks of the
`cp` mesh dimension, and attention reaches the other ranks' keys and values around a ring (ring_attention.py).

Causal attention makes late tokens cost more than early ones (query i attends to i keys), so cutting the sequence
into cp contiguous pieces would leave the last rank with most of the work. The sequence is cut into 2·cp chunks
instead and rank r keeps chunk r and its mirror 2·cp-1-r: every rank holds the same number of (query, key) pairs.
Tokens, targets and positions (learned or rotary) are cut the same way, so the model sees each token at its true
position. Every rank's loss is the mean over its own tokens, equal in number, so the mean over the cp ranks is the
whole sequence's mean; gradients are averaged over the cp ranks with the data-parallel ones (FSDP shards over
dp_shard x cp, as torchtitan does).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from llmtrain.model.base import LayeredModel
from llmtrain.model.documents import PackedDocuments
from llmtrain.parallel.family import family_layout
from llmtrain.parallel.ring_attention import ring_attention, zigzag_positions


def shard_tokens(tokens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's tokens (batch, seq_len) -> (batch, seq_len / cp), in position order."""
    return tokens[:, zigzag_positions(tokens.shape[1], cp, rank, tokens.device)]


class ContextShard:
    """The sequence layout a context-parallel rank hands its model (gpt.WholeSequence's interface)."""

    windows_by_documents = True

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()
        self.cp, self.rank = mesh.size(), mesh.get_local_rank()

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        return zigzag_positions(t * self.cp, self.cp, self.rank, device)

    def documents(self, starts: torch.Tensor, windows: Iterable[int | None]) -> PackedDocuments:
        """Packed documents of this rank's positions (`starts`: where each one's document starts in the window);
        the ring builds each block's mask from them and the attention window (ring_attention.HeldBlock)."""
        positions = self.positions(starts.shape[1], starts.device) - starts
        return PackedDocuments(starts, positions, dict.fromkeys(windows, starts))

    @property
    def parts(self) -> int:
        return self.cp

    def summed(self, counts: torch.Tensor) -> torch.Tensor:
        """A count over this rank's tokens (a mixture's slots per expert) -> over the whole sequences'."""
        counts = counts.clone()
        dist.all_reduce(counts, group=self.group)
        return counts

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: PackedDocuments | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, None if documents is None else documents.starts, window)


def apply_context_parallel(model: LayeredModel, mesh: DeviceMesh) -> None:
    """Make `model` (or a pipeline stage) run on this rank's zigzag shard of every sequence, as its family's spec
    hands a sequence layout to its modules."""
    family_layout(model).shard_sequence(model, ContextShard(mesh))
