"""What fits, what it costs, which layout to run: the planner on the command line (llmtrain/planner/).

    python -m llmtrain.tools.plan model=gpt2-xl hardware=rtx4080x4
    python -m llmtrain.tools.plan model=gpt3-2.7b hardware=rtx4080x4 plan.layouts=all train.seq_len=1024
    python -m llmtrain.tools.plan model=gpt2 hardware=cpu plan.world_size=4 plan.measured=comm_bench.csv
    python -m llmtrain.tools.plan model=gpt2-xl hardware=h100x8 parallel=fsdp_tp   # also the configured layout

Composed like training (model=, parallel=, hardware=, train.*) plus the plan.* keys (conf/train.yaml). For each
layout it prints the bytes per rank of parameters, gradients, optimizer state, gathered parameters and
activations (the heaviest pipeline rank), whether that fits hardware.device_memory_gib less plan.reserved_gib,
the bytes the busiest rank communicates per step, the predicted step time and `max_parameters`: the largest
model whose states fit (ZeRO's accounting), and beside it the largest that also fits this batch's activations.
Then one line: the layout it would pick and why. With plan.out=FILE everything goes to that JSON file too (nothing
is written where it is not asked for). Exit 2 with a one-line error for a bad key.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from hydra.errors import HydraException
from omegaconf import OmegaConf

from llmtrain.catalog import AUTO, layout_spec
from llmtrain.config import RootConfig, validate
from llmtrain.config.composition import composition_error_line
from llmtrain.errors import ConfigError, closed_pipe_is_quiet
from llmtrain.model.hf_adopted import chose_preset, with_init_from_model
from llmtrain.planner.auto import auto_decision
from llmtrain.planner.candidates import describe_layout, enumerate_candidates, runnable, with_knobs
from llmtrain.planner.cost import GIB, PEAK_ERROR_BOUND, Decision, LayoutCost, choose, layout_cost
from llmtrain.planner.inputs import configured_state_bytes, machine_for, planned_vocab_size, plans_bf16, workload_for
from llmtrain.tools import compose_config


def splittable_batch(train, world: int) -> int:
    """The configured global batch if every data-parallel degree of `world` ranks splits it into whole
    micro-batches, else the next multiple of micro_batch_size x world, which does: a "what fits" question at a
    world size the default batch does not divide is still answered, for a batch that works."""
    unit = train.micro_batch_size * world
    return train.batch_size if train.batch_size % unit == 0 else unit * -(-train.batch_size // unit)


def plan_config(cfg) -> tuple[list[LayoutCost], Decision, Decision, dict[str, Any]]:
    """Plans for every candidate layout of `cfg` (plus its configured one), the choice with the plan.* sizes,
    parallel=auto's (llmtrain's own sizes, every layout), and the run's facts."""
    hw = cfg.hardware
    world = cfg.plan.world_size or hw.nodes * hw.gpus_per_node
    configured_batch = cfg.train.batch_size
    cfg = OmegaConf.merge(cfg, {"train": {"batch_size": splittable_batch(cfg.train, world)}})
    # a CPU "device" is a share of its host: the ranks planned fill the configured nodes
    ranks_per_node = -(-world // hw.nodes) if hw.device_memory_gib is None else min(hw.gpus_per_node, world)
    bf16 = plans_bf16(cfg)
    sizes = configured_state_bytes(cfg, bf16)
    work = workload_for(cfg, planned_vocab_size(cfg), sizes)
    machine = machine_for(cfg, world, ranks_per_node, bf16)
    candidates = enumerate_candidates(
        world, ranks_per_node, cfg.model, cfg.train, cfg.plan.layouts, cfg.parallel.pp_schedule
    )
    candidates = runnable(candidates, cfg, work.sampling is not None)
    if cfg.parallel.layout != AUTO and (world == 1 or layout_spec(cfg.parallel.layout).dims):
        configured = describe_layout(cfg.parallel, world)
        candidates = [configured, *(c for c in candidates if c != configured)]
    # The pick also weighs each layout with smaller micro-batches and more recomputation; the table shows them as
    # configured (the variants that turn no knob).
    variants = with_knobs(candidates, cfg.train.micro_batch_size, cfg.train.activation_checkpointing)
    weighed = [layout_cost(c, work, machine) for c in variants]
    plans = [p for p in weighed if not p.candidate.train_values()]
    decision = choose(weighed, machine)
    facts = {
        "model": cfg.model.name,
        "parameters": work.parameters or _parameters(work),
        "hardware": hw.name,
        "world_size": world,
        "ranks_per_node": ranks_per_node,
        "device_memory_gib": machine.memory_bytes / GIB,
        "usable_gib": machine.usable_bytes / GIB,
        "precision": "bf16" if bf16 else "fp32",
        "bytes_per_parameter": sizes.__dict__,
        "links": machine.links.source,
        "batch": {"batch_size": cfg.train.batch_size, "micro_batch_size": cfg.train.micro_batch_size,
                  "seq_len": cfg.train.seq_len, "activation_checkpointing": cfg.train.activation_checkpointing},
    }  # fmt: skip
    if cfg.train.batch_size != configured_batch:
        facts["batch_note"] = (
            f"train.batch_size={configured_batch} does not split into micro-batches of {cfg.train.micro_batch_size} "
            f"over {world} ranks: planned with train.batch_size={cfg.train.batch_size}"
        )
    auto = auto_decision(cfg, world, ranks_per_node, work.gpt.vocab_size, bf16, cfg.parallel.pp_schedule)
    return plans, decision, auto, facts


def _parameters(work) -> int:
    from llmtrain.planner.shapes import whole_model_parameters

    return whole_model_parameters(work.gpt) - work.gpt.padding_parameters


def _count(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def format_table(plans: list[LayoutCost], facts: dict[str, Any]) -> str:
    head = (
        f"{facts['model']}: {_count(facts['parameters'])} parameters on {facts['world_size']} x {facts['hardware']} "
        f"({facts['device_memory_gib']:.1f} GiB, {facts['usable_gib']:.1f} usable), {facts['precision']}, batch "
        f"{facts['batch']['batch_size']} x {facts['batch']['seq_len']} (micro {facts['batch']['micro_batch_size']}, "
        f"recompute {facts['batch']['activation_checkpointing']}), links: {facts['links']}"
    )
    sampling = any(p.sampling_s for p in plans)  # a step that samples: its rollout's memory and time beside
    columns = ("layout", "params", "grads", "optim", "gathered", "activ", *(("sampling",) if sampling else ()),
               "total", "fits", "comm/step", *(("sample s",) if sampling else ()), "step s", "max params",
               "+activ")  # fmt: skip
    lines = [head, *([f"note: {facts['batch_note']}"] if "batch_note" in facts else [])]
    lines += [
        "GiB per rank (heaviest pipeline rank; with one micro-batch per step the total counts the larger of grads and "
        "activ, which backward trades for each other):",
        "  ".join(f"{c:>10}" for c in columns),
    ]
    for p in plans:
        m = p.heaviest
        held = (m.parameters, m.gradients, m.optimizer, m.gathered, m.activations, *((m.sampling,) if sampling else ()))
        cells = [p.name, *(f"{v / GIB:.2f}" for v in (*held, m.total)),
                 "yes" if p.fits else "NO?" if p.unmodelled else "NO", f"{p.comm_bytes_per_step / GIB:.2f}",
                 *((f"{p.sampling_s:.3g}",) if sampling else ()), f"{p.step_time_s:.3g}",
                 f"{p.max_parameters / 1e9:.2f}B", f"{p.max_parameters_with_activations / 1e9:.2f}B"]  # fmt: skip
        lines.append("  ".join(f"{c:>10}" for c in cells))
    lines.append(
        f"fits: the total within {1 - PEAK_ERROR_BOUND:.0%} of the usable memory (the rest kept for the planner's "
        f"error, held to the dry run)"
    )
    unsized = {p.name: p.unmodelled for p in plans if p.unmodelled}
    lines += [f"NO? {name}: the planner cannot size it ({why}); dry-run it" for name, why in unsized.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        return
    try:
        cfg = with_init_from_model(compose_config(argv), argv)
        validate(cfg)
        plans, decision, auto, facts = plan_config(cfg)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(ConfigError.exit_code)
    except HydraException as error:  # an override Hydra cannot apply: the same one line as train.py's
        print(f"error: {composition_error_line(error, RootConfig)}", file=sys.stderr)
        sys.exit(ConfigError.exit_code)
    print(format_table(plans, facts))
    if decision.chosen:
        model = f"model.init_from={cfg.model.init_from}" if cfg.model.init_from and not chose_preset(argv) else ""
        command = f"train.py {model or f'model={cfg.model.name}'} {decision.chosen.candidate.command_line()}"
        if "batch_note" in facts:
            command += f" train.batch_size={facts['batch']['batch_size']}"
        print(f"pick: {decision.reason}\n  run: {command}")
    else:
        print(f"pick: none: {decision.reason}")
    sizes = f"fp32 weights, gradients and optim={cfg.optim.name}'s moments"
    print(f"parallel=auto (llmtrain's sizes: {sizes}; every layout): {auto.reason}")
    result = {
        **facts,
        "layouts": [p.as_dict() for p in plans],
        "pick": decision.chosen.name if decision.chosen else None,
        "runner_up": decision.runner_up.name if decision.runner_up else None,
        "reason": decision.reason,
        "auto_pick": auto.chosen.name if auto.chosen else None,
        "auto_reason": auto.reason,
    }
    if cfg.plan.out is None:
        return
    out = os.path.abspath(os.path.expanduser(cfg.plan.out))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    partial = out + ".partial"
    with open(partial, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(partial, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main(sys.argv[1:])
