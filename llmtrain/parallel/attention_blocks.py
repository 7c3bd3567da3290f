"""Attention over one block of keys on the fused kernels, returning what ring attention merges blocks by: the
output and the log-sum-exp of each query row's scores; and the block's gradients from the *whole* row's output and
log-sum-exp, which is how the flash kernels' backward already works (it recomputes the probabilities as
exp(scores - lse) and needs rowsum(dO · O) of the final output), so a block's backward is one kernel call.

The kernel for a device and dtype:
  - CPU: `_scaled_dot_product_flash_attention_for_cpu` (fp32 and bf16), what SDPA itself runs on CPU;
  - CUDA bf16/fp16: flash attention; CUDA fp32: memory-efficient attention (flash has no fp32 kernel), whose
    log-sum-exp comes padded to a multiple of 32 rows and is cut to the rows here (and padded back for backward).
Neither is given a dropout probability, so the random-state arguments of the CUDA backward are never read (the
kernels read them only when dropping out); context parallelism refuses attention dropout (plan.py).

Grouped-query keys and values are repeated for the query heads they serve and their gradients folded back: the
CUDA kernels take equal head counts.

A block may carry a mask (packed documents, model/documents.py: which keys each query sees), handed to the kernels
as an additive bias (0 or -inf, in the compute dtype): the CPU kernel takes one, and on CUDA such a block runs on the
memory-efficient kernel (flash takes none), its bias allocated with rows padded to 16 elements as that kernel
requires. A query that sees no key of the block gets a zero output and a log-sum-exp of -inf, so that merging the
block changes nothing (the CPU kernel reports 0 for such a row).
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient over the repeated heads -> over the key/value heads they came from."""
    heads = grad.shape[1]
    return grad if heads == kv_heads else grad.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)


def _efficient_lse_rows(rows: int) -> int:
    """Rows of the memory-efficient kernel's log-sum-exp (padded to 32 on CUDA builds, not on ROCm)."""
    return rows if torch.version.hip else math.ceil(rows / 32) * 32


def _bias(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A (batch, 1, rows, keys) bool mask -> the additive bias (batch, heads, rows, keys) in q's dtype, its rows
    padded to a multiple of 16 elements in memory (the CUDA memory-efficient kernel's alignment)."""
    keys = mask.shape[-1]
    padded = q.new_zeros(*mask.shape[:-1], math.ceil(keys / 16) * 16)
    bias = padded[..., :keys].masked_fill_(~mask, float("-inf"))
    return bias.expand(mask.shape[0], q.shape[1], *mask.shape[2:])


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q (batch, heads, rows, dim) over one block of keys and values: the output in q's dtype
    and the log-sum-exp (batch, heads, rows), fp32. `causal`: q and the block are the same positions, in order;
    `mask` (batch, 1, rows, keys), bool: which keys each query sees (instead of `causal`)."""
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    bias = None if mask is None else _bias(mask, q)
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)
    elif q.dtype in (torch.bfloat16, torch.float16) and bias is None:
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    else:
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal)
        lse = lse[..., : q.shape[-2]]
    if mask is not None:
        blind = ~mask.any(-1)  # (batch, 1, rows): queries that see no key here
        out = out.masked_fill(blind[..., None], 0.0)
        lse = lse.masked_fill(blind, float("-inf"))
    return out, lse.contiguous()


def block_attention_backward(
    out_grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k and v through one block, given the whole row's output and log-sum-exp (what the block's
    probabilities are normalised by once every block is merged); `mask` as block_attention's."""
    kv_heads = k.shape[1]
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    lse = lse.contiguous()
    bias = None if mask is None else _bias(mask, q)
    if q.device.type == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            out_grad, q, k, v, out, lse, 0.0, causal, attn_mask=bias
        )
    elif q.dtype in (torch.bfloat16, torch.float16) and bias is None:
        unused = torch.empty(2, dtype=torch.uint64, device=q.device)
        rows, keys = q.shape[-2], k.shape[-2]
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            out_grad, q, k, v, out, lse, None, None, rows, keys, 0.0, causal, unused, unused[0]
        )
    else:
        padded = lse.new_zeros(*lse.shape[:-1], _efficient_lse_rows(q.shape[-2]))
        padded[..., : q.shape[-2]] = lse
        unused = torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            out_grad, q, k, v, bias, out, padded, unused, unused, 0.0, [True, True, True, False], causal
        )
    return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)
