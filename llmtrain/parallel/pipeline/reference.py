"""1F1B written out from isend / irecv: `parallel.pp_schedule=1f1b_reference`, the readable version of what
torch's Schedule1F1B does, tested against it step for step.

With p stages and m micro-batches, stage s runs:
  warm-up    min(p - s - 1, m) forwards: fill the pipe so that the last stage can start backward at once;
  steady     m - warm-up rounds of one forward then one backward: each finished backward frees one micro-batch's
             activations, so at most p - s micro-batches are alive on stage s (GPipe keeps all m);
  cool-down  the remaining backwards, draining the pipe.
A forward receives its input activation from stage s - 1 and sends its output to s + 1; a backward receives the
output's gradient from s + 1 and sends the input's gradient to s - 1. In the steady phase each send is posted
together with the next receive, as one `batch_isend_irecv` group (p2p.py), exactly where the neighbour posts the
matching pair: "send activation j, receive gradient i" here meets "send gradient i, receive activation j" on
stage s + 1. A schedule that posts them one at a time passes on gloo, which buffers sends, and can hang on NCCL.

Gradients are accumulated over the micro-batches' unscaled losses and divided by m at the end, as torch's
schedules do (scale_grads), so both give the gradient of the mean loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from llmtrain.parallel.pipeline.p2p import exchange, recv_header, send_header
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

    def step(
        self,
        inputs: torch.Tensor | None = None,
        *,
        target: torch.Tensor,
        losses: list[torch.Tensor],
        documents: torch.Tensor | None = None,
    ) -> None:
        """One optimizer step's forward and backward over the m micro-batches of `inputs` (first stage) and
        `target` (last stage); the last stage appends each micro-batch's loss to `losses`. `documents`: where each
        position's packed document starts (every stage; model/documents.py), or None."""
        self.inputs = inputs.tensor_split(self.m) if inputs is not None else ()
        self.documents = documents.tensor_split(self.m) if documents is not None else None
        self.targets = target.tensor_split(self.m) if self.is_last else ()
        # micro-batch -> (the input activation received, None on the first stage; the output or loss)
        self.saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.received: dict[int, torch.Tensor] = {}  # activations received ahead of their forward
        self.activation: tuple[list[int], torch.dtype] | None = None  # shape and dtype of this step's inputs
        warmup = min(self.n_stages - self.stage - 1, self.m)
        for i in range(warmup):
            exchange(self._recv_activation(i))
            exchange(self._forward(i, losses))
        backward_sends: list[dist.P2POp] = []
        for i in range(self.m - warmup):
            j = warmup + i
            exchange(backward_sends + self._recv_activation(j))  # the previous backward's send, this input
            forward_sends = self._forward(j, losses)
            gradient, receive_gradient = self._recv_gradient(i)
            exchange(forward_sends + receive_gradient)  # this output out, the oldest micro-batch's gradient in
            backward_sends = self._backward(i, gradient)
        for i in range(self.m - warmup, self.m):
            exchange(backward_sends)
            gradient, receive_gradient = self._recv_gradient(i)
            exchange(receive_gradient)
            backward_sends = self._backward(i, gradient)
        exchange(backward_sends)
        if isinstance(self.module, FSDPModule):
            reduce_fsdp_gradients(self.module)
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.div_(self.m)

    # Each method below returns the P2POps it needs posted; `step` decides what is posted together.
    def _recv_activation(self, i: int) -> list[dist.P2POp]:
        if self.is_first:
            return []
        if self.activation is None:  # the first micro-batch of the step: its header says what all of them are
            self.activation = recv_header(self.prev, self.group, self.device)
        shape, dtype = self.activation
        self.received[i] = torch.empty(shape, dtype=dtype, device=self.device)
        return [dist.P2POp(dist.irecv, self.received[i], self.prev, self.group)]

    def _forward(self, i: int, losses: list[torch.Tensor]) -> list[dist.P2POp]:
        received = self.received.pop(i).requires_grad_() if not self.is_first else None
        with self.timeline.record("F", self.stage, i):
            documents = {} if self.documents is None else {"documents": self.documents[i]}
            output = self.module(self.inputs[i] if received is None else received, **documents)
            if self.is_last:
                output = self.loss_fn(output, self.targets[i])
                losses.append(output.detach())
        self.saved[i] = (received, output)
        self.timeline.activations_saved(self.stage, i)
        if self.is_last:
            return []
        if i == 0:
            send_header(output, self.next, self.group)
        return [dist.P2POp(dist.isend, output.detach(), self.next, self.group)]

    def _recv_gradient(self, i: int) -> tuple[torch.Tensor | None, list[dist.P2POp]]:
        if self.is_last:
            return None, []
        gradient = torch.empty_like(self.saved[i][1])
        return gradient, [dist.P2POp(dist.irecv, gradient, self.next, self.group)]

    def _backward(self, i: int, gradient: torch.Tensor | None) -> list[dist.P2POp]:
        received, output = self.saved.pop(i)
        with self.timeline.record("B", self.stage, i):
            if isinstance(self.module, FSDPModule):
                # As torch's PipelineStage: every micro-batch's backward keeps the parameters gathered (not
                # all-gathered again for the next) and accumulates unsharded gradients; reduce_fsdp_gradients
                # reshards and reduce-scatters them once, after the last.
                self.module.set_is_last_backward(False)
                self.module.set_reshard_after_backward(False)
                self.module.set_requires_gradient_sync(False)
            torch.autograd.backward(output, gradient)
        self.timeline.activations_freed(self.stage, i)
        if received is None:  # the first stage sends no gradient
            return []
        assert received.grad is not None, "the stage's input requires grad"
        return [dist.P2POp(dist.isend, received.grad, self.prev, self.group)]


def reduce_fsdp_gradients(module: FSDPModule) -> None:
    """After a step's last backward: every FSDP unit of `module` reduce-scatters its accumulated gradients and
    reshards, once (torch's PipelineStage.perform_reduce_grad, through the same private state). Setting the flags
    back on before the last micro-batch's backward instead regathers the [norm, head] unit in that backward:
    FSDP's backward prefetch follows the forward order of all the step's micro-batches and fetches the head of
    the one before (the layout accounting test counts the all-gathers)."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)  # type: ignore[attr-defined]
    for unit in state._state_ctx.all_states:
        for group in unit._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
