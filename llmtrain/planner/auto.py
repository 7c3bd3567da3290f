"""`parallel=auto`: the planner picks the layout and degrees for this world, model and batch at start-up.

It weighs every layout (data-parallel, tensor, pipeline, 3-D) with llmtrain's own state sizes (fp32 weights,
gradients and AdamW moments; activations in the run's precision), the hardware config's memory and links or the
links measured in plan.measured, each also with smaller micro-batches and more activation recomputation, and
returns the parallel config of the fastest that fits and the train.* knobs it turned (llmtrain/planner/cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmtrain.config import ParallelConfig
from llmtrain.errors import ConfigError
from llmtrain.planner.candidates import describe_layout, enumerate_candidates, runnable, with_knobs
from llmtrain.planner.cost import GIB, Decision, LayoutCost, Machine, choose, layout_cost
from llmtrain.planner.inputs import llmtrain_state_bytes, machine_for, workload_for


@dataclass(frozen=True)
class AutoLayout:
    parallel: ParallelConfig  # what the run uses in place of parallel=auto
    train: dict  # the train.* knobs it turned to fit (micro_batch_size, activation_checkpointing); {}: none
    summary: str  # the decision, its reason and the runner-up, for the start summary


def auto_decision(cfg, world_size: int, ranks_per_node: int, vocab_size: int, bf16: bool, pp_schedule: str) -> Decision:
    """The planner's choice among every layout for this world, with the sizes llmtrain holds."""
    plans, machine = auto_plans(cfg, world_size, ranks_per_node, vocab_size, bf16, pp_schedule)
    return choose(plans, machine)


def auto_plans(
    cfg, world_size: int, ranks_per_node: int, vocab_size: int, bf16: bool, pp_schedule: str
) -> tuple[list[LayoutCost], Machine]:
    """Every layout parallel=auto weighs for this world (each also with smaller micro-batches and more
    recomputation), planned with the sizes llmtrain holds, and the machine they are planned for."""
    work = workload_for(cfg, vocab_size, llmtrain_state_bytes(cfg, bf16))
    machine = machine_for(cfg, world_size, ranks_per_node, bf16)
    candidates = enumerate_candidates(world_size, ranks_per_node, cfg.model, cfg.train, "all", pp_schedule)
    candidates = runnable(candidates, cfg, work.sampling is not None)
    if not candidates:
        raise ConfigError(
            f"parallel=auto found no layout for {world_size} ranks with train.batch_size={cfg.train.batch_size} and "
            f"train.micro_batch_size={cfg.train.micro_batch_size}: make batch_size a multiple of micro_batch_size x "
            f"{world_size}"
        )
    t = cfg.train
    variants = with_knobs(candidates, t.micro_batch_size, t.activation_checkpointing)
    return [layout_cost(c, work, machine) for c in variants], machine


def auto_layout(cfg, parallel: ParallelConfig, world_size: int, ranks_per_node: int, vocab_size: int,
                bf16: bool) -> AutoLayout:  # fmt: skip
    """The layout to train with; a one-line ConfigError when none fits."""
    decision = auto_decision(cfg, world_size, ranks_per_node, vocab_size, bf16, parallel.pp_schedule)
    if decision.chosen is None:
        raise ConfigError(
            f"parallel=auto: {decision.reason}: lower train.micro_batch_size, set "
            f"train.activation_checkpointing=full or add ranks (python -m llmtrain.tools.plan "
            f"model={cfg.model.name} hardware={cfg.hardware.name} plan.world_size={world_size} plan.layouts=all "
            f"shows every layout)"
        )
    chosen = decision.chosen.candidate
    values = chosen.parallel_values()
    # keep the user's pipeline schedule knobs and nproc; the layout and its degrees come from the plan
    resolved = replace(parallel, **{k: v for k, v in values.items() if k not in ("microbatches", "pp_edge_blocks")})
    summary = f"parallel=auto chose {chosen.name} ({chosen.command_line()}): {decision.reason}"
    return AutoLayout(resolved, chosen.train_values(), summary)


def configured_cost(
    cfg, world_size: int, ranks_per_node: int, vocab_size: int, bf16: bool, loss: str | None = None
) -> LayoutCost:
    """The planner's memory, traffic and step time for the layout `cfg` configures, with the sizes llmtrain holds
    (`loss`: another loss form than llmtrain's for this config, planner/memory.py's LOSS_FORMS)."""
    work = workload_for(cfg, vocab_size, llmtrain_state_bytes(cfg, bf16))
    if loss is not None:
        work = replace(work, loss=loss)
    machine = machine_for(cfg, world_size, ranks_per_node, bf16)
    return layout_cost(describe_layout(cfg.parallel, world_size), work, machine)


def prediction(cfg, world_size: int, ranks_per_node: int, vocab_size: int, bf16: bool) -> dict:
    """What the planner predicts for the run's own layout, for the end summary to set beside what happened: a
    machine that is not what its hardware config says (a PCIe card without peer-to-peer, a slow link) shows as a
    step much slower than predicted."""
    plan = configured_cost(cfg, world_size, ranks_per_node, vocab_size, bf16)
    return {
        "step_s": plan.step_time_s,
        "sampling_s": plan.sampling_s,
        "gathers_once": plan.gathers_once,
        "peak_gib_per_rank": plan.heaviest.total / GIB,
        "comm_gib_per_step": plan.comm_bytes_per_step / GIB,
        "hardware": cfg.hardware.name,
    }
