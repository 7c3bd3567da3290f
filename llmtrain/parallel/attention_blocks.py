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

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class AttendedQueries:
    """What a block's backward needs of its queries (batch, heads, rows, dim): the queries themselves, and the whole
    row's merged output, log-sum-exp (batch, heads, rows) and output gradient, all for the same rows."""

    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    out_grad: torch.Tensor

    def rows(self, rows: slice) -> AttendedQueries:
        """The same for some of the rows (views)."""
        return AttendedQueries(
            self.q[..., rows, :], self.out[..., rows, :], self.lse[..., rows], self.out_grad[..., rows, :]
        )


@dataclass(frozen=True)
class CudaAttentionOps:
    """CUDA's fused attention kernels, in aten's signatures: torch's own, or their arithmetic emulated in plain
    torch (kernel_emulation.py), which runs anywhere."""

    flash: Callable[..., Any] = aten._scaled_dot_product_flash_attention
    flash_backward: Callable[..., Any] = aten._scaled_dot_product_flash_attention_backward
    efficient: Callable[..., Any] = aten._scaled_dot_product_efficient_attention
    efficient_backward: Callable[..., Any] = aten._scaled_dot_product_efficient_attention_backward


class HostKernels:
    """The CPU's flash kernel (fp32 and bf16), what SDPA itself runs on CPU; it takes a bias."""

    def forward(self, q, k, v, causal: bool, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)
        return out, lse

    def backward(self, queries: AttendedQueries, k, v, causal: bool, bias: torch.Tensor | None) -> list[torch.Tensor]:
        out_grad, q, out, lse = queries.out_grad, queries.q, queries.out, queries.lse
        return list(
            aten._scaled_dot_product_flash_attention_for_cpu_backward(
                out_grad, q, k, v, out, lse, 0.0, causal, attn_mask=bias
            )
        )


@dataclass(frozen=True)
class CudaKernels:
    """Flash attention for bf16/fp16 blocks without a bias; the memory-efficient kernel for fp32 (flash has none)
    and for a block with a bias (flash takes none)."""

    ops: CudaAttentionOps = CudaAttentionOps()

    def forward(self, q, k, v, causal: bool, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dtype in (torch.bfloat16, torch.float16) and bias is None:
            out, lse, *_ = self.ops.flash(q, k, v, 0.0, causal)
            return out, lse
        out, lse, *_ = self.ops.efficient(q, k, v, bias, True, 0.0, causal)
        return out, lse[..., : q.shape[-2]]

    def backward(self, queries: AttendedQueries, k, v, causal: bool, bias: torch.Tensor | None) -> list[torch.Tensor]:
        out_grad, q, out, lse = queries.out_grad, queries.q, queries.out, queries.lse
        if q.dtype in (torch.bfloat16, torch.float16) and bias is None:
            unused = torch.empty(2, dtype=torch.uint64, device=q.device)
            rows, keys = q.shape[-2], k.shape[-2]
            return list(
                self.ops.flash_backward(
                    out_grad, q, k, v, out, lse, None, None, rows, keys, 0.0, causal, unused, unused[0]
                )
            )
        padded = lse.new_zeros(*lse.shape[:-1], _efficient_lse_rows(q.shape[-2]))
        padded[..., : q.shape[-2]] = lse
        unused = torch.empty((), dtype=torch.int64, device=q.device)
        # The kernel's bf16/fp16 backward computes rowsum(dO * O) itself and reads `out` at a row stride of
        # heads x head_dim, the layout its own forward writes ((batch, rows, heads, dim) in memory), whatever the
        # tensor's strides say; a merged output laid out (batch, heads, rows, dim) was read at the wrong rows and,
        # for the later heads, past its end: NaN in dq and dk (kernel_emulation.py emulates the read).
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        dq, dk, dv, _ = self.ops.efficient_backward(
            out_grad, q, k, v, bias, out, padded, unused, unused, 0.0, [True, True, True, False], causal
        )
        return [dq, dk, dv]


# The kernels each device type runs; `kernels_for` answers with an emulation where one is in force.
KERNELS: dict[str, HostKernels | CudaKernels] = {"cpu": HostKernels(), "cuda": CudaKernels()}
_EMULATED: dict[str, HostKernels | CudaKernels] = {}


def kernels_for(device: torch.device) -> HostKernels | CudaKernels:
    return _EMULATED.get(device.type) or KERNELS[device.type]


@contextmanager
def running_on(device_type: str, kernels: HostKernels | CudaKernels) -> Iterator[None]:
    """Within this block, tensors on `device_type` go through `kernels` (another device's kernels, emulated)."""
    _EMULATED[device_type] = kernels
    try:
        yield
    finally:
        del _EMULATED[device_type]


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q (batch, heads, rows, dim) over one block of keys and values: the output in q's dtype
    and the log-sum-exp (batch, heads, rows), fp32. `causal`: q and the block are the same positions, in order;
    `mask` (batch, 1, rows, keys), bool: which keys each query sees (instead of `causal`)."""
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    bias = None if mask is None else _bias(mask, q)
    out, lse = kernels_for(q.device).forward(q, k, v, causal, bias)
    if mask is not None:
        blind = ~mask.any(-1)  # (batch, 1, rows): queries that see no key here
        out = out.masked_fill(blind[..., None], 0.0)
        lse = lse.masked_fill(blind, float("-inf"))
    return out, lse.contiguous()


def block_attention_backward(
    queries: AttendedQueries, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the queries, k and v through one block, given the whole row's output and log-sum-exp (what the
    block's probabilities are normalised by once every block is merged); `causal` and `mask` as block_attention's."""
    q, kv_heads = queries.q, k.shape[1]
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    bias = None if mask is None else _bias(mask, q)
    queries = dataclasses.replace(queries, lse=queries.lse.contiguous())
    dq, dk, dv = kernels_for(q.device).backward(queries, k, v, causal, bias)
    return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)
