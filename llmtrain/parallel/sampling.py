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

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from llmtrain.model.base import LayeredModel
from llmtrain.model.kv_cache import KVCache
from llmtrain.model.sampling import Completions, DecodeStep, SamplingSettings, sample
from llmtrain.parallel.fsdp import gathered_whole
from llmtrain.parallel.parallel_model import ParallelModel, unwrap
from llmtrain.parallel.tensors import full_tensor
from llmtrain.parallel_plan import check_samples


def laid_out_decode(model: LayeredModel, context: Callable[[], AbstractContextManager] = nullcontext) -> DecodeStep:
    """The decode step of `model`, whole or this rank's part of it laid out (collective then: FSDP gathers, tensor
    parallelism reduces), within `context` (autocast, adapters switched off): the whole vocabulary's logits on every
    rank, whatever shards them. Eager where train.compile compiled the model: its graphs are traced for a training
    step's shapes, and each decoded position (a longer cache) would trace another, until dynamo's recompile limit
    ends the run."""

    def decode(tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        with context(), torch.compiler.set_stance("force_eager"):
            return full_tensor(model.decode(tokens, cache))

    return decode


def still_decoding(unfinished: bool, device: torch.device, stop: bool = False) -> bool:
    """Whether every rank decodes another position: some rank has a row still to draw (`unfinished`: this rank's)
    and none was told to stop (`stop`: a chat whose reader has what it wanted). Collective where the process group
    spans several ranks, which all run as many forward passes: one all-reduce of two flags."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return unfinished and not stop
    flags = torch.tensor([float(unfinished), float(stop)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    go_on, stopped = flags.tolist()
    return bool(go_on) and not bool(stopped)


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
    device = model.runtime.device

    def any_unfinished(unfinished: bool) -> bool:
        return still_decoding(unfinished, device)

    training = module.training
    module.eval()
    gathered = gathered_whole(module, model.plan.parallel.reshard_after_forward) if gather_once else nullcontext()
    try:
        with gathered:
            decode = laid_out_decode(module)
            return sample(decode, prompts, prompt_ids, group, settings, seed, device, any_unfinished)
    finally:
        module.train(training)
