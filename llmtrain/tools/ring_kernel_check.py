"""Ring attention's kernels on this device, without a ring: a causal sequence cut into two blocks of keys, each
block through the fused kernel ring attention calls (attention_blocks.py: flash for bf16, memory-efficient for
fp32 on CUDA; the CPU flash kernel), the partial outputs merged by their log-sum-exps (ring_attention.merge_block),
and each block's backward from the merged output; against SDPA over the whole sequence and its autograd. Then the
same within packed documents (train.attention=document): the blocks under their document masks (on CUDA the
memory-efficient kernel with an additive bias, in both dtypes), and the whole-window kernel one process runs
(FlexAttention, compiled, on CUDA; SDPA with a mask elsewhere), each against SDPA under the same mask; and two
documents meeting at the blocks' boundary, so that the late queries see no early key: a block no query sees.

    python -m llmtrain.tools.ring_kernel_check [--device cuda] [--emulate-cuda]

`--emulate-cuda` runs CUDA's kernel choice on this device over the kernels' arithmetic in plain torch
(parallel/kernel_emulation.py): on a CPU, what a GPU would meet. A difference that is not finite fails.

One of llmtrain.tools.gpu_check's rows: the multi-GPU ring needs two GPUs, its kernels and merge only one."""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from llmtrain.differences import largest, tensor_difference, within
from llmtrain.model.documents import document_attention, document_starts, visible, whole_window_documents
from llmtrain.parallel.attention_blocks import AttendedQueries, block_attention, block_attention_backward
from llmtrain.parallel.kernel_emulation import emulating_cuda_kernels
from llmtrain.parallel.ring_attention import merge_block

# Max difference relative to the largest reference value: the kernels' own rounding (bf16: 8 bits of mantissa,
# fp32 accumulations in both; fp32: the efficient kernel's and SDPA's orders of summation).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _documents(device: torch.device, seq: int, halves: bool = False) -> torch.Tensor:
    """Where each position's document starts, for two windows of documents 1 to ~40 tokens long; or (`halves`)
    of two documents each, the second starting at the middle, where the blocks meet."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(int(halves), 12, (2, seq), generator=generator)  # halves: no end-of-text (0) but one
    if halves:
        tokens[:, seq // 2 - 1] = 0
    return document_starts(tokens, separator=0).to(device)


def _inputs(device: torch.device, dtype: torch.dtype, seq: int) -> list[torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(2, 4, seq, 64, device=device, dtype=dtype, generator=generator) for _ in range(4)]


def _sdpa(q, k, v, out_grad, mask: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """SDPA's output and its q, k, v gradients: causal, or under `mask`."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    query, key, value = leaves
    attended = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None)
    attended.backward(out_grad)
    return attended.detach(), [leaf.grad for leaf in leaves if leaf.grad is not None]


MASKS = ("causal", "documents", "halves")  # what blocks_against_sdpa masks by (see _documents)


def blocks_against_sdpa(device: torch.device, dtype: torch.dtype, mask_by: str, seq: int = 256) -> dict[str, float]:
    """Max relative differences of the blocked output and of the q, k, v gradients to SDPA's (`mask_by`: one of
    MASKS)."""
    q, k, v, out_grad = _inputs(device, dtype, seq)
    starts = None if mask_by == "causal" else _documents(device, seq, halves=mask_by == "halves")
    index = torch.arange(seq, device=device)
    reference, expected = _sdpa(q, k, v, out_grad, None if starts is None else visible(starts, index, index))

    early, late = slice(0, seq // 2), slice(seq // 2, seq)
    merged = torch.promote_types(dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=merged, device=device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=merged, device=device)
    # (query rows, key block, causal): the early queries see their own block; the late ones their own causally and
    # all of the early block. Each row's own block first, as the ring merges: under a document mask it is the one
    # block no query is blind to.
    blocks = [(early, early, True), (late, late, True), (late, early, False)]

    def mask(rows: slice, keys: slice) -> torch.Tensor | None:
        return None if starts is None else visible(starts[:, rows], index[rows], index[keys])

    for rows, keys, causal in blocks:
        merge_block(
            out[..., rows, :],
            lse[..., rows],
            *block_attention(
                q[..., rows, :], k[..., keys, :], v[..., keys, :], causal and starts is None, mask(rows, keys)
            ),
        )
    attended = AttendedQueries(q, out.to(dtype), lse, out_grad)
    grads = [torch.zeros(x.shape, dtype=merged, device=device) for x in (q, k, v)]
    for rows, keys, causal in blocks:
        dq, dk, dv = block_attention_backward(
            attended.rows(rows), k[..., keys, :], v[..., keys, :], causal and starts is None, mask(rows, keys)
        )
        grads[0][..., rows, :] += dq
        grads[1][..., keys, :] += dk
        grads[2][..., keys, :] += dv
    differences = {"output": tensor_difference(out, reference, relative=True)}
    for name, ours, grad in zip(("dq", "dk", "dv"), grads, expected):
        differences[name] = tensor_difference(ours, grad, relative=True)
    return differences


def document_kernel_against_sdpa(device: torch.device, dtype: torch.dtype, seq: int = 256) -> dict[str, float]:
    """Max relative differences of the whole-window document kernel's output and gradients to SDPA's."""
    q, k, v, out_grad = _inputs(device, dtype, seq)
    starts = _documents(device, seq)
    index = torch.arange(seq, device=device)
    reference, expected = _sdpa(q, k, v, out_grad, visible(starts, index, index))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    attended = document_attention(leaves[0], leaves[1], leaves[2], whole_window_documents(starts).masks[None])
    attended.backward(out_grad)
    differences = {"output": tensor_difference(attended, reference, relative=True)}
    for name, leaf, grad in zip(("dq", "dk", "dv"), leaves, expected):
        assert leaf.grad is not None
        differences[name] = tensor_difference(leaf.grad, grad, relative=True)
    return differences


def check_all(device: torch.device) -> list[tuple[str, dict[str, float], float]]:
    """(case, its differences, its tolerance) for every case: the blocks under each mask, the document kernel."""
    cases = []
    for dtype, tolerance in TOLERANCE.items():
        name = str(dtype).removeprefix("torch.")
        for mask_by in MASKS:
            what = "" if mask_by == "causal" else f" {mask_by}"
            cases.append((f"{name}{what}", blocks_against_sdpa(device, dtype, mask_by), tolerance))
        cases.append((f"{name} document kernel", document_kernel_against_sdpa(device, dtype), tolerance))
    return cases


def passes(differences: dict[str, float], tolerance: float) -> bool:
    return within(largest(differences.values()), tolerance)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--emulate-cuda", action="store_true", help="CUDA's kernels emulated on this device")
    args = parser.parse_args()
    with emulating_cuda_kernels() if args.emulate_cuda else contextlib.nullcontext():
        cases = check_all(torch.device(args.device))
    failed = False
    for case, differences, tolerance in cases:
        failed |= not passes(differences, tolerance)
        shown = ", ".join(f"{name} {value:.1e}" for name, value in differences.items())
        print(f"{case}: {shown} (tolerance {tolerance:.0e})")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
