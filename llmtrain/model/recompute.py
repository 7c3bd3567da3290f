"""Activation checkpointing: trade compute for memory by recomputing a block's activations in backward.

- `full`: keep only each block's input; its whole forward runs again in backward (~1/3 more compute).
- `selective`: keep the outputs of the expensive ops (matmuls, attention) and recompute only the cheap,
  memory-heavy ones between them (LayerNorm, GELU, dropout, adds, reshapes) — most of the saving for a few
  percent of compute (Korthikanti et al., 2022). A low-rank adapter's up-projection is recomputed too: its
  output is as wide as its layer's, its cost r / width of the layer's matmul. Communication is kept too, so
  that backward does not repeat it over the wire: tensor parallelism's reduce-scatters, expert parallelism's
  all-to-alls, and context parallelism's whole ring (one operator, llmtrain/parallel/ring_attention.py, whose
  inside is never recorded: no score block is kept); and the router's top-k, whose ties must not be broken
  differently on recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# Operators by qualified name: the ring's is registered by the parallel layer, which the model does not import.
SAVED_BY_SELECTIVE = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_grouped_mm",
        "aten::_scaled_mm",  # train.float8's matmuls on FP8 tensor cores
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::topk",
        "_c10d_functional::all_reduce",
        "_c10d_functional::reduce_scatter_tensor",
        "_c10d_functional::all_to_all_single",
        "llmtrain::ring_attention",
        "higher_order::flex_attention",  # train.attention=document and sliding windows on CUDA (model/documents.py)
    }
)


def _qualified_name(op) -> str:
    """An operator's qualified name; a higher-order operator (FlexAttention's, which has no overload packet) by
    its own name under `higher_order::`."""
    packet = getattr(op, "overloadpacket", None)
    return packet._qualified_op_name if packet is not None else f"higher_order::{op.name()}"


# Where each matmul's two matrix operands are among its arguments
MATRIX_OPERANDS = {"aten::mm": (0, 1), "aten::bmm": (0, 1), "aten::_grouped_mm": (0, 1), "aten::addmm": (1, 2),
                   "aten::baddbmm": (1, 2)}  # fmt: skip
# A matmul whose output is this many times wider than the dimension it sums over costs little to recompute next to
# what its output would hold: a low-rank adapter's up-projection (model/lora.py), rank r to the layer's width.
LOW_RANK_WIDENING = 8


def _save_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    name = _qualified_name(op)
    if name in SAVED_BY_SELECTIVE and not _widens_a_low_rank(name, args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _widens_a_low_rank(name: str, args: tuple) -> bool:
    """Whether a matmul sums over a dimension LOW_RANK_WIDENING times narrower than its output: kept, an
    adapter's B output would be as large as its layer's (Llama 3.1 8B under LoRA held 10 GiB more activations than
    its full fine-tune at 4,096 tokens), recomputed it costs r / width of the layer's matmul."""
    operands = [args[index] for index in MATRIX_OPERANDS.get(name, ()) if index < len(args)]
    if len(operands) < 2 or not all(isinstance(operand, torch.Tensor) for operand in operands):
        return False
    return operands[0].shape[-1] * LOW_RANK_WIDENING <= operands[1].shape[-1]


def recomputed(compute: Callable[[torch.Tensor], torch.Tensor], mode: str, x: torch.Tensor) -> torch.Tensor:
    """`compute(x)`, its activations recomputed in backward as `mode` (a RECOMPUTE_MODES name) says.

    A block calls this inside its own forward (llmtrain/model/gpt.py's Block, which is built with its mode) rather
    than being wrapped: parameter names stay as they are (the seeded initialisation and checkpoints are keyed by
    them), and a block compiled afterwards traces the checkpoint from inside. Checkpointing a compiled block from
    outside fails in backward under the selective policy ("Tensor cached during selective activation checkpoint
    has been mutated"), and torch's hook-based composable checkpoint breaks a fullgraph compile; torchtitan's
    order is the same: checkpoint, then compile, then FSDP."""
    if mode == "none":
        return compute(x)
    if mode == "full":
        return checkpoint(compute, x, use_reentrant=False)
    return checkpoint(
        compute, x, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, _save_expensive)
    )
