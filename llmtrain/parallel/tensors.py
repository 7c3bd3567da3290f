"""Tensors as layouts leave them: a DTensor's whole value or local part, gradients grouped by how they are laid out
(one foreach norm or clip per group), and the gradient norm and clip every layout shares."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]
Statistic = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> a micro-batch's number(s)


def params_by_layout(params: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters with gradients, grouped by how the gradients are laid out (plain, or DTensor mesh +
    placements): a norm or a scaling over one group is one foreach operation (and one reduction), and layouts mix
    in one model (tensor-parallel weights beside replicated LayerNorms)."""
    groups: dict[object, list[nn.Parameter]] = {}
    for param in params:
        grad = param.grad
        if grad is not None:
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            groups.setdefault(key, []).append(param)
    return list(groups.values())


def grads_by_layout(params: Iterable[nn.Parameter]) -> list[list[torch.Tensor]]:
    return [[param.grad for param in group if param.grad is not None] for group in params_by_layout(params)]


def squared_norm(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    return torch.stack([full_tensor(torch.nn.utils.get_total_norm(grads)) ** 2 for grads in groups]).sum()


def replicate_partial_gradients(params: Iterable[nn.Parameter]) -> None:
    """Sum, once, the gradients that tensor parallelism leaves as partial sums (replicated weights applied to
    sequence shards: LayerNorms, the position embedding). Left partial, every later read of them (the norm, the
    clip, each of AdamW's updates) would all-reduce them again."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements):
            placements = [Replicate() if placement.is_partial() else placement for placement in grad.placements]
            param.grad = grad.redistribute(grad.device_mesh, placements)


def clip_gradients(params: Iterable[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients by min(1, max_norm / (norm + 1e-6)), torch's clip_grad_norm_ formula, given the
    global norm; on the device, without a host sync. max_norm 0: leave them."""
    if max_norm > 0:
        for group in params_by_layout(params):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered (a loss computed on vocabulary shards is a replicated DTensor)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
