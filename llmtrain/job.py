"""One training job, start to finish: runtime -> config checks -> tokenizer -> plan and mesh -> data -> the model
laid out -> trainer -> report. `train.py` calls `run` with the composed Hydra config. How the process ends is
exits.py's; what the run's device and parallel=auto decide, the planner's (planner/resolve.py)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, cast

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from llmtrain import attempts
from llmtrain.checkpoint import save_final_model
from llmtrain.checkpoint.manager import CheckpointManager
from llmtrain.checkpoint.training import (
    RunCheckpoints,
    RunIdentity,
    check_base_matches,
    check_model_matches,
    check_optimizer_matches,
    read_data_position,
    resume_path,
    wandb_run_id,
)
from llmtrain.config import RootConfig, WandbConfig
from llmtrain.data import Data, DataReading, RankSlice, build_data, build_tokenizer, streaming_scale_warning
from llmtrain.data.tasks import read_task
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.errors import PREEMPTED_EXIT, ConfigError, OutOfMemory, OutOfMemoryRetried, RunError, note_step
from llmtrain.exits import exits_on_config_error, leave_if_ended_on_purpose, run_to_exit
from llmtrain.model import (
    GPT,
    Materializer,
    base_of,
    flops_per_token,
    initial_weights,
    materialize,
    meta_model,
    num_parameters,
    trainable_parameters,
)
from llmtrain.optim import build_lr_schedule
from llmtrain.parallel.mesh import RankMesh
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.plan import ParallelPlan, plan_command
from llmtrain.planner.resolve import predicted, resolved_for_device
from llmtrain.run_dir import remove_if_empty_run
from llmtrain.runtime import Runtime, init_runtime
from llmtrain.spawn import launched_externally, spawn_workers
from llmtrain.train.fault_points import FaultPoints
from llmtrain.train.loggers import RunLoggers
from llmtrain.train.loop import Components, Trainer
from llmtrain.train.memory import MIB, HeldBytes, MemoryPeak, allocation_failed, held_bytes, out_of_memory
from llmtrain.train.objectives import build_objective
from llmtrain.train.observers import StepObserver
from llmtrain.train.preemption import PreemptionWatch
from llmtrain.train.profiling import StepProfiler
from llmtrain.train.report import compiled_graphs, end_summary, format_end_summary, start_summary
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
        *_wandb_identity(config.logging.wandb, run_dir),
        preemption,
    )
    remove_if_empty_run(run_dir)
    if code == PREEMPTED_EXIT and preemption.signal_name:
        preemption.hand_over()  # e.g. submitit, which requeues the job
    if code:
        sys.exit(code)


def _wandb_identity(wandb: WandbConfig, run_dir: str) -> tuple[str, str | None]:
    """Run name and group as configured, else from Hydra: a `-m` sweep is one group named after its sweep
    directory, each job named by its overrides."""
    name, group = wandb.name, wandb.group
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        group = group or os.path.relpath(hydra_cfg.sweep.dir)
        name = name or f"{group}/{hydra_cfg.job.override_dirname or hydra_cfg.job.num}"
    return name or os.path.relpath(run_dir), group


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
            runtime.rank, where, runtime.device, config.train.micro_batch_size, _plan(runtime)
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
    loggers = _run_loggers(training, run_dir) if runtime.is_main else None
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
        raise _out_of_memory_in_step(config, runtime, run_dir, trainer.state.step + 1) from None
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
        _log_end_summary(training, state, loggers, profiler, layout_results, wall_seconds, run_dir)


def _out_of_memory_in_step(config: RootConfig, runtime: Runtime, run_dir: str, step: int) -> OutOfMemory:
    """This rank's account of running out of memory in `step`. Where a smaller micro-batch fits the layout, it is
    left for the next attempt (a restart or requeue then resumes with it, the run unchanged but for the
    accumulation) and the error says so."""
    t = config.train
    lost = out_of_memory(runtime.rank, f"in step {step}", runtime.device, t.micro_batch_size, _plan(runtime))
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


def _micro_batch_after_running_out(config: RootConfig, run_dir: str) -> RootConfig:
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


def _steps(trainer: Trainer) -> LoopState:
    """The trainer's steps; an error out of them carries the step it ended (a crash that repeats at the same step
    is a bug, attempts.py)."""
    try:
        return trainer.run()
    except Exception as error:
        note_step(error, trainer.state.step + 1)
        raise


def _run_loggers(training: Components, run_dir: str) -> RunLoggers:
    """Rank 0's console log, metrics.jsonl and W&B run, continuing the history of the run resumed."""
    name, group = _wandb_identity(training.config.logging.wandb, run_dir)
    return RunLoggers(training.config, run_dir, name, group, history=training.state.records, wandb_id=training.wandb_id)


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


def _log_end_summary(
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
        parameters=training.n_params,
        layout=training.model.plan.summary(),
        world_size=runtime.world_size,
        **layout_results,
    )
    if t.compile:  # evidence that compilation happened: graphs dynamo produced in this (rank 0's) process
        summary["compiled_graphs"] = compiled_graphs()
    if (profile := profiler.summary()) is not None:
        summary["profile"] = profile
    summary["predicted"] = predicted(config, runtime, training.model_config.vocab_size)
    if earlier := attempts.interruptions(run_dir):
        summary["interruptions"] = earlier
    loggers.finish(summary, state.records)
    log.info("\n" + format_end_summary(summary))


def _plan(runtime: Runtime) -> str:
    """The planner command for this run (its overrides, this world size)."""
    return plan_command(list(HydraConfig.get().overrides.task), runtime.world_size)


@dataclass(frozen=True)
class _Placement:
    """Where this rank sits in the run's layout: the plan (checked against the model and the world), its mesh and
    its slices of each training and validation batch."""

    plan: ParallelPlan
    mesh: RankMesh
    train_slice: RankSlice
    val_slice: RankSlice


@dataclass(frozen=True)
class _Resume:
    """The run's checkpoint directory, the checkpoint it resumes from (None: it starts afresh) and, fine-tuning,
    the identity of the frozen base weights its checkpoints are stored against."""

    directory: str
    path: str | None
    base: dict[str, Any] | None


def build_training(config: RootConfig, runtime: Runtime, run_dir: str) -> Components:
    """Everything before the first step, the one builder behind training, the tools and the tests: the layout
    (parallel=auto decided here), the data at its position, the model and optimizer laid out (restored from the
    checkpoint being resumed), and the start summary logged."""
    config = _micro_batch_after_running_out(config, run_dir)
    tokenizer = build_tokenizer(config.data, runtime.is_main, runtime.barrier)
    _check_vocab(config, tokenizer.vocab_size)
    config, chosen_by_planner = resolved_for_device(config, runtime, tokenizer.vocab_size)
    place = _placement(config, runtime)
    # shapes only: nothing is allocated yet
    meta = meta_model(config.model, tokenizer.vocab_size, config.train.activation_checkpointing)
    resume = _resume(config, runtime, run_dir, meta)
    data = _data(config, tokenizer, place, resume)
    try:  # the data's reading thread is stopped on the way out of a failed build
        parts, memory = _components(config, runtime, run_dir, place, meta, data, resume)
        resumed = f"{resume.path} (step {parts.state.step})" if resume.path else None
        summary = start_summary(
            parts, chosen_by_planner=chosen_by_planner, memory=memory, run_dir=run_dir, resumed=resumed
        )
        log.info("\n" + summary)
        return parts
    except BaseException:
        data.close()
        raise


def _check_vocab(config: RootConfig, tokenizer_vocab: int) -> None:
    if config.model.vocab_size is not None and config.model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab}): set model.vocab_size=null to use the tokenizer's size"
        )


def _placement(config: RootConfig, runtime: Runtime) -> _Placement:
    """The plan checked against the model and the world (ConfigError), then where this rank sits in it; this rank's
    dropout stream seeded."""
    plan = ParallelPlan.of(config.parallel, config.train, config.model, runtime.world_size)
    mesh = RankMesh.of(plan, runtime)
    t, dp_size = config.train, plan.dp_size
    train_slice = RankSlice(t.batch_size, t.micro_batch_size, mesh.dp_rank, dp_size)
    # The validation set is eval_batches global batches, whatever the layout, so val_loss compares across layouts.
    val_slice = RankSlice(t.eval_batches * t.batch_size, t.micro_batch_size, mesh.dp_rank, dp_size)
    # Dropout draws from this generator: data-parallel ranks (different sequences) get their own streams, the
    # tensor-parallel ranks of one replica share one (llmtrain/model/dropout.py).
    torch.manual_seed(config.seed + mesh.dp_rank)
    if runtime.is_main and (warning := streaming_scale_warning(config.data, dp_size)):
        log.warning(warning)
    return _Placement(plan, mesh, train_slice, val_slice)


def _resume(config: RootConfig, runtime: Runtime, run_dir: str, meta: GPT) -> _Resume:
    """Collective: the checkpoint this run resumes from (rank 0's choice, its files hashed by every rank), checked to
    fit this run's model, base weights and optimizer."""
    directory = os.path.abspath(os.path.expanduser(config.checkpoint.dir or os.path.join(run_dir, "checkpoints")))
    path = resume_path(config.checkpoint, directory, runtime)
    base = base_of(config.model, config.seed) if meta.cfg.lora.enabled else None
    if path:
        check_model_matches(path, meta.cfg)
        check_base_matches(path, base)
        check_optimizer_matches(path, config.optim)
    return _Resume(directory, path, base)


def _data(config: RootConfig, tokenizer: Tokenizer, place: _Placement, resume: _Resume) -> Data:
    """This rank's training batches, at the resumed checkpoint's position, and its validation rows."""
    t = config.train
    reading = DataReading(
        t.seq_len,
        config.seed,
        train=place.train_slice,
        validation=place.val_slice if t.eval_every > 0 else None,
        position=read_data_position(resume.path) if resume.path else None,
    )
    return build_data(config.data, tokenizer, reading, steps=t.steps, packs_documents=t.attention == "document")


def _components(
    config: RootConfig, runtime: Runtime, run_dir: str, place: _Placement, meta: GPT, data: Data, resume: _Resume
) -> tuple[Components, str]:
    """Collective: the model laid out with its optimizer, schedule and checkpoints, restored from the checkpoint
    resumed: the job's components; and what every rank holds, described."""
    gpt_cfg, t = meta.cfg, config.train
    n_params, trainable = num_parameters(meta) - gpt_cfg.padding_parameters, trainable_parameters(meta)
    model, memory = _model_laid_out(config, place, runtime, meta, data)
    lr_schedule = build_lr_schedule(model.optimizer, t.steps, config.optim)
    wandb_id = wandb_run_id(resume.path, resume.directory) if runtime.is_main else None  # rank 0 logs and writes meta
    checkpoints = RunCheckpoints(
        CheckpointManager(resume.directory, config.checkpoint.keep, config.checkpoint.async_save, runtime),
        model,
        lr_schedule,
        data,
        gpt_cfg,
        config.optim,
        RunIdentity(os.path.abspath(run_dir), wandb_id),
        resume.base,
    )
    point = checkpoints.restore(resume.path) if resume.path else None
    parts = Components(
        config=config,
        runtime=runtime,
        model=model,
        model_config=gpt_cfg,
        lr_schedule=lr_schedule,
        data=data,
        train_slice=place.train_slice,
        val_slice=place.val_slice,
        objective=build_objective(config, model, data, place.val_slice),
        checkpoints=checkpoints,
        state=LoopState(step=point.step, records=list(point.records)) if point else LoopState(),
        n_params=n_params,
        n_trainable=trainable if gpt_cfg.lora.enabled else n_params,
        model_flops=flops_per_token(gpt_cfg, n_params, t.seq_len, trainable),
        wandb_id=wandb_id,
        run_dir=os.path.abspath(run_dir),
        tasks=[read_task(path, data.tokenizer, t.seq_len, config.eval.limit) for path in config.eval.tasks or []],
    )
    return parts, memory


def _model_laid_out(
    config: RootConfig, place: _Placement, runtime: Runtime, meta: GPT, data: Data
) -> tuple[ParallelModel, str]:
    """Collective: the model and its optimizer laid out on this rank for `data` (its document separator, whether it
    leaves targets untrained), and what every rank holds with the build's peak."""
    with MemoryPeak(runtime.device) as build:
        model = _laid_out(
            config,
            place.plan,
            place.mesh,
            runtime,
            meta,
            eos_id=data.document_separator,
            masked_targets=data.masks_targets,
        )
    held = held_bytes(model.module, model.optimizer, config.optim)
    return model, _memory_summary(runtime, held, build.bytes)


def _memory_summary(runtime: Runtime, held: HeldBytes, build_peak: int | None) -> str:
    """Collective: what each rank holds and the build's peak, one line when every rank holds the same."""
    values = torch.tensor(
        [held.params, held.grads, held.optimizer, -1 if build_peak is None else build_peak],
        dtype=torch.int64,
        device=runtime.device,
    )
    rows = [values]
    if runtime.distributed:
        rows = [torch.empty_like(values) for _ in range(runtime.world_size)]
        torch.distributed.all_gather(rows, values)
    described = []
    for row in rows:
        params, grads, optimizer, peak = row.tolist()
        built = f"; build peak {peak / MIB:,.1f} MiB" if peak >= 0 else ""
        described.append(HeldBytes(params, grads, optimizer, held.optimizer_on_host).describe() + built)
    if len(described) == 1:
        return described[0]
    if len(set(described)) == 1:
        return f"every rank: {described[0]}"
    return "\n          ".join(f"rank {rank}: {line}" for rank, line in enumerate(described))


def build_parallel_model(
    config: RootConfig | DictConfig,
    runtime: Runtime,
    vocab_size: int,
    materializer: Materializer = materialize,
    eos_id: int | None = None,
) -> ParallelModel:
    """The model of `config` laid out on this rank with its optimizer, as training builds it (for tools and tests
    that run steps of their own; a dry run allocates it with a `materializer` of its own). `eos_id`: the
    tokenizer's end-of-text token (needed with train.attention=document)."""
    if isinstance(config, DictConfig):
        config = cast(RootConfig, OmegaConf.to_object(config))
    plan = ParallelPlan.of(config.parallel, config.train, config.model, runtime.world_size)
    return _laid_out(
        config,
        plan,
        RankMesh.of(plan, runtime),
        runtime,
        meta_model(config.model, vocab_size, config.train.activation_checkpointing),
        materializer,
        eos_id,
    )


def _laid_out(
    config: RootConfig,
    plan: ParallelPlan,
    mesh: RankMesh,
    runtime: Runtime,
    meta: GPT,
    materializer: Materializer = materialize,
    eos_id: int | None = None,
    masked_targets: bool = False,
) -> ParallelModel:
    """The layout applied to the meta-device `meta`; then each rank allocates and initialises only its part
    (`masked_targets`: the data leaves some targets untrained, Data.masks_targets)."""
    init = initial_weights(config.model, meta, config.seed)
    return ParallelModel(plan, mesh, runtime, meta, init, config.optim, materializer, eos_id, masked_targets)
