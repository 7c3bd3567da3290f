"""The stage split: which stages each pipeline rank holds (which blocks each stage runs is the plan's
`stage_layers`, llmtrain/parallel_plan.py, checked before anything is built), without tracing.

The model family's spec cuts the model (llmtrain/parallel/family.py: `pipeline_part`, `stage_view`): a rank's part
holds the blocks of all its stages under their whole-model names ("blocks.5.attn.q_proj.weight"), plus the
embeddings if it runs the first stage and the final norm and head if it runs the last, so its state dict and its
optimizer's are keyed like the unsplit model's and checkpoints do not care how the model was cut. The part is built
on the meta device and each rank allocates only its own stages' weights, initialised as the unsplit model's
(llmtrain/model/materialize.py). Each stage the schedule runs is a view made of the part's own modules, holding just
that stage's slice.
"""

from __future__ import annotations


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
