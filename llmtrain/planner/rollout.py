"""What sampling a step's completions costs (train.objective=grpo: train/grpo_objective.py), per rank: the KV cache's
memory, and the rollout's time beside training's.

A rank samples its own prompts' completions (batch_size / dp of them) on its tensor-parallel share of the model. The
rollout is one prefill per prompt (a forward pass over its tokens, compute-bound: a third of training's FLOPs per
token) and one decoding step per new token over every row at once. A decoding step reads every weight the rank
computes with and the cache filled so far, for a handful of FLOPs per byte: it runs at the slower of the memory's
bandwidth and the compute's rate, which for a rollout's rows is the bandwidth (the "memory wall" of decoding). Under
FSDP each decoding step also gathers every block's weights (model/sampling.py decodes block by block), over the
data-parallel links, nothing overlapping it, unless the rollout gathers the whole model once (rl.gather_weights:
where it fits beside the cache, under `auto`), which then takes the rank's memory for the rollout. Under tensor
parallelism each decoded token's activations are summed over the ranks after every attention and MLP. The cache holds
keys and values of every row's prompt and completion (train.seq_len at most), in the compute dtype, its heads split
over the tensor-parallel ranks; it is freed before training's forward passes, so a rank's peak holds the larger of
the two."""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.model.gpt_config import GPTConfig
from llmtrain.parallel_plan import Degrees


@dataclass(frozen=True)
class Sampling:
    """A step's rollout: `group` completions of each prompt, up to `new_tokens` tokens after a prompt of up to
    train.seq_len - new_tokens; under FSDP, the weights gathered as rl.gather_weights says."""

    group: int
    new_tokens: int
    gather: str = "auto"


@dataclass(frozen=True)
class RolloutRank:
    """One rank's share of a rollout."""

    rows: int  # completions it samples
    prompts: int  # prompts it prefills (rows / group)
    prompt_tokens: int  # a prompt's length at most
    new_tokens: int


def rollout_rank(sampling: Sampling, degrees: Degrees, batch_size: int, seq_len: int) -> RolloutRank:
    rows = batch_size // degrees.dp
    return RolloutRank(rows, max(1, rows // sampling.group), seq_len - sampling.new_tokens, sampling.new_tokens)


def kv_cache_bytes(gpt: GPTConfig, degrees: Degrees, rank: RolloutRank, compute_bytes: float) -> float:
    """The rank's KV cache: keys and values of every block, its share of the key/value heads, for each row's prompt
    and completion."""
    heads = max(1, gpt.kv_heads // degrees.tp)
    return 2 * gpt.n_layer * heads * gpt.head_size * rank.rows * (rank.prompt_tokens + rank.new_tokens) * compute_bytes


def unsampled(degrees: Degrees, sequence_parallel: bool) -> str | None:
    """Why a layout cannot sample (parallel/sampling.py refuses it), or None."""
    if degrees.pp > 1:
        return "a pipeline cannot sample (each new token would pass through every stage in turn)"
    if degrees.cp > 1:
        return "context parallelism cannot sample (a decoded position leaves no sequence to split)"
    if degrees.tp > 1 and sequence_parallel:
        return "sequence parallelism cannot sample (one new position cannot be split over the ranks)"
    return None


@dataclass(frozen=True)
class RolloutSpeed:
    """What a rank's rollout time is made of: the FLOP/s a row's forward pass is computed at (peak x MFU, times the
    tensor-parallel ranks computing it together), the memory's bandwidth (bytes/s), the seconds FSDP's gathering of
    every block takes (0 without FSDP) and those tensor parallelism's reductions of one decoded token take (0
    without)."""

    flops: float
    bandwidth: float
    gather_s: float
    reduce_s: float = 0.0


def rollout_seconds(
    rank: RolloutRank,
    forward_flops_per_token: float,
    weight_bytes: float,
    cache_bytes: float,
    speed: RolloutSpeed,
    gathers_once: bool,
) -> float:
    """The rank's rollout: the prefills (compute-bound), then each decoding step at the slower of reading its weights
    (`weight_bytes`, its tensor-parallel share) and the cache filled so far (half of `cache_bytes` on average), and
    computing its rows' next tokens, plus FSDP's gathers: once, or for the prefill and every decoding step."""
    prefill = forward_flops_per_token * rank.prompts * rank.prompt_tokens / speed.flops
    read = (weight_bytes + cache_bytes / 2) / speed.bandwidth
    computed = forward_flops_per_token * rank.rows / speed.flops
    gathers = 1 if gathers_once else 1 + rank.new_tokens
    return prefill + rank.new_tokens * (max(read, computed) + speed.reduce_s) + gathers * speed.gather_s
