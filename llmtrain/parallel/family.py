"""What the layouts need of a model family (a FamilyLayout, named by the family's row in
llmtrain/catalog/models.py): its tensor-parallel plan (module name -> DTensor style, tp.py), how a pipeline cuts it
(a rank's part, a stage's view of that part) and how context parallelism hands it a shard of every sequence. The
model modules import nothing of parallelism: the layout steps ask `family_layout(model)` and apply what it says, as
torchtitan binds a model to its parallelization through its ModelSpec. Recomputation belongs to the model itself
(its blocks are built with their mode, model/recompute.py says what they keep), as do its Hugging Face formats
(model/hf.py).

GPT_LAYOUT lays out the GPT and any family that keeps its module names; its parts and views are built as the
model's own class. A family whose modules GPT's plan does not name gives its own FamilyLayout (its plan beside the
GPT's in tp.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from llmtrain.catalog import imported, model_family
from llmtrain.model import GPT
from llmtrain.model.base import LayeredModel
from llmtrain.model.gpt import Block
from llmtrain.model.moe import MoE, SequenceShare
from llmtrain.parallel.tp import gpt_tensor_parallel_plan


@dataclass(frozen=True)
class FamilyLayout:
    # (model or pipeline part, sequence_parallel, loss_parallel) -> the styles of the modules it holds
    tensor_parallel_plan: Callable[[Any, bool, bool], dict[str, ParallelStyle]]
    # (whole model on the meta device, blocks, runs the first stage, runs the last) -> a rank's part, on meta
    pipeline_part: Callable[[Any, Sequence[int], bool, bool], LayeredModel]
    # (a rank's part, a stage's blocks, first stage, last stage) -> the module that runs it, of the part's modules
    stage_view: Callable[[Any, Sequence[int], bool, bool], LayeredModel]
    # (model or stage, the sequence layout: positions held, attention over the others) -> None
    shard_sequence: Callable[[Any, Any], None]


def gpt_pipeline_part(model: GPT, layers: Sequence[int], first: bool, last: bool) -> GPT:
    """The blocks `layers`, the embeddings when the part runs the first stage, the final norm and head when it
    runs the last, built as the model's own class. The head is its own parameter even when the part holds the
    embedding too: the two belong to different stages, whose gradients the pipeline sums."""
    with torch.device("meta"):
        return type(model)(
            model.cfg, layers=layers, embedding=first, head=last, tie_head=False, recompute=model.recompute
        )


def gpt_stage_view(part: GPT, layers: Sequence[int], first: bool, last: bool) -> GPT:
    """A model of `part`'s class made of `part`'s own modules (shared, not copied): the blocks `layers`, the
    embeddings of the first stage, the final norm and head of the last."""
    with torch.device("meta"):
        view = type(part)(part.cfg, layers=[], embedding=False, head=False)
    view.blocks = nn.ModuleDict({str(i): part.blocks[str(i)] for i in layers})
    if first:
        view.tok_emb, view.pos_emb, view.emb_dropout = part.tok_emb, part.pos_emb, part.emb_dropout
    if last:
        view.norm, view.lm_head = part.norm, part.lm_head
    return view


def shard_gpt_sequence(model: GPT, sequence: Any) -> None:
    """Positions (the learned embedding's and each block's rotary ones), attention and the mixtures' balance
    statistics from `sequence` (gpt.WholeSequence's interface) instead of the whole sequence."""
    model.sequence = sequence
    for block in model.blocks.values():
        cast(Block, block).attn.sequence = sequence
        if isinstance(block.mlp, MoE):
            block.mlp.sequence = cast(SequenceShare, sequence)


GPT_LAYOUT = FamilyLayout(gpt_tensor_parallel_plan, gpt_pipeline_part, gpt_stage_view, shard_gpt_sequence)


def family_layout(model: nn.Module) -> FamilyLayout:
    """What the layouts need of `model`'s family (model.family, recorded in its config)."""
    family = cast(GPT, model).cfg.family
    return cast(FamilyLayout, imported(model_family(family).layout))
