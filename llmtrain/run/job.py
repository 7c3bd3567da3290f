"""One training job, start to finish: the runtime, the job built (build.py), the trainer's steps, the final weights
and the report (reporting.py); or, under parallel.nproc, this node's workers. `train.py` calls `run` with the
composed Hydra config. How the process ends is exits.py's."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import cast

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from llmtrain.checkpoint import save_final_model
from llmtrain.config import RootConfig
from llmtrain.errors import PREEMPTED_EXIT, RunError, note_step
from llmtrain.process.run_dir import remove_if_empty_run
from llmtrain.process.runtime import Runtime, init_runtime
from llmtrain.run.build import build_training
from llmtrain.run.exits import exits_on_config_error, leave_if_ended_on_purpose, run_to_exit
from llmtrain.run.reporting import log_end_summary, run_loggers, wandb_identity
from llmtrain.run.retry import out_of_memory_in_step, plan_command_of_run
from llmtrain.run.spawn import launched_externally, spawn_workers
from llmtrain.train.fault_points import FaultPoints
from llmtrain.train.loop import Components, Trainer
from llmtrain.train.memory import allocation_failed, out_of_memory
from llmtrain.train.observers import StepObserver
from llmtrain.train.preemption import PreemptionWatch
from llmtrain.train.profiling import StepProfiler
from llmtrain.train.state import LoopState
from llmtrain.train.stragglers import StragglerWatch, stages_of_ranks
from llmtrain.train.watchdog import StepWatchdog

log = logging.getLogger("llmtrain")


def run(cfg: DictConfig, preemption: PreemptionWatch, entry_point: str) -> None:
    """Train with the validated `cfg`, or start this node's workers running `entry_point` (train.py) to do so
    (parallel.nproc > 1 outside torchrun); exits with the codes README lists (exits.py). `preemption` has been
    watching for stop signals since the process started."""
    config = cast(RootConfig, OmegaConf.to_object(cfg))  # typed from here on, each section handed to what uses it
    run_dir = HydraConfig.get().runtime.output_dir
    with exits_on_config_error(run_dir):
        if (config.parallel.nproc > 1 or config.parallel.max_restarts) and not launched_externally():
            _run_workers(config, preemption, entry_point, run_dir)
            return
        leave_if_ended_on_purpose()
        runtime = init_runtime(config.train.device)
        preemption.attach(runtime)
    if not runtime.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    # Watching from here: a hang while the model is built, a checkpoint read or the first step compiled is caught too
    watchdog = StepWatchdog.for_run(config.train.hang_timeout, runtime, run_dir)
    run_to_exit(lambda: _train(config, runtime, run_dir, preemption, watchdog), runtime, run_dir, preemption)


def _run_workers(config: RootConfig, preemption: PreemptionWatch, entry_point: str, run_dir: str) -> None:
    """This node's parallel.nproc workers, each running `entry_point` with this command line and restarted up to
    parallel.max_restarts times; exits with the first failing worker's code."""
    code = spawn_workers(
        entry_point,
        config.parallel.nproc,
        config.parallel.max_restarts,
        list(HydraConfig.get().overrides.task),
        run_dir,
        *wandb_identity(config.logging.wandb, run_dir),
        preemption,
    )
    remove_if_empty_run(run_dir)
    if code == PREEMPTED_EXIT and preemption.signal_name:
        preemption.hand_over()  # e.g. submitit, which requeues the job
    if code:
        sys.exit(code)


def _train(
    config: RootConfig, runtime: Runtime, run_dir: str, preemption: PreemptionWatch, watchdog: StepWatchdog | None
) -> None:
    """This rank's part of the job; an allocation that fails outside the steps (building the model or its state)
    ends it as OutOfMemory, with what this rank held and what to change. `watchdog` is closed however it ends."""
    try:
        _build_and_train(config, runtime, run_dir, preemption, watchdog)
    except (torch.OutOfMemoryError, RuntimeError) as error:  # before the first step: the model or its state
        if isinstance(error, RunError) or not allocation_failed(error):
            raise
        where = "while building the model"
        raise out_of_memory(
            runtime.rank, where, runtime.device, config.train.micro_batch_size, plan_command_of_run(runtime)
        ) from error
    finally:
        if watchdog is not None:
            watchdog.close()


def _build_and_train(
    config: RootConfig,
    runtime: Runtime,
    run_dir: str,
    preemption: PreemptionWatch,
    watchdog: StepWatchdog | None,
) -> None:
    """Build, train to train.steps, save the final weights and report (rank 0: metrics, W&B, the end summary)."""
    wall_start = time.perf_counter()
    training = build_training(config, runtime, run_dir)
    config, model, t = training.config, training.model, training.config.train
    loggers = run_loggers(training, run_dir) if runtime.is_main else None
    profiler = StepProfiler(config.profile, runtime, run_dir)
    observers = _step_observers(training, profiler, watchdog)
    record = loggers.record if loggers else lambda record: None
    trainer = Trainer(training, record, observers=observers, preemption=preemption)
    try:
        state = _steps(trainer)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if isinstance(error, RunError) or not allocation_failed(error):
            raise
        profiler.write_memory("out of memory")
        raise out_of_memory_in_step(config, runtime, run_dir, trainer.state.step + 1) from None
    finally:
        training.data.close()
        if loggers:
            loggers.close_console()
    if t.save_model:
        weights = model.full_state_dict()  # on rank 0 only
        if weights is not None:
            save_final_model(weights, os.path.join(run_dir, "model.pt"))
    profiler.write_memory("end of the run")
    layout_results = model.report(run_dir)
    if loggers:
        wall_seconds = time.perf_counter() - wall_start
        log_end_summary(training, state, loggers, profiler, layout_results, wall_seconds, run_dir)


def _steps(trainer: Trainer) -> LoopState:
    """The trainer's steps; an error out of them carries the step it ended (a crash that repeats at the same step
    is a bug, attempts.py)."""
    try:
        return trainer.run()
    except Exception as error:
        note_step(error, trainer.state.step + 1)
        raise


def _step_observers(training: Components, profiler: StepProfiler, watchdog: StepWatchdog | None) -> list[StepObserver]:
    """What watches the steps: the profiler, the hang watchdog (train.hang_timeout), with more than one rank the
    straggler report (logging.straggler_threshold), and the fault points."""
    config, runtime = training.config, training.runtime
    observers: list[StepObserver] = [profiler]
    if watchdog is not None:
        observers.append(watchdog)
    threshold = config.logging.straggler_threshold
    if runtime.world_size > 1 and threshold > 0:
        stages = stages_of_ranks(training.model.mesh.device_mesh, runtime.world_size)
        observers.append(StragglerWatch(runtime, config.logging.log_every, threshold, stages))
    observers.append(FaultPoints(runtime.rank, training.model.module))
    return observers
