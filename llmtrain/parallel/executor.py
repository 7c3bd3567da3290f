"""How a step's micro-batches run through this rank's model: one protocol, two executors. Accumulation
(accumulation.py) runs the whole model (as the layout splits it) on each micro-batch in turn and adds up the
gradients; a pipeline (pipelined.py) runs this rank's stages of the model cut by depth under a schedule,
together with the other stages' ranks. A ParallelModel holds one, whole when made, and never asks which."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from llmtrain.parallel.tensors import MicroBatches, Statistic

# The micro-batches' statistics (in order; none on a rank that computes no output) -> the value wanted of them.
Combine = Callable[[list[torch.Tensor]], torch.Tensor]


class Executor(Protocol):
    """What differs between executing the model whole and executing it as a pipeline."""

    @property
    def module(self) -> nn.Module:
        """What the optimizer updates and checkpoints hold: the model (or its DDP wrapper), or this rank's stages."""
        ...

    @property
    def pp_rank(self) -> int:
        """This rank's place along the pipeline: 0 where the model is not cut into stages."""
        ...

    def forward_backward(self, micro_batches: MicroBatches) -> torch.Tensor:
        """Accumulate the gradients of the loss over this rank's micro-batches (their targets already scored, the
        layout's losses scaled by StepSetup.loss_scale); return the mean micro-batch loss, detached (under a
        pipeline computed on the last stage and shared with every stage's rank)."""
        ...

    def forward_only(self, micro_batches: MicroBatches, statistic: Statistic, combine: Combine) -> torch.Tensor:
        """`combine` of `statistic(logits, targets)` of each micro-batch (this rank's part of each sequence), on every
        rank; `combine` is also called with [] where a rank computes no logits (a pipeline's early stages), and
        must then give a value of the same shape: the pipeline shares the last stage's."""
        ...

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm, over every rank's shards and stages."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's weights as full CPU tensors under the unsplit model's names, on rank 0
        (None on the other ranks)."""
        ...

    def report(self, run_dir: str) -> dict:
        """Collective, after training: what the executor measured, for the end summary (rank 0 may also write files
        into run_dir); {} where it measured nothing and on the ranks other than 0."""
        ...
