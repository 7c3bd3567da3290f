"""The stage split: which blocks each pipeline stage runs, which stages each pipeline rank holds, and the modules,
cut from the whole model without tracing.

A rank's part of the model is one `GPT` holding the blocks of all its stages under their whole-model names
("blocks.5.attn.q_proj.weight"), plus the embeddings if it runs the first stage and the final norm and LM head if
it runs the last: its state dict and its optimizer's are keyed like the unsplit model's, so checkpoints do not care
how the model was cut. The part copies its weights from the whole model initialised from the seed, so a pipelined
run starts from exactly the weights of the unsplit one. Each stage the schedule runs is a view: a `GPT` whose
modules are the part's own (shared, not copied), holding just that stage's slice.
"""

from __future__ import annotations

import torch
from torch import nn

from llmtrain.config import ConfigError
from llmtrain.model import GPT

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
    """The stage indices pipeline rank `pp_rank` holds, in execution order of a micro-batch's forward. Style
    "loop" deals rank r stages r, r + pp, r + 2pp, ... (GPipe, 1F1B, interleaved); "v" gives it stages r and
    2pp - 1 - r, so the first and last stage share rank 0 (ZBV, DualPipeV)."""
    if style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def stage_rank(stage: int, pp: int, style: str) -> int:
    """The pipeline rank holding `stage` (the inverse of rank_stages)."""
    if style == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def build_rank_model(model: GPT, stages: list[int], layers: list[range]) -> GPT:
    """This rank's part of `model` (the stages `stages` of the split `layers`), with `model`'s weights. The LM head
    is its own copy of the (tied) embedding matrix, even where the part also holds the embedding: the two belong to
    different stages."""
    with torch.device("meta"):
        part = GPT(model.cfg, layers=[i for stage in stages for i in layers[stage]], embedding=0 in stages,
                   head=len(layers) - 1 in stages, tie_head=False)
    part.to_empty(device=next(model.parameters()).device)
    whole = model.state_dict()
    part.load_state_dict({name: whole[name] for name in part.state_dict()}, strict=True)
    part.activation_checkpointing = model.activation_checkpointing
    return part


def stage_view(part: GPT, stage: int, layers: list[range]) -> GPT:
    """The module that runs stage `stage`: a GPT made of `part`'s own modules for that stage."""
    with torch.device("meta"):
        view = GPT(part.cfg, layers=[], embedding=False, head=False)
    view.blocks = nn.ModuleDict({str(i): part.blocks[str(i)] for i in layers[stage]})
    if stage == 0:
        view.tok_emb, view.pos_emb, view.emb_dropout = part.tok_emb, part.pos_emb, part.emb_dropout
    if stage == len(layers) - 1:
        view.norm, view.lm_head = part.norm, part.lm_head
    view.activation_checkpointing = part.activation_checkpointing
    return view
