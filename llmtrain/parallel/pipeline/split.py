"""The stage split: which blocks each pipeline stage runs, which stages each pipeline rank holds, and the stage
modules themselves, cut from the whole model without tracing.

A stage is a `GPT` holding a slice of the blocks under their whole-model names ("blocks.5.attn.q_proj.weight"), the
first one also the embeddings and the last one the final norm and LM head; so a checkpoint does not care how the
model was cut. Stages copy their weights from the whole model initialised from the seed, so a pipelined run starts
from exactly the weights of the unsplit one.
"""

from __future__ import annotations

import torch

from llmtrain.config import ConfigError
from llmtrain.model import GPT

# How stages are dealt to ranks: "loop" gives rank r stages r, r + pp, r + 2pp, ... (GPipe, 1F1B, interleaved);
# "v" gives rank r stages r and 2pp - 1 - r, so the first and last stage share rank 0 (ZBV, DualPipeV).
STAGE_STYLES = ("loop", "v")


def stage_layers(n_layer: int, n_stages: int, edge_blocks: int) -> list[range]:
    """The blocks of each stage: equal shares of the work, counting the embedding and the head as `edge_blocks`
    blocks each (so the first and last stage get that many fewer)."""
    units = n_layer + 2 * edge_blocks
    per_stage = units // n_stages
    if units % n_stages:
        raise ConfigError(
            f"model.n_layer={n_layer} (+ 2 x parallel.pp_edge_blocks={edge_blocks}) does not split evenly into "
            f"{n_stages} pipeline stages (parallel.pp x parallel.pp_stages_per_rank): choose model.n_layer + "
            f"2 x pp_edge_blocks divisible by {n_stages}")
    sizes = [per_stage] * n_stages
    sizes[0] -= edge_blocks
    sizes[-1] -= edge_blocks
    if min(sizes) < 1:
        raise ConfigError(f"parallel.pp_edge_blocks={edge_blocks} leaves the first or last of {n_stages} stages "
                          f"without a block (model.n_layer={n_layer}): lower parallel.pp_edge_blocks")
    starts = [sum(sizes[:i]) for i in range(n_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def rank_stages(pp_rank: int, pp: int, stages_per_rank: int, style: str) -> list[int]:
    """The stage indices pipeline rank `pp_rank` holds, in execution order of a micro-batch's forward."""
    if style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def stage_rank(stage: int, pp: int, style: str) -> int:
    """The pipeline rank holding `stage` (the inverse of rank_stages)."""
    if style == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def build_stage(model: GPT, stage: int, n_stages: int, layers: range) -> GPT:
    """Stage `stage` of `model`: its blocks, plus the embeddings (first stage) or the final norm and LM head (last),
    with `model`'s weights. The last stage's head is its own copy of the (tied) embedding matrix."""
    with torch.device("meta"):
        part = GPT(model.cfg, layers=layers, embedding=stage == 0, head=stage == n_stages - 1)
    part.to_empty(device=next(model.parameters()).device)
    whole = model.state_dict()
    part.load_state_dict({name: whole[name] for name in part.state_dict()}, strict=True)
    part.activation_checkpointing = model.activation_checkpointing
    return part
