"""Checkpoints of an optimizer whatever `optim.state_bits` it keeps its moments in.

The 8-bit AdamW (adamw8bit.py) holds each large moment as codes and blockwise scales (torchao's tensor subclass). A
checkpoint stores them dequantised to fp32, exactly what torch's AdamW writes, so any layout loads any checkpoint
(across state_bits the optimizers' options differ: checkpoint/training.py refuses it in one line). Loading into an
8-bit optimizer quantises the fp32 moments again: a block whose largest value has no exact code gets a slightly
different scale, so its values move by about a code step (measured: up to 0.8% of the tensor's largest value). The
resumed run follows the uninterrupted one within that rounding, not bit for bit (tests/optim/test_low_precision.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from llmtrain.catalog import MOMENT_BYTES

# The 8-bit AdamW quantises a moment whose (local) tensor has at least this many values, in whole blocks of BLOCK
# values sharing one fp32 scale; smaller or ragged ones stay fp32 (bitsandbytes' rule, torchao's).
QUANTIZED_AT_LEAST = 4096
BLOCK = 256


def is_quantized(local: torch.Tensor) -> bool:
    """Whether an 8-bit AdamW keeps 8-bit moments for a parameter whose local tensor is `local`."""
    return local.numel() >= QUANTIZED_AT_LEAST and local.numel() % BLOCK == 0


def moment_bytes(local: torch.Tensor, state_bits: int) -> float:
    """Bytes of one AdamW moment of a parameter whose local tensor is `local`, under `optim.state_bits`."""
    return local.numel() * MOMENT_BYTES[8 if state_bits == 8 and is_quantized(local) else 32]


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
    would write it: quantised moments in fp32."""
    return {
        key: _dequantized(value) if isinstance(value, torch.Tensor) and _is_quantized(value) else value
        for key, value in flat.items()
    }
