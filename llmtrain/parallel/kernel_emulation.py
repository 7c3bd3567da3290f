"""CUDA's fused attention kernels, as ring attention calls them (attention_blocks.CudaKernels), emulated in plain
torch so that a CPU test meets what a GPU runs: the same choice of kernel, their arithmetic in fp32 with the
compute dtype where they store it (the probabilities and dS in bf16 before their matrix products), the log-sum-exp
padded as the memory-efficient kernel pads it, and the one liberty that kernel takes with its inputs:

  its bf16/fp16 backward computes Delta = rowsum(dO * O) inside the kernel and reads O at a row stride of
  heads x head_dim (the layout its forward writes: (batch, rows, heads, dim) in memory), ignoring the row stride
  the tensor has; a contiguous (batch, heads, rows, dim) output is read at the wrong rows and, for the later heads,
  past its end (fp32's Delta is computed by the host with the tensor's strides).

What lies past a tensor's end on a GPU is whatever memory follows; here it is NaN, the worst it can be.

    with emulating_cuda_kernels():   # CPU tensors go through CudaKernels over these ops
        ring_attention(...) / block_attention(...)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from llmtrain.parallel.attention_blocks import CudaAttentionOps, CudaKernels, running_on

HALF = (torch.bfloat16, torch.float16)


def _scores(q, k, bias: torch.Tensor | None, causal: bool, scale: float) -> torch.Tensor:
    """q k^T scale (+ bias), fp32, with the causal mask (top-left aligned, as the kernels') as -inf."""
    scores = (q.float() @ k.float().mT) * scale
    if bias is not None:
        scores = scores + bias.float()
    if causal:
        rows, keys = scores.shape[-2:]
        later = torch.ones(rows, keys, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(later, float("-inf"))
    return scores


def _attend(q, k, v, bias, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The output, written as the kernels write it ((batch, rows, heads, dim) in memory), and the log-sum-exp; a
    row that sees no key gets 0 and -inf."""
    scores = _scores(q, k, bias, causal, 1 / math.sqrt(q.shape[-1]))
    lse = torch.logsumexp(scores, dim=-1)
    probabilities = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    out = out.transpose(1, 2)
    out.copy_(probabilities @ v.float())
    return out, lse


def _as_the_kernel_reads(out: torch.Tensor) -> torch.Tensor:
    """`out` as the half-precision backward reads it: its batch and head strides, rows heads x head_dim apart,
    over its storage followed by NaN where the reads go past it."""
    batch, heads, rows, dim = out.shape
    strides = (out.stride(0), out.stride(1), heads * dim, 1)
    storage = torch.empty(0, dtype=out.dtype, device=out.device).set_(out.untyped_storage())
    reach = out.storage_offset() + sum((size - 1) * stride for size, stride in zip(out.shape, strides)) + 1
    beyond = storage.new_full((max(0, reach - storage.numel()),), float("nan"))
    return torch.cat([storage, beyond]).as_strided(out.shape, strides, out.storage_offset())


def _gradients(out_grad, q, k, v, delta, lse, bias, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flash-style backward from the whole row's log-sum-exp and Delta: P = exp(S - lse) recomputed, stored in
    the compute dtype for dV = P^T dO; dS = P (dO V^T - Delta) scale, stored likewise, for dQ = dS K and dK = dS^T Q."""
    scale = 1 / math.sqrt(q.shape[-1])
    rows = q.shape[-2]
    probabilities = torch.exp(_scores(q, k, bias, causal, scale) - lse[..., :rows, None])
    stored = probabilities.to(q.dtype).float()
    dv = stored.mT @ out_grad.float()
    ds = (probabilities * (out_grad.float() @ v.float().mT - delta[..., None]) * scale).to(q.dtype).float()
    return (ds @ k.float()).to(q.dtype), (ds.mT @ q.float()).to(k.dtype), dv.to(v.dtype)


def _flash(q, k, v, dropout_p, causal):
    out, lse = _attend(q, k, v, None, causal)
    return out, lse, None, None, q.shape[-2], k.shape[-2], None, None, None


# aten's signatures, argument for argument
def _flash_backward(out_grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, causal, seed, offset):  # noqa: PLR0913
    delta = (out_grad.float() * out.float()).sum(-1)  # flash reads O with its strides
    return _gradients(out_grad, q, k, v, delta, lse, None, causal)


def _efficient(q, k, v, bias, compute_lse, dropout_p, causal):
    out, lse = _attend(q, k, v, bias, causal)
    padded = lse.new_zeros(*lse.shape[:-1], math.ceil(lse.shape[-1] / 32) * 32)
    padded[..., : lse.shape[-1]] = lse
    return out, padded, None, None


def _efficient_backward(out_grad, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, causal):  # noqa: PLR0913
    read = _as_the_kernel_reads(out) if q.dtype in HALF else out
    delta = (out_grad.float() * read.float()).sum(-1)
    return (*_gradients(out_grad, q, k, v, delta, lse, bias, causal), None)


EMULATED_OPS = CudaAttentionOps(
    flash=_flash, flash_backward=_flash_backward, efficient=_efficient, efficient_backward=_efficient_backward
)


@contextmanager
def emulating_cuda_kernels() -> Iterator[None]:
    """Within this block, attention blocks on CPU tensors run CUDA's kernel choice over the emulated kernels."""
    with running_on("cpu", CudaKernels(EMULATED_OPS)):
        yield
