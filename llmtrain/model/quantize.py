"""QLoRA's frozen base (Dettmers et al., 2023): the blocks' linear weights held in 4-bit NormalFloat (NF4) beside
low-rank adapters that train in the compute dtype (model.quantize_base=nf4).

NF4 is torchao's NF4Tensor: each block of 64 weights is scaled by its absolute maximum and every weight stored as
the nearest of 16 levels placed at the quantiles of a standard normal (two to a byte); the block scales are
quantised again ("double quantisation": less their mean, int8 in groups of 256, each group with its own factor).
A weight costs 0.5 + 1/64 + (one factor)/16,384 bytes, 0.516 in bf16, against 2 in bf16. A matmul dequantises the
weight to the input's dtype and multiplies; its backward reaches the input alone (the base has no gradient).

The weights are quantised from their bf16 rounding, whatever the run's precision, so every layout holds the same
codes. FSDP shards a quantised weight by rows and gathers its codes and scales, never its bf16 values; a rank keeps
its rows of the whole tensor's quantisation (not a quantisation of its rows, whose scale mean would differ from
rank to rank and from one process's). Its shard must therefore hold whole groups of 16,384 weights, which every
released model's widths give: a weight that does not divide so stays in the compute dtype.

A mixture's routed experts (E x in x out, stacked) are one NF4 tensor of their rows one after another (E x in,
out): every expert whole groups, quantised with the same scales as the matrices alone but the double quantisation's
mean, which is the stack's. FSDP and expert parallelism split it by rows, so by whole experts; a block dequantises
its experts while it computes and again in backward, never holding them between (moe.py).

The model is built on the meta device with its NF4 weights (their structure only); `quantized_piece` gives a rank
the values when the model is materialised (model/materialize.py).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any, cast

import torch
from torch import nn

from llmtrain.optional import import_torchao

# Where torchao keeps NF4: since 0.18, and before (0.17, the GPU images' torchao for torch 2.11).
NF4_MODULES = ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor")
BLOCK = 64  # weights sharing one scale
SCALER_BLOCK = 256  # scales sharing one int8 quantisation factor
GROUP = BLOCK * SCALER_BLOCK  # the weights whose codes, scales and factor split together
QUANTISED_FROM = torch.bfloat16


@functools.cache
def _nf4() -> ModuleType:
    """torchao's NF4 module, wherever this torchao keeps it."""
    for name in NF4_MODULES:
        try:
            return import_torchao(name)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"torchao keeps no NF4 tensor where llmtrain looks ({', '.join(NF4_MODULES)})")


def nf4_bytes_per_weight(factor_bytes: int = 2) -> float:
    """Device bytes of one NF4 weight: its 4-bit code, its share of the int8 block scale and of the group's factor
    (held in QUANTISED_FROM)."""
    return 0.5 + 1 / BLOCK + factor_bytes / GROUP


def quantizable(weight: torch.Tensor) -> bool:
    """Whether NF4 can hold `weight`: a matrix of whole groups."""
    return weight.ndim == 2 and weight.numel() % GROUP == 0


def base_linears(model: nn.Module) -> Iterator[nn.Linear]:
    """The linear layers in `model`'s blocks whose frozen weight NF4 holds (not the routers, whose few weights choose
    experts: kept exact, as QLoRA keeps every layer outside the blocks)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return
    for name, module in blocks.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith("router"):
            if not module.weight.requires_grad and quantizable(module.weight):
                yield module


def stacked_quantizable(weight: torch.Tensor) -> bool:
    """Whether NF4 can hold a stack of matrices (a mixture's experts, E x in x out) one after another: each of whole
    groups, so that no group spans two experts."""
    return weight.ndim == 3 and (weight.shape[1] * weight.shape[2]) % GROUP == 0


def base_stacks(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
    """(module, attribute, weight) of each frozen stack of matrices in `model`'s blocks that NF4 can hold (the
    routed experts)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return
    for module in blocks.modules():
        for attribute, param in module.named_parameters(recurse=False):
            if not param.requires_grad and stacked_quantizable(param):
                yield module, attribute, param


def quantize_base(model: nn.Module) -> None:
    """Replace the frozen linear weights of `model`'s blocks by NF4 tensors of their shape, and each frozen stack of
    expert matrices (E, in, out) by one NF4 tensor of its experts' rows one after another (E x in, out): the values
    come with materialisation (quantized_piece)."""
    for linear in list(base_linears(model)):
        rows, columns = linear.weight.shape
        linear.weight = nn.Parameter(empty_nf4(rows, columns, linear.weight.device), requires_grad=False)
    for module, attribute, stack in list(base_stacks(model)):
        experts, rows, columns = stack.shape
        setattr(module, attribute, nn.Parameter(empty_nf4(experts * rows, columns, stack.device), requires_grad=False))


def empty_nf4(rows: int, columns: int, device: torch.device) -> torch.Tensor:
    """An NF4 tensor of shape (rows, columns) on `device`, its codes and scales allocated, not computed (allocation
    of a model whose values come next, or of a dry run's fake one: quantising would cost as much as the step)."""
    nf4 = _nf4()
    numel, dtype = rows * columns, QUANTISED_FROM
    shape = torch.Size((rows, columns))
    return nf4.nf4_constructor(
        nf4.SubclassTensorArgs(shape, (columns, 1), 0, dtype, device, False),
        BLOCK,
        numel // BLOCK,
        SCALER_BLOCK,
        torch.empty(numel // BLOCK, dtype=torch.int8, device=device),  # the block scales' codes
        torch.empty(numel // GROUP, dtype=dtype, device=device),  # each group's factor
        torch.empty((), dtype=dtype, device=device),  # the scales' mean
        torch.empty(numel // 2, dtype=torch.uint8, device=device),  # two 4-bit codes a byte
        torch.empty(16, dtype=dtype, device=device),  # the levels
    )


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (a parameter, or a DTensor's local part) is NF4: a check that imports nothing, for the many
    runs without torchao."""
    local = getattr(tensor, "_local_tensor", tensor)
    modules = (sys.modules.get(name) for name in NF4_MODULES)
    return any(module is not None and isinstance(local, module.NF4Tensor) for module in modules)


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as the model computes with it: an NF4 weight's values (in QUANTISED_FROM), any other as it is."""
    return cast(Any, tensor).get_original_weight() if is_nf4(tensor) else tensor


@torch.no_grad()
def quantized_piece(full: torch.Tensor, rows: int, first_row: int, device: torch.device) -> torch.Tensor:
    """Rows [first_row, first_row + rows) of the NF4 quantisation of the whole weight `full`, on `device`: every
    rank quantises the same whole tensor and keeps its rows (the module docstring says why)."""
    nf4 = _nf4().to_nf4(full.to(device, QUANTISED_FROM), BLOCK, SCALER_BLOCK)
    if rows == full.shape[0]:
        return nf4
    return torch.split(nf4, rows)[first_row // rows]


def nf4_shards_fit(weight: torch.Tensor, shards: int) -> bool:
    """Whether `shards` row shards of NF4 `weight` each hold whole groups (FSDP splits codes, scales and factors
    alike)."""
    return weight.shape[0] % shards == 0 and (weight.numel() // shards) % GROUP == 0
