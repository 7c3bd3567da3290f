"""What rank 0 reports of a job: its loggers (console, metrics.jsonl, W&B under the run's name and group) and the
end summary (logged, summary.json, W&B)."""

from __future__ import annotations

import logging
import os

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from llmtrain.config import WandbConfig
from llmtrain.planner.resolve import predicted
from llmtrain.process import attempts
from llmtrain.train.loggers import RunLoggers
from llmtrain.train.loop import Components
from llmtrain.train.profiling import StepProfiler
from llmtrain.train.report import compiled_graphs, end_summary, format_end_summary
from llmtrain.train.state import LoopState

log = logging.getLogger("llmtrain")


def wandb_identity(wandb: WandbConfig, run_dir: str) -> tuple[str, str | None]:
    """Run name and group as configured, else from Hydra: a `-m` sweep is one group named after its sweep
    directory, each job named by its overrides."""
    name, group = wandb.name, wandb.group
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        group = group or os.path.relpath(hydra_cfg.sweep.dir)
        name = name or f"{group}/{hydra_cfg.job.override_dirname or hydra_cfg.job.num}"
    return name or os.path.relpath(run_dir), group


def run_loggers(training: Components, run_dir: str) -> RunLoggers:
    """Rank 0's console log, metrics.jsonl and W&B run, continuing the history of the run resumed."""
    name, group = wandb_identity(training.config.logging.wandb, run_dir)
    return RunLoggers(
        training.config,
        run_dir,
        name,
        group,
        history=training.state.records,
        wandb_id=training.wandb_id,
        objective=training.objective.console,
    )


def log_end_summary(
    training: Components,
    state: LoopState,
    loggers: RunLoggers,
    profiler: StepProfiler,
    layout_results: dict,
    wall_seconds: float,
    run_dir: str,
) -> None:
    """The end summary: logged, and written to summary.json (last: it marks a completed run) and W&B; with how
    the run's earlier attempts ended, where it was restarted or requeued."""
    config, runtime, t = training.config, training.runtime, training.config.train
    summary = end_summary(state.records, wall_seconds, state.train_seconds, t.batch_size * t.seq_len)
    summary.update(
        parameters=training.facts.parameters,
        layout=training.model.plan.summary(),
        world_size=runtime.world_size,
        **layout_results,
    )
    if t.compile:  # evidence that compilation happened: graphs dynamo produced in this (rank 0's) process
        summary["compiled_graphs"] = compiled_graphs()
    if (profile := profiler.summary()) is not None:
        summary["profile"] = profile
    summary["predicted"] = predicted(config, runtime, training.facts.shape.vocab_size)
    if earlier := attempts.interruptions(run_dir):
        summary["interruptions"] = earlier
    loggers.finish(summary, state.records)
    log.info("\n" + format_end_summary(summary))
