"""The next-token losses a step trains on, in fp32 whatever the logits' dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over the scored positions (targets other than scoring.UNSCORED, F.cross_entropy's
    ignore_index), in fp32: training scales it by the global batch's count of scored targets."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


# The most fp32 (position x vocabulary) values the eager loss computes at once (256 MiB): more positions than this
# holds are taken a chunk at a time (chunked_cross_entropy).
LOSS_CHUNK_VALUES = 1 << 26


def _flat_summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """summed_cross_entropy a chunk of positions at a time, each chunk's fp32 log-probabilities recomputed in
    backward rather than kept: no more than LOSS_CHUNK_VALUES of them exist at once, where the whole loss would hold
    (positions x vocabulary) of them and as many of their gradient (Gemma 3's 262,144-token vocabulary at 2,048
    positions: 2 GiB each). The logits themselves, in their own dtype, are kept for backward instead."""
    flat_logits, flat_targets = logits.flatten(0, 1), targets.flatten()
    rows = max(1, LOSS_CHUNK_VALUES // flat_logits.shape[-1])
    if flat_logits.shape[0] <= rows:
        return _flat_summed_cross_entropy(flat_logits, flat_targets)
    chunks = zip(flat_logits.split(rows), flat_targets.split(rows))
    if not torch.is_grad_enabled():
        return torch.stack([_flat_summed_cross_entropy(part, part_targets) for part, part_targets in chunks]).sum()
    return torch.stack(
        [
            checkpoint(_flat_summed_cross_entropy, part, part_targets, use_reentrant=False)
            for part, part_targets in chunks
        ]
    ).sum()
