"""Everything before a job's first step, the one builder behind training, the tools and the tests: config checks ->
tokenizer -> plan and mesh -> data -> the model laid out with its optimizer and checkpoints -> what a step optimizes
-> the start summary. What the run's device and parallel=auto decide is the planner's (planner/resolve.py)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

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
from llmtrain.config import RootConfig
from llmtrain.data import Data, DataReading, RankSlice, build_data, build_tokenizer, streaming_scale_warning
from llmtrain.data.tasks import read_task
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.errors import ConfigError
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
from llmtrain.model.scoring import NO_MARKS, TokenMarks
from llmtrain.optim import build_lr_schedule
from llmtrain.parallel.mesh import RankMesh
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.parallel_plan import ParallelPlan
from llmtrain.planner.resolve import resolved_for_device
from llmtrain.process.runtime import Runtime
from llmtrain.run.retry import micro_batch_after_running_out
from llmtrain.train.expert_load import ExpertLoad
from llmtrain.train.loop import Components, ModelFacts
from llmtrain.train.memory import MIB, HeldBytes, MemoryPeak, held_bytes
from llmtrain.train.objectives import build_objective
from llmtrain.train.report import start_summary
from llmtrain.train.state import LoopState

log = logging.getLogger("llmtrain")


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
    config = micro_batch_after_running_out(config, run_dir)
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
    reading = DataReading(
        train=place.train_slice,
        validation=place.val_slice if config.train.eval_every > 0 else None,
        position=read_data_position(resume.path) if resume.path else None,
    )
    return build_data(config, tokenizer, reading)


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
        facts=ModelFacts(
            shape=gpt_cfg,
            parameters=n_params,
            trained=trainable if gpt_cfg.lora.enabled else n_params,
            flops_per_token=flops_per_token(gpt_cfg, n_params, t.seq_len, trainable),
        ),
        lr_schedule=lr_schedule,
        data=data,
        train_slice=place.train_slice,
        objective=build_objective(config, model, data, place.train_slice, place.val_slice),
        checkpoints=checkpoints,
        state=LoopState(step=point.step, records=list(point.records)) if point else LoopState(),
        wandb_id=wandb_id,
        run_dir=os.path.abspath(run_dir),
        tasks=[read_task(path, data.tokenizer, t.seq_len, config.eval.limit) for path in config.eval.tasks or []],
        observers=[ExpertLoad(model)] if gpt_cfg.moe.num_experts else [],
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
            marks=data.marks,
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
    marks: TokenMarks = NO_MARKS,
) -> ParallelModel:
    """The model of `config` laid out on this rank with its optimizer, as training builds it (for tools and tests
    that run steps of their own; a dry run allocates it with a `materializer` of its own). `marks`: what a step
    needs of the data's tokens (a separator with train.attention=document)."""
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
        marks,
    )


def _laid_out(
    config: RootConfig,
    plan: ParallelPlan,
    mesh: RankMesh,
    runtime: Runtime,
    meta: GPT,
    materializer: Materializer = materialize,
    marks: TokenMarks = NO_MARKS,
) -> ParallelModel:
    """The layout applied to the meta-device `meta`; then each rank allocates and initialises only its part
    (`marks`: what a step needs of the data's tokens)."""
    init = initial_weights(config.model, meta, config.seed)
    return ParallelModel(plan, mesh, runtime, meta, init, config.optim, materializer, marks)
