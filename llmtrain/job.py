"""One training job, start to finish: runtime -> config checks -> tokenizer -> plan and mesh -> data -> the model
laid out -> trainer -> report. `train.py` calls `run` with the composed Hydra config."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import time
from typing import NoReturn, cast

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from llmtrain.catalog import AUTO
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
from llmtrain.config import HardwareConfig, RootConfig, WandbConfig
from llmtrain.data import DataReading, RankSlice, build_data, build_tokenizer, streaming_scale_warning
from llmtrain.data.tasks import read_task
from llmtrain.errors import PREEMPTED_EXIT, ConfigError, Preempted, RunError, exit_for
from llmtrain.launch_env import launch_rank
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
from llmtrain.parallel.precision import uses_bf16
from llmtrain.plan import ParallelPlan, plan_command, with_layouts_that_run
from llmtrain.run_dir import exit_with_config_error, remove_if_empty_run
from llmtrain.runtime import Runtime, ended_on_purpose, init_runtime, record_end_on_purpose
from llmtrain.spawn import launched_externally, spawn_workers
from llmtrain.train.loggers import RunLoggers
from llmtrain.train.loop import Components, LoopState, Trainer
from llmtrain.train.memory import (
    MIB,
    HeldBytes,
    MemoryPeak,
    allocation_failed,
    held_bytes,
    out_of_memory,
)
from llmtrain.train.peer_loss import is_peer_loss, peer_lost
from llmtrain.train.preemption import PreemptionWatch
from llmtrain.train.profiling import StepProfiler
from llmtrain.train.report import compiled_graphs, end_summary, format_end_summary, start_summary
from llmtrain.train.stragglers import StragglerWatch, stages_of_ranks
from llmtrain.train.watchdog import StepWatchdog

log = logging.getLogger("llmtrain")


def _wandb_identity(wandb: WandbConfig, run_dir: str) -> tuple[str, str | None]:
    """Run name and group as configured, else from Hydra: a `-m` sweep is one group named after its sweep
    directory, each job named by its overrides."""
    name, group = wandb.name, wandb.group
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        group = group or os.path.relpath(hydra_cfg.sweep.dir)
        name = name or f"{group}/{hydra_cfg.job.override_dirname or hydra_cfg.job.num}"
    return name or os.path.relpath(run_dir), group


def _check_vocab(config: RootConfig, tokenizer_vocab: int) -> None:
    if config.model.vocab_size is not None and config.model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab}): set model.vocab_size=null to use the tokenizer's size"
        )


def run(cfg: DictConfig, preemption: PreemptionWatch, entry_point: str) -> None:
    """Train with the validated `cfg`, or start this node's workers running `entry_point` (train.py) to do so
    (parallel.nproc > 1 outside torchrun); exits with the codes README lists. `preemption` has been watching for
    stop signals since the process started."""
    config = cast(RootConfig, OmegaConf.to_object(cfg))  # typed from here on, each section handed to what uses it
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        if (config.parallel.nproc > 1 or config.parallel.max_restarts) and not launched_externally():
            _run_workers(config, preemption, entry_point, run_dir)
            return
        _leave_if_ended_on_purpose()
        runtime = init_runtime(config.train.device)
        preemption.attach(runtime)
    except ConfigError as error:
        exit_with_config_error(error, run_dir, is_main=True)
    if not runtime.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        try:
            _train(config, runtime, run_dir, preemption)
        except (torch.OutOfMemoryError, RuntimeError) as error:  # before the first step: the model or its state
            if isinstance(error, RunError) or not allocation_failed(error):
                raise
            where = "while building the model"
            raise out_of_memory(
                runtime.rank, where, runtime.device, config.train.micro_batch_size, _plan(runtime)
            ) from error
    except RunError as error:
        _end_on_purpose(error, runtime, run_dir, preemption)
    except BaseException as error:
        _end_after(error, runtime)
    runtime.shutdown(synchronize=True)


def _end_on_purpose(error: RunError, runtime: Runtime, run_dir: str, preemption: PreemptionWatch) -> NoReturn:
    """A run that cannot go on, for a reason every restart would meet again (README: exit codes): its one line and
    exit code, recorded for a launcher's restarts too."""
    if isinstance(error, ConfigError):
        error = with_layouts_that_run(error, list(HydraConfig.get().overrides.task), runtime.world_size)
    if isinstance(error, ConfigError) and runtime.is_main:
        remove_if_empty_run(run_dir)
    if runtime.is_main or not error.main_rank_speaks:
        record_end_on_purpose(runtime, error.exit_code, str(error))
    preempted = isinstance(error, Preempted)

    def shut_down(synchronize: bool) -> None:
        runtime.shutdown(synchronize=synchronize)
        if preempted:
            preemption.hand_over()  # e.g. submitit's handler, which requeues the job

    exit_for(error, runtime.is_main, shut_down)


def _leave_if_ended_on_purpose() -> None:
    """A worker restarted after the run had ended on purpose (a stop signal, bad input, divergence) leaves with
    that run's exit code: only a crash, a hang or a lost peer is trained on from the last checkpoint."""
    ended = ended_on_purpose()
    if ended is None:
        return
    code, line = ended
    if launch_rank() == 0:
        print(f"llmtrain: not restarted, as the run had ended on purpose (exit {code}): {line}", file=sys.stderr)
    sys.exit(code)


def _end_after(error: BaseException, runtime: Runtime) -> NoReturn:
    """A failure that is no RunError: a peer's death becomes PeerLost (one line, its exit code); anything else
    keeps its traceback."""
    if isinstance(error, Exception) and runtime.distributed and is_peer_loss(error):
        lost, speaks = peer_lost(error, runtime)
        exit_for(lost, speaks, lambda _: runtime.abort())  # a group with a dead member: torn down, not left
    runtime.shutdown()  # no barrier: a failed rank's peers may never reach it
    raise error


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


def _agreed(runtime: Runtime, value):
    """Rank 0's `value` on every rank (each rank reading the checkpoint directory could see it mid-change)."""
    if not runtime.distributed:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


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


def _plan(runtime: Runtime) -> str:
    """The planner command for this run (its overrides, this world size)."""
    return plan_command(list(HydraConfig.get().overrides.task), runtime.world_size)


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


def build_training(config: RootConfig, runtime: Runtime, run_dir: str) -> Components:
    """Everything before the first step, the one builder behind training, the tools and the tests: the layout
    (parallel=auto decided here), the data at its position, the model and optimizer laid out (restored from the
    checkpoint being resumed), and the start summary logged."""
    tokenizer = build_tokenizer(config.data, runtime.is_main, runtime.barrier)
    _check_vocab(config, tokenizer.vocab_size)
    hardware = _device_hardware(config, runtime)
    if isinstance(hardware, HardwareConfig) and hardware is not config.hardware:
        if runtime.is_main:
            log.info(f"hardware  {hardware.name} (conf/hardware/{hardware.name}.yaml), the config of this run's device")
        config = dataclasses.replace(config, hardware=hardware)
    auto = None
    if config.parallel.layout == AUTO:
        if isinstance(hardware, str):
            raise ConfigError(f"parallel=auto cannot plan for this device: {hardware}")
        if config.plan.measured is None and runtime.world_size > 1:  # measure first: the links this machine has
            measured = _measured_links(config, runtime)
            config = dataclasses.replace(config, plan=dataclasses.replace(config.plan, measured=measured))
        decided = _agreed(runtime, _auto_layout(config, runtime, tokenizer.vocab_size) if runtime.is_main else None)
        if isinstance(decided, ConfigError):  # raised on every rank: none is left waiting for the others
            raise decided
        auto = decided
        # what W&B and the summaries show: the layout, and the knobs turned so that it fits
        config = dataclasses.replace(
            config, parallel=auto.parallel, train=dataclasses.replace(config.train, **auto.train)
        )
        log.info(auto.summary)
    # The plan checked against the model and the world (ConfigError), then where this rank sits in it.
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
    # shapes only: nothing is allocated yet
    meta = meta_model(config.model, tokenizer.vocab_size, config.train.activation_checkpointing)
    gpt_cfg = meta.cfg
    checkpoint_dir = os.path.abspath(os.path.expanduser(config.checkpoint.dir or os.path.join(run_dir, "checkpoints")))
    resume = _agreed(runtime, resume_path(config.checkpoint, checkpoint_dir, runtime.is_main))
    base = base_of(config.model, config.seed) if gpt_cfg.lora.enabled else None
    if resume:
        check_model_matches(resume, gpt_cfg)
        check_base_matches(resume, base)
        check_optimizer_matches(resume, config.optim)
    reading = DataReading(
        t.seq_len,
        config.seed,
        train=train_slice,
        validation=val_slice if t.eval_every > 0 else None,
        position=read_data_position(resume) if resume else None,
    )
    data = build_data(config.data, tokenizer, reading, steps=t.steps, packs_documents=t.attention == "document")
    try:  # the data's reading thread is stopped on the way out of a failed build
        n_params, trainable = num_parameters(meta) - gpt_cfg.padding_parameters, trainable_parameters(meta)
        with MemoryPeak(runtime.device) as build:
            model = _laid_out(
                config, plan, mesh, runtime, meta, eos_id=data.document_separator, masked_targets=data.masks_targets
            )
        held = held_bytes(model.module, model.optimizer, config.optim)
        memory = _memory_summary(runtime, held, build.bytes)
        lr_schedule = build_lr_schedule(model.optimizer, t.steps, config.optim)
        wandb_id = wandb_run_id(resume, checkpoint_dir) if runtime.is_main else None  # rank 0 logs and writes meta
        checkpoints = RunCheckpoints(
            CheckpointManager(checkpoint_dir, config.checkpoint.keep, config.checkpoint.async_save, runtime),
            model,
            lr_schedule,
            data,
            gpt_cfg,
            config.optim,
            RunIdentity(os.path.abspath(run_dir), wandb_id),
            base,
        )
        point = checkpoints.restore(resume) if resume else None
        parts = Components(
            config=config,
            runtime=runtime,
            model=model,
            model_config=gpt_cfg,
            lr_schedule=lr_schedule,
            data=data,
            train_slice=train_slice,
            val_slice=val_slice,
            checkpoints=checkpoints,
            state=LoopState(step=point.step, records=list(point.records)) if point else LoopState(),
            n_params=n_params,
            n_trainable=trainable if gpt_cfg.lora.enabled else n_params,
            model_flops=flops_per_token(gpt_cfg, n_params, t.seq_len, trainable),
            wandb_id=wandb_id,
            tasks=[read_task(path, data.tokenizer, t.seq_len, config.eval.limit) for path in config.eval.tasks or []],
        )
        resumed = f"{resume} (step {parts.state.step})" if resume else None
        summary = start_summary(
            parts, chosen_by_planner=auto is not None, memory=memory, run_dir=run_dir, resumed=resumed
        )
        log.info("\n" + summary)
        return parts
    except BaseException:
        data.close()
        raise


def _measured_links(config: RootConfig, runtime: Runtime) -> str:
    """Collective: a comm_bench CSV of this machine's collectives over all ranks, measured once (a few seconds) and
    cached in data.cache_dir per host, world size, ranks per node and device; its path, the same on every rank."""
    from llmtrain.launch_env import ranks_per_node
    from llmtrain.planner.probe import probe_links

    device = _device_name(runtime.device)
    name = f"{socket.gethostname()}-{runtime.world_size}x-{ranks_per_node()}pernode-{device}".replace(" ", "_")
    path = os.path.join(os.path.expanduser(config.data.cache_dir), "links", f"{name}.csv")
    path, cached = _agreed(runtime, (path, os.path.exists(path)) if runtime.is_main else None)
    when = "cached"
    if not cached:
        started = time.perf_counter()
        probe_links(runtime, path)
        runtime.barrier()
        when = f"in {time.perf_counter() - started:.1f} s"
    log.info(f"parallel=auto plans with the collectives measured on this machine ({when}): {path}")
    return path


def _auto_layout(config: RootConfig, runtime: Runtime, vocab_size: int):
    """parallel=auto's choice for this world, or the ConfigError saying why there is none (decided on rank 0, which
    times the host when the hardware gives no peak, and handed to every rank)."""
    from llmtrain.launch_env import ranks_per_node
    from llmtrain.planner.auto import auto_layout

    bf16 = uses_bf16(config.train.precision, runtime.device)
    per_node = min(ranks_per_node(), runtime.world_size)
    try:
        return auto_layout(config, config.parallel, runtime.world_size, per_node, vocab_size, bf16)
    except ConfigError as error:
        return error


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _device_hardware(config: RootConfig, runtime: Runtime) -> HardwareConfig | str:
    """The hardware config of the device this run is on, or why there is none (llmtrain/planner/hardware.py)."""
    from llmtrain.planner.hardware import hardware_for_device

    return hardware_for_device(config.hardware, runtime.device.type, _device_name(runtime.device))


def _prediction(config: RootConfig, runtime: Runtime, vocab_size: int) -> dict:
    """The planner's prediction for this run's layout on its device (rank 0; the hardware config's links, or
    plan.measured), or why there is none."""
    from llmtrain.launch_env import ranks_per_node
    from llmtrain.planner.auto import prediction

    hardware = _device_hardware(config, runtime)
    if isinstance(hardware, str):
        return {"unavailable": hardware}

    bf16 = uses_bf16(config.train.precision, runtime.device)
    per_node = min(ranks_per_node(), runtime.world_size)
    return prediction(config, runtime.world_size, per_node, vocab_size, bf16)


def _train(config: RootConfig, runtime: Runtime, run_dir: str, preemption: PreemptionWatch) -> None:
    wall_start = time.perf_counter()
    training = build_training(config, runtime, run_dir)
    config, model, t = training.config, training.model, training.config.train
    loggers = None
    if runtime.is_main:
        name, group = _wandb_identity(config.logging.wandb, run_dir)
        loggers = RunLoggers(config, run_dir, name, group, history=training.state.records, wandb_id=training.wandb_id)
    profiler = StepProfiler(config.profile, runtime, run_dir)
    watchdog = StepWatchdog.for_run(t.hang_timeout, runtime, run_dir)
    every, threshold = config.logging.log_every, config.logging.straggler_threshold
    stragglers = (
        StragglerWatch(runtime, every, threshold, stages_of_ranks(model.mesh.device_mesh, runtime.world_size))
        if runtime.world_size > 1 and threshold > 0
        else None
    )
    record = loggers.record if loggers else lambda record: None
    trainer = Trainer(training, record, preemption, profiler, watchdog, stragglers)
    try:
        state = trainer.run()
        training.checkpoints.finish()
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if isinstance(error, RunError) or not allocation_failed(error):
            raise
        profiler.write_memory("out of memory")
        raise out_of_memory(
            runtime.rank, f"in step {trainer.state.step + 1}", runtime.device, t.micro_batch_size, _plan(runtime)
        ) from None
    finally:
        if watchdog is not None:
            watchdog.close()
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
        summary = end_summary(
            state.records, time.perf_counter() - wall_start, state.train_seconds, t.batch_size * t.seq_len
        )
        summary.update(
            parameters=training.n_params,
            layout=model.plan.summary(),
            world_size=runtime.world_size,
            **layout_results,
        )
        if t.compile:  # evidence that compilation happened: graphs dynamo produced in this (rank 0's) process
            summary["compiled_graphs"] = compiled_graphs()
        if (profile := profiler.summary()) is not None:
            summary["profile"] = profile
        summary["predicted"] = _prediction(config, runtime, training.model_config.vocab_size)
        loggers.finish(summary, state.records)
        log.info("\n" + format_end_summary(summary))
