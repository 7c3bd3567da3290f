"""The smaller micro-batch after running out of memory: a rank that runs out in a step leaves, where the layout
takes one, the largest micro-batch of at most half its own for the next attempt (attempts.py), which resumes with
it: the same global batch, more accumulation."""

from __future__ import annotations

import dataclasses
import logging
import os

from hydra.core.hydra_config import HydraConfig

from llmtrain.config import RootConfig
from llmtrain.errors import ConfigError, OutOfMemory, OutOfMemoryRetried
from llmtrain.parallel_plan import ParallelPlan, plan_command
from llmtrain.process import attempts
from llmtrain.process.runtime import Runtime
from llmtrain.train.memory import out_of_memory

log = logging.getLogger("llmtrain")


def out_of_memory_in_step(config: RootConfig, runtime: Runtime, run_dir: str, step: int) -> OutOfMemory:
    """This rank's account of running out of memory in `step`. Where a smaller micro-batch fits the layout, it is
    left for the next attempt (a restart or requeue then resumes with it, the run unchanged but for the
    accumulation) and the error says so."""
    t = config.train
    lost = out_of_memory(
        runtime.rank, f"in step {step}", runtime.device, t.micro_batch_size, plan_command_of_run(runtime)
    )
    smaller = _smaller_micro_batch(config, runtime.world_size)
    if smaller is None:
        attempts.no_smaller_micro_batch(run_dir)
        return lost
    attempts.resume_with_micro_batch(run_dir, smaller, f"rank {runtime.rank} ran out of memory in step {step}")
    return OutOfMemoryRetried(
        f"{lost}. A restart or requeue resumes with train.micro_batch_size={smaller} (the same global batch)"
    )


def _smaller_micro_batch(config: RootConfig, world_size: int) -> int | None:
    """The largest micro-batch of at most half train.micro_batch_size that the layout takes for this batch; None
    where the micro-batch is 1 already or no smaller one fits."""
    for size in range(config.train.micro_batch_size // 2, 0, -1):
        train = dataclasses.replace(config.train, micro_batch_size=size)
        try:
            ParallelPlan.of(config.parallel, train, config.model, world_size)
        except ConfigError:
            continue
        return size
    return None


def micro_batch_after_running_out(config: RootConfig, run_dir: str) -> RootConfig:
    """`config` with the smaller micro-batch an earlier attempt at this run left when it ran out of memory."""
    left = attempts.micro_batch_to_resume_with(run_dir)
    if left is None or left[0] >= config.train.micro_batch_size:
        return config
    size, reason = left
    log.warning(
        f"train.micro_batch_size={size}, not {config.train.micro_batch_size}: {reason} "
        f"({os.path.join(run_dir, attempts.SMALLER_MICRO_BATCH)}); the global batch is the same"
    )
    return dataclasses.replace(config, train=dataclasses.replace(config.train, micro_batch_size=size))


def plan_command_of_run(runtime: Runtime) -> str:
    """The planner command for this run (its overrides, this world size)."""
    return plan_command(list(HydraConfig.get().overrides.task), runtime.world_size)
