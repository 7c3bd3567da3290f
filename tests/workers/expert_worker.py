"""Run by tests/parallel/test_expert_parallel.py under torchrun on 4 ranks: one mixture block with its experts split
over
ep ranks (ep 4: all ranks; ep 2: {0, 1} and {2, 3}) against the same block holding every expert, on each rank's
own tokens. Routing is either spread over the experts, or skewed so that every token picks experts 0 and 1 (the
other ranks' experts receive nothing). Each rank writes OUT_DIR/rank<r>.json: per case, the largest difference
of the output, of the input gradient, and of its experts' weight gradients (the whole block's, summed over the
ep group, sliced to this rank's experts).

    torchrun --nproc_per_node=4 tests/workers/expert_worker.py OUT_DIR
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

from llmtrain.catalog import MLP_KINDS
from llmtrain.differences import largest
from llmtrain.model.lora import LoRAConfig
from llmtrain.model.moe import Experts, MoE, MoEConfig
from llmtrain.parallel.expert import AllToAllDispatch
from llmtrain.process.runtime import init_runtime

EXPERTS, D_MODEL, HIDDEN = 8, 8, 16


def mixture(skewed: bool) -> MoE:
    torch.manual_seed(0)
    block = MoE(
        D_MODEL,
        HIDDEN,
        kind=MLP_KINDS["swiglu"],
        moe=MoEConfig(num_experts=EXPERTS, top_k=2),
        make_shared=None,
        lora=LoRAConfig(),
    )
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.5)
    if skewed:  # a router whose logits favour experts 0 and 1 for every token
        block.router = torch.nn.Linear(D_MODEL, EXPERTS)
        with torch.no_grad():
            block.router.weight.zero_()
            block.router.bias.copy_(torch.tensor([9.0, 8.0] + [0.0] * (EXPERTS - 2)))
    return block


def largest_error(ep: int, group: dist.ProcessGroup, skewed: bool) -> float:
    rank, ep_rank = dist.get_rank(), dist.get_rank(group)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens, a different number of them
    x = torch.randn(2, 5 + 3 * rank, D_MODEL, generator=generator)
    out_grad = torch.randn(x.shape, generator=generator)

    whole = mixture(skewed)
    x_whole = x.clone().requires_grad_()
    whole(x_whole).backward(out_grad)

    split = copy.deepcopy(whole)
    local = EXPERTS // ep
    mine = slice(ep_rank * local, (ep_rank + 1) * local)
    split.experts = Experts(local, D_MODEL, HIDDEN, MLP_KINDS["swiglu"], LoRAConfig())
    with torch.no_grad():
        for name, param in split.experts.named_parameters():
            param.copy_(getattr(whole.experts, name)[mine])
    split.dispatch = AllToAllDispatch(group)
    split.zero_grad(set_to_none=True)
    x_split = x.clone().requires_grad_()
    out = split(x_split)
    out.backward(out_grad)

    with torch.no_grad():
        errors = [(out - whole(x)).abs().max(), (x_split.grad - x_whole.grad).abs().max()]
    for name, param in whole.experts.named_parameters():
        summed = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(summed, group=group)
        got = getattr(split.experts, name).grad
        got = got if got is not None else torch.zeros_like(summed[mine])
        errors.append((got - summed[mine]).abs().max())
    return largest(error.item() for error in errors)


def main(out_dir: str) -> None:
    torch.set_default_dtype(torch.float64)  # differences then show the exchange's errors, not float rounding
    runtime = init_runtime("cpu")
    rank = runtime.rank
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cases = {}
    for skewed in (False, True):
        routing = "skewed" if skewed else "spread"
        cases[f"ep4 {routing}"] = largest_error(4, dist.group.WORLD, skewed)
        cases[f"ep2 {routing}"] = largest_error(2, pairs[rank // 2], skewed)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(cases, f)
    runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    main(sys.argv[1])
