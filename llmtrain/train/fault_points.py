"""The training loop's fault points (llmtrain/faults.py) as one of its observers: where a test's run hangs, is
killed, runs slow, runs out of memory, takes a non-finite step or spikes. Unarmed, each costs a dictionary lookup."""

from __future__ import annotations

import time

import torch
from torch import nn

from llmtrain import faults
from llmtrain.train.observers import StepObserver


class FaultPoints(StepObserver):
    """The points armed in this process (LLMTRAIN_FAULTS), fired on `rank`; `module` holds the gradients a
    non-finite step or a spike spoils."""

    def __init__(self, rank: int, module: nn.Module):
        self._rank = rank
        self._module = module
        self._started = time.perf_counter()  # the current step's start: step_seconds counts from it

    def step_begins(self, step: int) -> None:
        self._started = time.perf_counter()
        faults.step_begins(step, self._rank)

    def phase_begins(self, step: int, phase: str) -> None:
        faults.phase_begins(step, phase, self._rank)

    def gradients_computed(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return faults.gradients_computed(step, loss, self._module.parameters())

    def step_ends(self, step: int, seconds: float) -> None:
        faults.step_ends(self._started)
