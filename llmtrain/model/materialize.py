"""Allocate a model that was built (and laid out) on the meta device, and give every parameter its initial value,
each rank writing only the part it keeps.

`init(name, full)` fills the whole, unsplit CPU tensor of one parameter (from the seed, or read from a file); the
rank keeps its shard of it (a DTensor's local part, under any placement: FSDP, TP, both) and drops the rest before
the next parameter is drawn. A rank's memory therefore peaks at its own shards plus one whole tensor, whatever the
model's size, and every layout starts from the same weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from llmtrain.model.moe import Experts
from llmtrain.model.quantize import empty_nf4, is_nf4, quantized_piece

ParameterInit = Callable[[str, torch.Tensor], None]
# How a laid-out meta model gets its memory and values: `materialize`, or a dry run's fake allocation.
Materializer = Callable[[nn.Module, torch.device, ParameterInit], None]


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names that share one parameter (a tied head): steps that replace parameters module by module
    (`to_empty`, `parallelize_module`) untie them, and `retie` ties them again."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    for first, *others in groups:
        for name in others:
            setattr(*_owner(model, name), model.get_parameter(first))


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding the parameter `name` and the attribute it has there."""
    module_name, _, attribute = name.rpartition(".")
    return model.get_submodule(module_name), attribute


@torch.no_grad()
def write_parameters(model: nn.Module, init: ParameterInit) -> None:
    """Set every parameter of `model` (plain tensors or DTensor shards, on any device) from `init`, one whole
    tensor at a time."""
    for name, param in model.named_parameters():
        # drawn (or read) in fp32 at least: a weight held in bf16 gets the rounding of the fp32 value it would be
        owner, attribute = _owner(model, name)
        # NF4 holds a stack of experts as their rows one after another: initialised as the stack
        stacked = owner.stack_shape(attribute) if is_nf4(param) and isinstance(owner, Experts) else None
        shape = stacked or param.shape
        full = torch.empty(shape, dtype=torch.promote_types(param.dtype, torch.float32))
        init(name, full)
        if is_nf4(param):
            _set_quantized(model, name, param, full.flatten(0, 1) if stacked else full)
        elif isinstance(param, DTensor):
            # Every rank drew the same whole tensor; each keeps its block without communicating. The block comes
            # from the offsets DCP itself uses, as views of the whole tensor: no copy of it under any placement
            # (FSDP over TP included), where distribute_tensor would make one.
            local, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            for dim, (size, start) in enumerate(zip(local, offset)):
                full = full.narrow(dim, start, size)
            param.to_local().copy_(full)
        else:
            param.copy_(full)
        del full


def _set_quantized(model: nn.Module, name: str, param: torch.Tensor, full: torch.Tensor | None) -> None:
    """Parameter `name` becomes this rank's rows of `full`'s NF4 quantisation, or without `full` an NF4 tensor of
    their shape and undefined values (allocation). A new parameter each time: an NF4 tensor moved off the meta
    device keeps meta parts, and FSDP takes the new one up at its first step."""
    rows, first = param.shape[0], 0
    if isinstance(param, DTensor):
        rows = param.to_local().shape[0]
        if full is not None:  # where its rows start (a dry run's fake allocation never asks: its mesh has no values)
            first = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)[1][0]
    if full is None:
        value = empty_nf4(rows, param.shape[1], param.device)
    else:
        value = quantized_piece(full, rows, first, param.device)
    if isinstance(param, DTensor):
        value = DTensor.from_local(
            value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
        )
    setattr(*_owner(model, name), nn.Parameter(value, requires_grad=False))


def allocate(model: nn.Module, device: torch.device) -> None:
    """Give `model`'s parameters (only this rank's shards, for a sharded layout) uninitialised memory on `device`,
    keeping tied parameters tied. The second name of a tied pair is taken off before the move and set again after
    it: the move of a tensor subclass (a dry run's fake tensors) swaps each parameter in place, which a parameter
    held under two names refuses."""
    tied = tied_groups(model)
    for _, *others in tied:
        for name in others:
            module, attribute = _owner(model, name)
            module._parameters[attribute] = None
    model.to_empty(device=device)
    retie(model, tied)
    for name, param in list(model.named_parameters()):
        if is_nf4(param):
            _set_quantized(model, name, param, None)


def materialize(model: nn.Module, device: torch.device, init: ParameterInit) -> None:
    """Allocate `model` on `device`, then initialise it from `init`."""
    allocate(model, device)
    write_parameters(model, init)
