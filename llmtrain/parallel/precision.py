"""Numeric precision of the forward and backward passes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


def uses_bf16(precision: str, device: torch.device) -> bool:
    """`auto`: bf16 autocast on CUDA, full fp32 on CPU (CPU autocast is slow and the tests need fp32 parity)."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


PrecisionContext = Callable[[], contextlib.AbstractContextManager]


def precision_policy(device: torch.device, bf16: bool, fsdp_mixed_precision: bool) -> tuple[PrecisionContext, str]:
    """The one precision policy, torchtitan's, as (a context for forward passes, its description):
    - fp32 (the CPU default): no casts;
    - bf16 where FSDP applies: FSDP's MixedPrecisionPolicy gathers bf16 copies of the fp32 weights, so blocks
      compute in bf16, and reduces gradients in fp32 into fp32 weights; no autocast on top, which would cast again
      (and left the residual stream bf16 under FSDP but fp32 elsewhere, two policies in one harness);
    - bf16 elsewhere: autocast, bf16 matmuls over fp32 weights.
    Losses are computed in fp32 either way (model.summed_cross_entropy)."""
    if not bf16:
        return contextlib.nullcontext, "fp32"
    if fsdp_mixed_precision:
        return contextlib.nullcontext, "bf16 (FSDP mixed precision: bf16 compute, fp32 weights and gradient reduction)"
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16), "bf16 autocast (fp32 weights)"
