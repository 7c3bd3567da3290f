"""The training loop: for each optimizer step, the strategy's forward/backward over this rank's micro-batches,
the global-batch loss, clipping, the optimizer and schedule steps, then metrics, and validation on schedule."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from llmtrain.data import Data, RankSlice
from llmtrain.parallel import Strategy
from llmtrain.runtime import Runtime
from llmtrain.train.metrics import mfu, peak_flops, peak_memory_gib
from llmtrain.train.precision import precision_context


@dataclass
class LoopState:
    step: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float = 0.0


class Trainer:
    def __init__(self, cfg, runtime: Runtime, strategy: Strategy, model: nn.Module,
                 optimizer: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LRScheduler, data: Data,
                 train_slice: RankSlice, val_slice: RankSlice, flops_per_token: float,
                 on_record: Callable[[dict[str, Any]], None]):
        self.cfg = cfg
        self.runtime = runtime
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.schedule = schedule
        self.data = data
        self.on_record = on_record
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(runtime.device)
        self.precision = precision_context(cfg.train.precision, runtime.device)
        self.train_slice = train_slice
        self.val_slice = val_slice
        self.state = LoopState()

    def _is_eval_step(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return every > 0 and (step % every == 0 or step == self.cfg.train.steps)

    def validation_loss(self) -> float:
        self.model.eval()
        loss = self.strategy.evaluate(self.model, self.val_slice.micro_batches(self.data.val_windows),
                                      self.precision)
        self.model.train()
        return self.strategy.reduce_mean(loss).item()

    def train_step(self) -> dict[str, Any]:
        started = time.perf_counter()
        micro_batches = self.train_slice.micro_batches(self.data.train.next())
        loss = self.strategy.forward_backward(self.model, micro_batches, self.precision)
        loss = self.strategy.reduce_mean(loss)
        grad_norm = self.strategy.clip_grad_norm(self.model, self.cfg.optim.grad_clip)
        lr = self.schedule.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        record = {"step": self.state.step + 1, "loss": loss.item(), "lr": lr, "grad_norm": float(grad_norm)}
        seconds = time.perf_counter() - started
        tokens = self.cfg.train.batch_size * self.cfg.train.seq_len
        record["tokens_per_s"] = tokens / seconds
        record["mfu"] = mfu(tokens / seconds / self.runtime.world_size, self.flops_per_token, self.peak)
        self.state.train_seconds += seconds
        return record

    def run(self) -> LoopState:
        self.model.train()
        while self.state.step < self.cfg.train.steps:
            record = self.train_step()
            self.state.step = record["step"]
            if self._is_eval_step(self.state.step):
                record["val_loss"] = self.validation_loss()
            memory = peak_memory_gib(self.runtime.device)
            if memory is not None:
                record["peak_memory_gib"] = memory
            self.state.records.append(record)
            self.on_record(record)
        return self.state
