"""The stage split: which blocks each pipeline stage runs and which stages each pipeline rank holds, without tracing.

The model cuts itself (`pipeline_part`, `stage_view`): a rank's part holds the blocks of all its stages under
their whole-model names ("blocks.5.attn.q_proj.weight"), plus the embeddings if it runs the first stage and the
final norm and head if it runs the last, so its state dict and its optimizer's are keyed like the unsplit model's
and checkpoints do not care how the model was cut. The part is built on the meta device and each rank allocates
only its own stages' weights, initialised as the unsplit model's (llmtrain/model/materialize.py). Each stage the
schedule runs is a view made of the part's own modules, holding just that stage's slice.
"""

from __future__ import annotations

from llmtrain.errors import ConfigError


def stage_layers(n_layer: int, n_stages: int, edge_blocks: int) -> list[range]:
    """The blocks of each stage: equal shares of the work, counting the embedding and the head as `edge_blocks`
    blocks each (so the first and last stage get that many fewer)."""
    units = n_layer + 2 * edge_blocks
    per_stage = units // n_stages
    if units % n_stages:
        raise ConfigError(
            f"model.n_layer={n_layer} (+ 2 x parallel.pp_edge_blocks={edge_blocks}) does not split evenly into "
            f"{n_stages} pipeline stages (parallel.pp x parallel.pp_stages_per_rank): choose model.n_layer + "
            f"2 x pp_edge_blocks divisible by {n_stages}"
        )
    sizes = [per_stage] * n_stages
    sizes[0] -= edge_blocks
    sizes[-1] -= edge_blocks
    if min(sizes) < 1:
        raise ConfigError(
            f"parallel.pp_edge_blocks={edge_blocks} leaves the first or last of {n_stages} stages "
            f"without a block (model.n_layer={n_layer}): lower parallel.pp_edge_blocks"
        )
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
