"""1F1B written out from isend / irecv: `parallel.pp_schedule=1f1b_reference`, the readable version of what
torch's Schedule1F1B does, tested against it step for step.

With p stages and m micro-batches, stage s runs:
  warm-up    min(p - s - 1, m) forwards: fill the pipe so that the last stage can start backward at once;
  steady     m - warm-up rounds of one forward then one backward: each finished backward frees one micro-batch's
             activations, so at most p - s micro-batches are alive on stage s (GPipe keeps all m);
  cool-down  the remaining backwards, draining the pipe.
A forward receives its input activation from stage s - 1 and sends its output to s + 1; a backward receives the
output's gradient from s + 1 and sends the input's gradient to s - 1. Receives block (the work needs the data);
sends are asynchronous and their handles are kept until the end of the step: a blocking send to a neighbour that
is itself blocked sending to us would deadlock, and a send's buffer must outlive the send.

Gradients are accumulated over the micro-batches' unscaled losses and divided by m at the end, as torch's
schedules do (scale_grads), so both give the gradient of the mean loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from llmtrain.parallel.pipeline.p2p import recv_activation, recv_gradient, send_activation, send_gradient
from llmtrain.parallel.pipeline.timeline import Timeline


class Reference1F1B:
    def __init__(
        self,
        module: nn.Module,
        stage: int,
        n_stages: int,
        group: dist.ProcessGroup,
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        timeline: Timeline,
    ):
        self.module = module
        self.stage, self.n_stages, self.group = stage, n_stages, group
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        # Global ranks of the neighbouring stages (-1: none, at the ends).
        self.prev = -1 if self.is_first else dist.get_global_rank(group, stage - 1)
        self.next = -1 if self.is_last else dist.get_global_rank(group, stage + 1)
        self.m = n_microbatches
        self.loss_fn = loss_fn
        self.device = device
        self.timeline = timeline

    def step(self, inputs: torch.Tensor | None = None, *, target: torch.Tensor, losses: list[torch.Tensor]) -> None:
        """One optimizer step's forward and backward over the m micro-batches of `inputs` (first stage) and
        `target` (last stage); the last stage appends each micro-batch's loss to `losses`."""
        self.inputs = inputs.tensor_split(self.m) if inputs is not None else ()
        self.targets = target.tensor_split(self.m) if self.is_last else ()
        # micro-batch -> (the input activation received, None on the first stage; the output or loss)
        self.saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.pending: list[dist.Work] = []
        warmup = min(self.n_stages - self.stage - 1, self.m)
        for i in range(warmup):
            self._forward(i, losses)
        for i in range(self.m - warmup):
            self._forward(warmup + i, losses)
            self._backward(i)
        for i in range(self.m - warmup, self.m):
            self._backward(i)
        for work in self.pending:
            work.wait()
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.div_(self.m)

    def _forward(self, i: int, losses: list[torch.Tensor]) -> None:
        # The receive stays outside the recorded box: waiting for a neighbour is bubble, not work.
        received = None if self.is_first else recv_activation(self.prev, self.group, self.device).requires_grad_()
        with self.timeline.record("F", self.stage, i):
            output = self.module(self.inputs[i] if self.is_first else received)
            if self.is_last:
                output = self.loss_fn(output, self.targets[i])
                losses.append(output.detach())
            else:
                self.pending += send_activation(output.detach(), self.next, self.group)
        self.saved[i] = (received, output)
        self.timeline.activations_saved(self.stage, i)

    def _backward(self, i: int) -> None:
        received, output = self.saved.pop(i)
        grad = None if self.is_last else recv_gradient(output, self.next, self.group)
        with self.timeline.record("B", self.stage, i):
            if isinstance(self.module, FSDPModule):
                # Reduce-scatter the gradients once, on the last micro-batch; accumulate unsharded before that.
                self.module.set_requires_gradient_sync(i == self.m - 1)
            torch.autograd.backward(output, grad)
            if received is not None:  # not on the first stage
                assert received.grad is not None, "the stage's input requires grad"
                self.pending += send_gradient(received.grad, self.prev, self.group)
        self.timeline.activations_freed(self.stage, i)
