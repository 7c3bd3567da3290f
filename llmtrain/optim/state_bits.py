"""Checkpoints of an optimizer whatever `optim.state_bits` it keeps its moments in.

torchao's 8-bit AdamW holds each large moment as codes and blockwise scales (a tensor subclass) and its learning
rates as 0-d tensors. A checkpoint stores neither: moments are written dequantised to fp32 and learning rates as
numbers, exactly what torch's AdamW writes, so any layout loads any checkpoint (across state_bits the optimizers'
options differ: checkpoint/training.py refuses it in one line). Loading into an 8-bit optimizer quantises the fp32
moments again: a block whose largest value has no exact code gets a slightly different scale, so its values move
by about a code step (measured: up to 0.8% of the tensor's largest value). The resumed run follows the
uninterrupted one within that rounding, not bit for bit (tests/optim/test_low_precision.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from llmtrain.catalog import MOMENT_BYTES

# (state key, whether its values have a sign): what torchao's `_new_buffer` quantises, and how.
_MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))
# torchao's 8-bit AdamW quantises a moment whose (local) tensor has at least this many values, in whole blocks of
# BLOCK values sharing one fp32 scale; smaller or ragged ones stay fp32 (bitsandbytes' rule).
QUANTIZED_AT_LEAST = 4096
BLOCK = 256


def moment_bytes(local: torch.Tensor, state_bits: int) -> float:
    """Bytes of one AdamW moment of a parameter whose local tensor is `local`, under `optim.state_bits`."""
    n = local.numel()
    if state_bits == 8 and n >= QUANTIZED_AT_LEAST and n % BLOCK == 0:
        return n * MOMENT_BYTES[8]
    return n * MOMENT_BYTES[32]


def _is_quantized(tensor: torch.Tensor) -> bool:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return is_traceable_wrapper_subclass(local) and hasattr(local, "dequantize")


def _dequantized(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, DTensor):
        return tensor.dequantize()
    local = tensor.to_local().dequantize()
    return DTensor.from_local(
        local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


def portable_state(flat: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's flat state dict ("state.<param>.<key>", "param_groups.<param>.<option>") as torch's AdamW
    would write it: quantised moments in fp32, 0-d tensor options (learning rates) as numbers."""
    portable = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor) and _is_quantized(value):
            value = _dequantized(value)
        elif key.startswith("param_groups.") and isinstance(value, torch.Tensor):
            value = value.item()
        portable[key] = value
    return portable


def restore_low_bits(optimizer: torch.optim.Optimizer) -> None:
    """After a load into a low-bit optimizer (one with torchao's `_new_buffer`): its learning rates tensors again
    and every moment it quantises quantised again. Nothing to do for torch's optimizers."""
    new_buffer = getattr(optimizer, "_new_buffer", None)
    if new_buffer is None:
        return
    for group in optimizer.param_groups:
        for option in ("lr", "initial_lr"):
            if option in group and not isinstance(group[option], torch.Tensor):
                group[option] = torch.tensor(group[option])
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, signed in _MOMENTS:
                if key in state and not _is_quantized(state[key]):
                    moment = new_buffer(param, signed)
                    moment.copy_(state[key])
                    state[key] = moment
