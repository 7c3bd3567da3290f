"""A training run's checkpoints: what goes into one (model, optimizer, LR schedule, step, the run that wrote it, the
data position, generator states) and how a run resumes from one, under its own layout or another. The history of
records is not copied into every checkpoint: a resumed run reads it from the writing run's metrics.jsonl."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import uuid
from typing import Any

import torch

from llmtrain.checkpoint.manager import (
    CheckpointManager,
    DamagedCheckpoint,
    IncompleteCheckpoint,
    complete_checkpoints,
    is_checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    read_data_position,
    read_meta,
    restore_rng_states,
    set_aside,
    set_aside_in,
    verify,
)
from llmtrain.checkpoint.state import checkpoint_state, load_checkpoint_state
from llmtrain.config import OptimConfig
from llmtrain.data import Data
from llmtrain.data.tokenizers import save_for_transformers
from llmtrain.errors import ConfigError
from llmtrain.model import GPTConfig
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.process.runtime import Runtime

log = logging.getLogger("llmtrain")


def resume_path(checkpoint_cfg, directory: str, runtime: Runtime) -> str | None:
    """Collective: the checkpoint this run starts from, verified against its checksums, each rank reading a share
    of its files. checkpoint.resume=auto -> the latest intact one in `directory` (None when there is none; a
    damaged one set aside, named, and the one before it taken), none -> None, a path -> that checkpoint (or the
    latest in that directory), which must be intact. Rank 0 alone looks for the checkpoints and moves damaged
    ones; a ConfigError is raised on every rank."""
    if checkpoint_cfg.resume == "none":
        return None
    auto = checkpoint_cfg.resume == "auto"
    for path in runtime.decided_by_main(lambda: _candidates(checkpoint_cfg.resume, directory)):
        shares = runtime.from_every_rank(_damage_in_share(path, runtime))
        damage = next((found for found in shares if found is not None), None)
        if damage is None:
            return path
        if not auto:
            raise ConfigError(
                f"checkpoint {path} is damaged: {damage}: resume from another step-* directory, or set "
                f"checkpoint.resume=auto to take the latest intact one"
            )
        runtime.decided_by_main(functools.partial(_set_aside_damaged, path, damage))
    if auto:
        runtime.decided_by_main(lambda: _refuse_if_any_set_aside(directory))
    return None


def _candidates(resume: str, directory: str) -> list[str]:
    """The checkpoints to try, the one to resume from first: checkpoint.resume=auto, every complete one in
    `directory`, newest first; a path, the one it names."""
    if resume == "auto":
        try:
            if is_checkpoint_name(directory):
                return [str(latest_checkpoint(directory))]
            return list(reversed(complete_checkpoints(directory)))
        except IncompleteCheckpoint as reason:  # checkpoint.dir itself named a step-* directory
            raise ConfigError(
                f"checkpoint.dir={directory} is an incomplete checkpoint ({reason}), not a directory "
                f"of them: point checkpoint.dir at the directory that holds the step-* ones"
            ) from None
    try:
        found = latest_checkpoint(os.path.abspath(os.path.expanduser(resume)))
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
    return [found]


def _damage_in_share(path: str, runtime: Runtime) -> str | None:
    try:
        verify(path, share=(runtime.rank, runtime.world_size))
    except DamagedCheckpoint as damage:
        return str(damage)
    return None


def _set_aside_damaged(path: str, damage: str) -> None:
    aside = set_aside(path)
    log.warning(f"checkpoint {path} is damaged ({damage}): set aside as {aside}; trying the one before it")


def _refuse_if_any_set_aside(directory: str) -> None:
    """No intact checkpoint is left: when some were set aside (now or by an earlier run), a ConfigError: the run
    does not start afresh over checkpoints it could not use without being told to."""
    damaged = set_aside_in(directory)
    if damaged:
        raise ConfigError(
            f"no intact checkpoint is left in {directory} ({len(damaged)} damaged, set aside as step-*.damaged): "
            f"start afresh with checkpoint.resume=none, or resume from a copy (checkpoint.resume=<its step-* "
            f"directory>)"
        )


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
    ours = json.loads(json.dumps(dataclasses.asdict(gpt_cfg)))  # as meta.json holds it (tuples as lists)
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


def check_base_matches(path: str, base: dict[str, Any] | None) -> None:
    """A one-line ConfigError when the checkpoint's low-rank adapters adapt another base than this run's (the same
    weights under another path, a hub name for a local copy, are the same base)."""
    saved = read_meta(path).get("base")
    if base is None or saved is None or saved == base:
        return
    if saved.get("fingerprint") and saved.get("fingerprint") == base.get("fingerprint"):
        return
    fix = (
        f"model.init_from={saved['init_from']}"
        if saved.get("init_from")
        else f"seed={saved.get('seed')} and no model.init_from"
    )
    raise ConfigError(
        f"checkpoint {path} holds low-rank adapters of another base ({_described(saved)}) than this run's "
        f"({_described(base)}): resume with {fix}, or set checkpoint.resume=none"
    )


def _described(base: dict[str, Any]) -> str:
    if base.get("init_from"):
        return f"{base['init_from']}, weights {base['fingerprint']}"
    return f"drawn from seed {base.get('seed')}"


def check_optimizer_matches(path: str, optim: OptimConfig) -> None:
    """A one-line ConfigError when the checkpoint's optimizer state is another optimizer's (its moments would not
    fit this one's), or another `optim.state_bits`'s (the moments are stored in fp32 either way, but the two
    optimizers' options differ)."""
    meta = read_meta(path)
    saved = meta.get("optimizer", "adamw")  # checkpoints before optim.name had a choice: AdamW's
    if saved != optim.name:
        raise ConfigError(
            f"checkpoint {path} holds optim={saved} state, this run has optim={optim.name}: resume with "
            f"optim={saved}, or set checkpoint.resume=none"
        )
    bits = meta.get("state_bits", 32)
    if bits != optim.state_bits:
        raise ConfigError(
            f"checkpoint {path} was written with optim.state_bits={bits}, this run has optim.state_bits="
            f"{optim.state_bits}: resume with optim.state_bits={bits}, or set checkpoint.resume=none"
        )


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """The run that writes the checkpoints, as its checkpoints record it: where its metrics.jsonl is (a resumed run
    takes its history from there) and its W&B run (a requeued or restarted run continues it)."""

    run_dir: str
    wandb_id: str | None


def logged_records(run_dir: str | None, step: int) -> list[dict[str, Any]]:
    """The records up to `step` that the run in `run_dir` logged to its metrics.jsonl: the history a run resuming
    from its step-`step` checkpoint continues. Empty, with a warning, when the file is gone (a checkpoint copied
    elsewhere): the resumed run's summary then covers the steps it trains."""
    path = os.path.join(run_dir or "", "metrics.jsonl")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        log.warning(f"{path} cannot be read: the resumed run's metrics start at step {step + 1}")
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line a crash cut short
            continue
        if isinstance(record, dict) and record.get("step", step + 1) <= step:
            records.append(record)
    return records


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
        model: ParallelModel,
        lr_schedule: torch.optim.lr_scheduler.LRScheduler,
        data: Data,
        gpt_cfg: GPTConfig,
        optim: OptimConfig,
        run: RunIdentity,
        base: dict[str, Any] | None = None,
    ):
        """`base`: what the model's low-rank adapters adapt (model.base_of), when it has some: its checkpoints then
        hold the adapters alone and name the base."""
        self.manager = manager
        self.base = base
        self.model, self.lr_schedule = model, lr_schedule
        self.data = data
        self.gpt_cfg = gpt_cfg
        self.optim = optim
        self.runtime = manager.runtime
        self.run = run

    def save(self, step: int, by_clock: bool = False) -> None:
        """Collective: checkpoint `step`; `by_clock`: saved for checkpoint.every_minutes alone (pruned once a newer
        one is complete)."""
        meta = {
            "step": step,
            "by_clock": by_clock,
            "model": dataclasses.asdict(self.gpt_cfg),
            "optimizer": self.optim.name,
            "state_bits": self.optim.state_bits,
            "layout": self.model.plan.describe(),
            "world_size": self.runtime.world_size,
            "schedule": self.lr_schedule.state_dict(),
            "run_dir": self.run.run_dir,
            "wandb_run_id": self.run.wandb_id,
            **({"base": self.base} if self.base is not None else {}),
        }
        self.manager.save(
            step,
            checkpoint_state(self.model, adapters_only=self.base is not None).values,
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
        state = checkpoint_state(self.model, adapters_only=self.base is not None)
        load_checkpoint(path, state.values, self.runtime.distributed)
        load_checkpoint_state(self.model, state)
        meta = read_meta(path)
        self.lr_schedule.load_state_dict(meta["schedule"])
        # Same world size: each rank continues its own dropout stream; otherwise ranks keep their fresh seeds.
        if meta["world_size"] == self.runtime.world_size:
            restore_rng_states(path, self.runtime.rank)
        records = meta["records"] if "records" in meta else logged_records(meta.get("run_dir"), meta["step"])
        return ResumePoint(step=meta["step"], records=records)


__all__ = [
    "RunCheckpoints",
    "check_base_matches",
    "check_model_matches",
    "check_optimizer_matches",
    "read_data_position",
    "resume_path",
    "wandb_run_id",
]
