"""Run by tests/parallel/test_context_parallel.py under torchrun on 4 ranks: ring attention against one process's fused
causal attention, for cp 4 (all ranks) and cp 2 ({0, 1} and {2, 3}), multi-head and grouped-query, in fp64 and in
bf16 (fused bf16 blocks, fp32 merge), over whole windows and over packed documents (short random documents, each
query attending within its own: model/documents.py), and within them over sliding windows of 7 keys; and packed
documents in bf16 on CUDA's kernels, emulated (llmtrain/parallel/kernel_emulation.py). Each rank writes
OUT_DIR/rank<r>.json: per case, the largest difference of the output and of the q, k and v gradients on its zigzag shard
from the fp64 reference's.

    torchrun --nproc_per_node=4 tests/workers/ring_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmtrain.differences import largest
from llmtrain.model.documents import document_starts, visible
from llmtrain.parallel import ring_attention as ring
from llmtrain.parallel.kernel_emulation import emulating_cuda_kernels
from llmtrain.parallel.ring_attention import zigzag_positions
from llmtrain.process.runtime import init_runtime


def largest_error(
    cp: int, group: dist.ProcessGroup, heads: int, kv_heads: int, dtype: torch.dtype, documents: bool, window: int
) -> float:
    generator = torch.Generator().manual_seed(cp * 10 + kv_heads)
    b, t, d = 2, 64, 8
    q = torch.randn(b, heads, t, d, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(b, kv_heads, t, d, generator=generator, dtype=torch.float64) for _ in range(2))
    out_grad = torch.randn(b, heads, t, d, generator=generator, dtype=torch.float64)
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    # documents of 1 to ~20 tokens: token 0 ends one, about one position in six
    starts = document_starts(torch.randint(6, (b, t), generator=generator), separator=0) if documents else None
    index = torch.arange(t)
    mask = None if starts is None else visible(starts, index, index, window or None)
    expected = F.scaled_dot_product_attention(
        *whole, attn_mask=mask, is_causal=mask is None, enable_gqa=heads != kv_heads
    )
    expected.backward(out_grad)
    mine = zigzag_positions(t, cp, dist.get_rank(group))
    local = [x[:, :, mine].to(dtype).requires_grad_() for x in (q, k, v)]
    out = ring.ring_attention(*local, group, None if starts is None else starts[:, mine], window or None)
    out.backward(out_grad[:, :, mine].to(dtype))
    errors = [(out.double() - expected[:, :, mine]).abs().max()]
    errors += [(mine_part.grad.double() - part.grad[:, :, mine]).abs().max() for mine_part, part in zip(local, whole)]
    return largest(error.item() for error in errors)


def main(out_dir: str) -> None:
    runtime = init_runtime("cpu")
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    world = dist.group.WORLD
    assert world is not None
    groups = ((4, world), (2, pairs[runtime.rank // 2]))
    found = {
        f"cp{cp} {heads}/{kv_heads}{' documents' * documents}{f' window {window}' * bool(window)} "
        f"{str(dtype)[6:]}": largest_error(cp, group, heads, kv_heads, dtype, documents, window)
        for cp, group in groups
        for heads, kv_heads in ((4, 4), (4, 2))
        for documents, window in ((False, 0), (True, 0), (True, 7))
        for dtype in (torch.float64, torch.bfloat16)
    }
    # The masked ring on the kernels a GPU runs (the memory-efficient kernel's bf16 backward once read the merged
    # output at the wrong rows: NaN in dq and dk), emulated on this CPU.
    with emulating_cuda_kernels():
        for cp, group in groups:
            for heads, kv_heads in ((4, 4), (4, 2)):
                found[f"cp{cp} {heads}/{kv_heads} documents emulated cuda bfloat16"] = largest_error(
                    cp, group, heads, kv_heads, torch.bfloat16, True, 0
                )
    with open(os.path.join(out_dir, f"rank{runtime.rank}.json"), "w") as f:
        json.dump(found, f)
    runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    main(sys.argv[1])
