"""A training run's checkpoints: what goes into one (model, optimizer, LR schedule, step and loss records, the
data position, generator states) and how a run resumes from one, under its own layout or another."""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

import torch
from torch import nn

from llmtrain.checkpoint.manager import (
    CheckpointManager,
    IncompleteCheckpoint,
    latest_checkpoint,
    load_checkpoint,
    read_data_position,
    read_meta,
    restore_rng_states,
)
from llmtrain.data import Data
from llmtrain.data.tokenizers import save_for_transformers
from llmtrain.errors import ConfigError
from llmtrain.model import GPTConfig
from llmtrain.parallel import Strategy


def resume_path(checkpoint_cfg, directory: str, is_main: bool) -> str | None:
    """The checkpoint this run starts from: checkpoint.resume=auto -> the latest complete one in `directory`
    (None when there is none), none -> None, a path -> that checkpoint (or the latest in that directory)."""
    resume = checkpoint_cfg.resume
    if resume == "none":
        return None
    if resume == "auto":
        try:
            return latest_checkpoint(directory, warn=is_main)
        except IncompleteCheckpoint as reason:  # checkpoint.dir itself named a step-* directory
            raise ConfigError(
                f"checkpoint.dir={directory} is an incomplete checkpoint ({reason}), not a directory "
                f"of them: point checkpoint.dir at the directory that holds the step-* ones"
            ) from None
    try:
        found = latest_checkpoint(os.path.abspath(os.path.expanduser(resume)), warn=is_main)
    except IncompleteCheckpoint as reason:
        raise ConfigError(
            f"checkpoint.resume={resume} is not a complete checkpoint ({reason}): point it at "
            f"another step-* directory, or at the checkpoint directory to take its latest"
        ) from None
    if found is None:
        raise ConfigError(
            f"checkpoint.resume={resume} holds no complete checkpoint: point it at a step-* "
            f"directory or a checkpoint directory, or use checkpoint.resume=auto"
        )
    return found


def wandb_run_id(resume: str | None, checkpoint_dir: str) -> str:
    """The W&B run this run logs to: the one stored with the checkpoint it resumes from when that checkpoint is its
    own (a restart or requeue of the same run), else a new one (a run started from another run's weights)."""
    if resume and os.path.dirname(resume) == checkpoint_dir:
        stored = read_meta(resume).get("wandb_run_id")
        if stored:
            return stored
    return uuid.uuid4().hex[:12]


def check_model_matches(path: str, gpt_cfg: GPTConfig) -> None:
    """A one-line ConfigError listing the model settings in which this run differs from the checkpoint."""
    # A key the checkpoint predates had its default value then (GPT-2's choices for the family keys).
    defaults = {
        f.name: dataclasses.asdict(f.default) if dataclasses.is_dataclass(f.default) else f.default  # type: ignore[arg-type]
        for f in dataclasses.fields(gpt_cfg)
        if f.default is not dataclasses.MISSING
    }
    saved = {**defaults, **read_meta(path)["model"]}
    ours = dataclasses.asdict(gpt_cfg)
    differences = [
        f"model.{key}={ours.get(key)} (checkpoint: {saved.get(key)})"
        for key in sorted(set(saved) | set(ours))
        if saved.get(key) != ours.get(key)
    ]
    if differences:
        raise ConfigError(
            f"checkpoint {path} was trained with another model: {', '.join(differences)}: resume "
            f"with the checkpoint's model settings, or set checkpoint.resume=none"
        )


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a restored run continues: after `step`, with the records logged up to it."""

    step: int
    records: list[dict[str, Any]]


class RunCheckpoints:
    """Every rank calls `save`; `restore` loads a checkpoint into the freshly built run (collective)."""

    def __init__(
        self,
        manager: CheckpointManager,
        strategy: Strategy,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        data: Data,
        gpt_cfg: GPTConfig,
        wandb_run_id: str | None,
    ):
        self.manager = manager
        self.strategy = strategy
        self.model, self.optimizer, self.schedule = model, optimizer, schedule
        self.data = data
        self.gpt_cfg = gpt_cfg
        self.runtime = manager.runtime
        self.wandb_run_id = wandb_run_id  # a requeued or restarted run continues the same W&B run

    def save(self, step: int, records: list[dict[str, Any]]) -> None:
        meta = {
            "step": step,
            "model": dataclasses.asdict(self.gpt_cfg),
            "layout": self.strategy.describe(),
            "world_size": self.runtime.world_size,
            "schedule": self.schedule.state_dict(),
            "records": records,
            "wandb_run_id": self.wandb_run_id,
        }
        self.manager.save(
            step,
            self.strategy.checkpoint_state(self.model, self.optimizer),
            meta,
            self.data.train.state_dict(),
            self._write_tokenizer,
        )

    def _write_tokenizer(self, directory: str) -> None:
        save_for_transformers(self.data.tokenizer, os.path.join(directory, "tokenizer"))

    def poll(self) -> None:
        """Collective, every step: complete a finished async save."""
        self.manager.poll()

    def finish(self) -> None:
        """Wait until an async save in flight is complete (collective)."""
        self.manager.wait()

    def restore(self, path: str) -> ResumePoint:
        state = self.strategy.checkpoint_state(self.model, self.optimizer)
        load_checkpoint(path, state, self.runtime.distributed)
        self.strategy.load_checkpoint_state(self.model, self.optimizer, state)
        meta = read_meta(path)
        self.schedule.load_state_dict(meta["schedule"])
        # Same world size: each rank continues its own dropout stream; otherwise ranks keep their fresh seeds.
        if meta["world_size"] == self.runtime.world_size:
            restore_rng_states(path, self.runtime.rank)
        return ResumePoint(step=meta["step"], records=meta["records"])


__all__ = ["RunCheckpoints", "check_model_matches", "read_data_position", "resume_path", "wandb_run_id"]
