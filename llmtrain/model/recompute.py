"""Activation checkpointing: trade compute for memory by recomputing a block's activations in backward.

- `full`: keep only each block's input; its whole forward runs again in backward (~1/3 more compute).
- `selective`: keep the outputs of the expensive ops (matmuls, attention) and recompute only the cheap,
  memory-heavy ones between them (LayerNorm, GELU, dropout, adds, reshapes) — most of the saving for a few
  percent of compute (Korthikanti et al., 2022).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_EXPENSIVE = {
    getattr(torch.ops.aten, name)
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
}


def _save_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in _EXPENSIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward: Callable[[torch.Tensor], torch.Tensor], mode: str, x: torch.Tensor) -> torch.Tensor:
    if mode == "full":
        return checkpoint(forward, x, use_reentrant=False)
    return checkpoint(
        forward, x, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, _save_expensive)
    )


def checkpoint_blocks(blocks: Iterable[nn.Module], mode: str) -> None:
    """Make each block recompute its activations in backward (`mode` full or selective; none leaves them be).

    The checkpoint goes *inside* each block's forward rather than around its call: parameter names stay as they
    are (the seeded initialisation and checkpoints are keyed by them), and a block compiled afterwards traces the
    checkpoint from inside. Checkpointing a compiled block from outside fails in backward under the selective
    policy ("Tensor cached during selective activation checkpoint has been mutated"); torchtitan's order is the
    same: checkpoint, then compile, then FSDP."""
    if mode == "none":
        return
    for block in blocks:
        block.forward = partial(_checkpointed, block.forward, mode)
