"""What a parallel layout provides to the trainer. The trainer calls these methods and never asks which layout
it runs; each layout overrides only what it changes (wrapping, gradient sync, reductions, the step itself)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, ClassVar

import torch
from torch import nn

from llmtrain.model import cross_entropy_loss
from llmtrain.runtime import Runtime
from llmtrain.train.optim import build_adamw

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]
PrecisionContext = Callable[[], AbstractContextManager]


class Strategy:
    name: ClassVar[str]

    def __init__(self, cfg, runtime: Runtime):
        self.cfg = cfg
        self.runtime = runtime

    # -- layout ---------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError when the layout cannot run with this config and world size."""

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def dp_size(self) -> int:
        return 1

    def describe(self) -> str:
        """One line for the start-up summary: the layout and its mesh."""
        return self.name

    def parallelize(self, model: nn.Module) -> nn.Module:
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return build_adamw(model, self.cfg.optim)

    # -- one step -------------------------------------------------------------------------------------------
    def grad_sync(self, model: nn.Module, is_last_micro_batch: bool) -> AbstractContextManager:
        """Context for one micro-batch's forward + backward; layouts that reduce gradients skip all but the last."""
        return nullcontext()

    def forward_backward(self, model: nn.Module, micro_batches: MicroBatches,
                         precision: PrecisionContext) -> torch.Tensor:
        """Accumulate gradients of the mean loss over this rank's micro-batches; return that mean (detached)."""
        total = torch.zeros((), device=self.runtime.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            with self.grad_sync(model, is_last_micro_batch=i == len(micro_batches) - 1):
                with precision():
                    loss = cross_entropy_loss(model(inputs.to(self.runtime.device)),
                                              targets.to(self.runtime.device))
                (loss / len(micro_batches)).backward()
            total += loss.detach()
        return total / len(micro_batches)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, micro_batches: MicroBatches, precision: PrecisionContext) -> torch.Tensor:
        total = torch.zeros((), device=self.runtime.device)
        for inputs, targets in micro_batches:
            with precision():
                total += cross_entropy_loss(model(inputs.to(self.runtime.device)), targets.to(self.runtime.device))
        return total / len(micro_batches)

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a per-rank scalar over the data-parallel ranks (each holds an equal share of the batch)."""
        return value

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` (0: measure only) and return the global gradient norm before clipping."""
        params = [p for p in model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
