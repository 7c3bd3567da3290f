"""Ring attention's kernels on this device, without a ring: a causal sequence cut into two blocks of keys, each
block through the fused kernel ring attention calls (attention_blocks.py: flash for bf16, memory-efficient for
fp32 on CUDA; the CPU flash kernel), the partial outputs merged by their log-sum-exps (ring_attention.merge_block),
and each block's backward from the merged output; against SDPA over the whole sequence and its autograd.

    python -m llmtrain.tools.ring_kernel_check [--device cuda]

One of llmtrain.tools.gpu_check's rows: the multi-GPU ring needs two GPUs, its kernels and merge only one."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from llmtrain.parallel.attention_blocks import block_attention, block_attention_backward
from llmtrain.parallel.ring_attention import merge_block

# Max difference relative to the largest reference value: the kernels' own rounding (bf16: 8 bits of mantissa,
# fp32 accumulations in both; fp32: the efficient kernel's and SDPA's orders of summation).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())


def blocks_against_sdpa(device: torch.device, dtype: torch.dtype, seq: int = 256) -> dict[str, float]:
    """Max relative differences of the blocked output and of the q, k, v gradients to SDPA's."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, out_grad = (torch.randn(2, 4, seq, 64, device=device, dtype=dtype, generator=generator) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    attended = F.scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], is_causal=True)
    attended.backward(out_grad)
    reference = attended.detach()

    early, late = slice(0, seq // 2), slice(seq // 2, seq)
    merged = torch.promote_types(dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=merged, device=device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=merged, device=device)
    # (query rows, key block, causal): the early queries see their own block; the late ones all of the early block
    # and their own causally
    blocks = [(early, early, True), (late, early, False), (late, late, True)]
    for rows, keys, causal in blocks:
        merge_block(
            out[..., rows, :],
            lse[..., rows],
            *block_attention(q[..., rows, :], k[..., keys, :], v[..., keys, :], causal),
        )
    out_in_dtype = out.to(dtype)
    grads = [torch.zeros(x.shape, dtype=merged, device=device) for x in (q, k, v)]
    for rows, keys, causal in blocks:
        dq, dk, dv = block_attention_backward(
            out_grad[..., rows, :].contiguous(),
            q[..., rows, :].contiguous(),
            k[..., keys, :].contiguous(),
            v[..., keys, :].contiguous(),
            out_in_dtype[..., rows, :].contiguous(),
            lse[..., rows].contiguous(),
            causal,
        )
        grads[0][..., rows, :] += dq
        grads[1][..., keys, :] += dk
        grads[2][..., keys, :] += dv
    differences = {"output": _relative(out, reference)}
    for name, ours, leaf in zip(("dq", "dk", "dv"), grads, leaves):
        assert leaf.grad is not None
        differences[name] = _relative(ours, leaf.grad)
    return differences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(parser.parse_args().device)
    failed = False
    for dtype, tolerance in TOLERANCE.items():
        differences = blocks_against_sdpa(device, dtype)
        worst = max(differences.values())
        failed |= worst > tolerance
        shown = ", ".join(f"{name} {value:.1e}" for name, value in differences.items())
        print(f"{str(dtype).removeprefix('torch.')}: {shown} (tolerance {tolerance:.0e})")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
