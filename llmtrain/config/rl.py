"""The `rl` group's keys: online reinforcement learning with verifiable rewards (train.objective=grpo, data=rl):
how completions are sampled (llmtrain/model/sampling.py) and how GRPO's loss weighs them (llmtrain/train/grpo.py).
The defaults are TRL's GRPOConfig's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from llmtrain import catalog
from llmtrain.domains import Flag, Number, OneOf, at_least, fraction, key


@dataclass
class RLConfig:
    group_size: int = key(
        8,
        at_least(2),
        "completions sampled per prompt: their rewards' mean (and standard deviation) is the baseline each is "
        "compared with; train.batch_size counts completions, so a step trains batch_size / group_size prompts",
    )
    max_new_tokens: int = key(
        256,
        at_least(1),
        "a completion's length at most; a prompt longer than train.seq_len - max_new_tokens is left out (the start "
        "summary counts them)",
    )
    temperature: float = key(
        1.0,
        Number(low=0, low_open=True),
        "sampling temperature; the log-probabilities of the loss divide the logits by it too",
    )
    top_k: int = key(0, at_least(0), "sample among the k likeliest tokens; 0: all")
    top_p: float = key(
        1.0, Number(low=0, high=1, low_open=True), "sample among the fewest tokens whose probability reaches p"
    )
    loss: str = key(
        "dapo",
        OneOf(tuple(catalog.RL_LOSSES)),
        "how the per-token losses are reduced: " + "; ".join(f"`{k}` {v}" for k, v in catalog.RL_LOSSES.items()),
    )
    beta: float = key(
        0.0,
        Number(low=0),
        "weight of the k3 KL penalty to the reference (the base, adapters off: needs model.lora.rank); 0: none, "
        "and no reference forward pass",
    )
    epsilon: float = key(0.2, fraction(), "the ratio's clip below: 1 - epsilon")
    epsilon_high: Optional[float] = key(
        None, Number(low=0, low_open=True), "the ratio's clip above: 1 + epsilon_high (DAPO's 0.28); null: epsilon"
    )
    iterations: int = key(
        1,
        at_least(1),
        "optimizer steps on each rollout batch (TRL's num_iterations, μ): the first samples it, the others reuse "
        "its completions against the log-probabilities they were sampled with, clipped",
    )
    gather_weights: str = key(
        "auto",
        OneOf(catalog.WEIGHT_GATHERS),
        "under FSDP, how a rollout gathers the sharded weights: `once`, the whole model for the whole rollout (each "
        "rank holds it meanwhile); `per_token`, block by block for every decoded token (FSDP's forward: one or two "
        "blocks held, every block's weights sent again for each token); `auto`, once where the planner finds the "
        "whole model fits beside the KV cache",
    )
    scale_rewards: bool = key(
        True,
        Flag(),
        "divide each advantage by its group's reward standard deviation (GRPO); false: centred only (Dr. GRPO)",
    )
