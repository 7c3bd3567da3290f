"""Sampling on the laid-out model: the KV-cached sampler (model/sampling.py) run by every rank of a layout on its own
prompts. Data-parallel ranks draw their own prompts' completions, FSDP gathering each block's weights as its forward
pass runs; tensor-parallel ranks run the same rows, each over its own heads (the cache is split with them), the
logits gathered from the vocabulary shards. A completion depends on its prompt, seed and model alone, so every layout
draws what one process draws. A pipeline (the stages would pass each new token through every rank) and context
parallelism (a sequence decoded one position at a time has nothing to split) do not sample, nor does sequence
parallelism (one new position a step cannot be split over the ranks): each is refused in one line. Under FSDP a
rollout may gather the whole model once instead (fsdp.gathered_whole), where it fits beside the cache: the planner
decides (train/grpo_objective.py)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist

from llmtrain.errors import ConfigError
from llmtrain.model.kv_cache import KVCache
from llmtrain.model.sampling import Completions, SamplingSettings, decode_step, sample
from llmtrain.parallel.fsdp import gathered_whole
from llmtrain.parallel.parallel_model import ParallelModel, unwrap
from llmtrain.parallel.tensors import full_tensor
from llmtrain.parallel_plan import ParallelPlan


def check_samples(plan: ParallelPlan) -> None:
    """A ConfigError naming what to change where `plan`'s layout cannot sample."""
    if plan.pipelined:
        raise ConfigError(
            f"parallel={plan.name}: a pipeline cannot sample (each new token would pass through every stage in "
            f"turn); use a layout without pipeline stages (fsdp, tp, fsdp_tp, ddp)"
        )
    if plan.degrees.cp > 1:
        raise ConfigError(
            f"parallel.cp={plan.degrees.cp}: decoding one position at a time leaves no sequence to split over "
            f"context-parallel ranks; set parallel.cp=1"
        )
    if plan.degrees.tp > 1 and plan.parallel.sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel=true: a decoding step's one new position cannot be split over the "
            "tensor-parallel ranks; set parallel.sequence_parallel=false"
        )


def sample_completions(
    model: ParallelModel,
    prompts: Sequence[Sequence[int]],
    prompt_ids: Sequence[int],
    group: int,
    settings: SamplingSettings,
    seed: int,
    gather_once: bool = False,
) -> Completions:
    """Collective: `group` completions of each of this rank's `prompts` (each known by its id in the global batch,
    which seeds its draws), the model in eval mode meanwhile. Every rank runs as many forward passes: decoding goes
    on while any rank's rows do. `gather_once`: FSDP's units are gathered once for the whole rollout (the whole
    model on each rank meanwhile) instead of block by block for every decoded token."""
    check_samples(model.plan)
    module = unwrap(model.module)
    whole = decode_step(module)

    def decode(tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return full_tensor(whole(tokens, cache))

    def any_unfinished(unfinished: bool) -> bool:
        if not model.runtime.distributed:
            return unfinished
        flag = torch.tensor(float(unfinished), device=model.runtime.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    training = module.training
    module.eval()
    gathered = gathered_whole(module, model.plan.parallel.reshard_after_forward) if gather_once else nullcontext()
    try:
        with gathered:
            return sample(decode, prompts, prompt_ids, group, settings, seed, model.runtime.device, any_unfinished)
    finally:
        module.train(training)
