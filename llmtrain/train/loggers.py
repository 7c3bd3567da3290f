"""Where metrics go: the run directory's metrics.jsonl, Weights & Biases, and the console. Rank 0 only."""

from __future__ import annotations

import dataclasses
import json
import logging
import netrc
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

from tqdm import tqdm

from llmtrain.config import RootConfig
from llmtrain.files import write_json_atomic
from llmtrain.train.report import plot_loss

log = logging.getLogger("llmtrain")


class MetricsFile:
    """One JSON object per optimizer step, flushed as it is written so a crash keeps every finished step."""

    def __init__(self, path: str):
        self._file = open(path, "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def wandb_credentials_present() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1]
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(mode: str) -> Literal["online", "offline", "disabled"]:
    """`auto` becomes online when an API key is configured (env or ~/.netrc from `wandb login`), else offline."""
    if mode == "auto":
        return "online" if wandb_credentials_present() else "offline"
    return cast(Literal["online", "offline", "disabled"], mode)  # one of these: config.validate checked it


class WandbLogger:
    """A W&B run whose files live in the run directory. Only the resolved config is sent: the API key is read
    by wandb from its own environment and never passes through here. `run_id` is kept in the checkpoints, so a
    restarted or requeued run resumes the same W&B run ("allow": created if it does not exist yet)."""

    def __init__(
        self, wandb_cfg, run_dir: str, name: str, group: str | None, config: dict[str, Any], run_id: str | None
    ):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self._run = wandb.init(
            project=wandb_cfg.project,
            entity=wandb_cfg.entity,
            name=name,
            group=group,
            dir=run_dir,
            config=config,
            mode=resolve_wandb_mode(wandb_cfg.mode),
            id=run_id,
            resume="allow",
            settings=wandb.Settings(console="off"),
        )

    def log(self, record: dict[str, Any]) -> None:
        """A list (the load of each expert) becomes one chart per entry: expert_load/0, expert_load/1, ..."""
        values: dict[str, Any] = {}
        for key, value in record.items():
            if isinstance(value, list):
                values.update({f"{key}/{i}": item for i, item in enumerate(value)})
            elif key != "step":
                values[key] = value
        self._run.log(values, step=record["step"])

    def summary(self, values: dict[str, Any]) -> None:
        self._run.summary.update(values)

    def upload(self, directory: str, name: str, kind: str) -> None:
        """The files of `directory` as one artifact of the run."""
        import wandb

        artifact = wandb.Artifact(name, type=kind)
        artifact.add_dir(directory)
        self._run.log_artifact(artifact)

    def close(self) -> None:
        self._run.finish()


def _format(record: dict[str, Any], objective: ObjectiveLine) -> str:
    parts = [f"step {record['step']}", f"loss {record['loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val {record['val_loss']:.4f}")
    parts += objective(record)
    parts += [f"lr {record['lr']:.2e}", f"gnorm {record['grad_norm']:.3f}", f"{record['tokens_per_s']:,.0f} tok/s"]
    if record.get("mfu") is not None:
        parts.append(f"mfu {record['mfu']:.1%}")
    if "peak_memory_gib" in record:
        parts.append(f"mem {record['peak_memory_gib']:.1f}/{record['peak_reserved_gib']:.1f} GiB")
    return " | ".join(parts)


# What a step's console line shows of the objective's record entries (train/objectives.py: Objective.console).
ObjectiveLine = Callable[[dict[str, Any]], list[str]]


def _nothing(record: dict[str, Any]) -> list[str]:
    return []


class Console:
    """A progress bar when attached to a terminal (or asked for), plain log lines every `log_every` otherwise; each
    line with the objective's part (`objective`)."""

    def __init__(
        self, total_steps: int, log_every: int, progress: str, done_steps: int = 0, objective: ObjectiveLine = _nothing
    ):
        use_bar = progress == "bar" or (progress == "auto" and sys.stderr.isatty())
        self._bar = tqdm(total=total_steps, initial=done_steps, unit="step", dynamic_ncols=True) if use_bar else None
        self._log_every, self._total, self._objective = log_every, total_steps, objective

    def step(self, record: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(_format(record, self._objective).split(" | ", 1)[1], refresh=False)
            if "val_loss" in record:
                self._bar.write(_format(record, self._objective))
        elif record["step"] % self._log_every == 0 or record["step"] == self._total or "val_loss" in record:
            log.info(_format(record, self._objective))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class RunLoggers:
    """Rank 0's sinks for one run: metrics.jsonl, W&B (unless disabled), the console; at the end summary.json
    and loss.png. summary.json is written last, so its presence marks a completed run. A resumed run passes the
    checkpoint's records as `history`: metrics.jsonl starts with them (and nothing the crashed run logged after
    its checkpoint), the progress bar counts them as done."""

    def __init__(
        self,
        config: RootConfig,
        run_dir: str,
        name: str,
        group: str | None,
        history: Sequence[dict[str, Any]] = (),
        wandb_id: str | None = None,
        objective: ObjectiveLine = _nothing,
    ):
        self.run_dir = run_dir
        self.title = name
        self.metrics = MetricsFile(os.path.join(run_dir, "metrics.jsonl"))
        for record in history:
            self.metrics.write(record)
        self.wandb = None
        if config.logging.wandb.mode != "disabled":
            self.wandb = WandbLogger(config.logging.wandb, run_dir, name, group, dataclasses.asdict(config), wandb_id)
        logging_cfg = config.logging
        self.console = Console(config.train.steps, logging_cfg.log_every, logging_cfg.progress, len(history), objective)

    def record(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        if self.wandb:
            self.wandb.log(record)
        self.console.step(record)

    def close_console(self) -> None:
        self.console.close()
        self.metrics.close()

    def finish(self, summary: dict[str, Any], records: list[dict[str, Any]]) -> None:
        plot_loss(records, os.path.join(self.run_dir, "loss.png"), self.title)
        if self.wandb:
            self.wandb.summary(summary)
            if "profile" in summary:  # every rank's trace written so far
                self.wandb.upload(os.path.join(self.run_dir, "profile"), "profile", "profile")
            self.wandb.close()
        write_json_atomic(os.path.join(self.run_dir, "summary.json"), summary)
