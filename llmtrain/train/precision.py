"""Numeric precision of the forward and backward passes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


def uses_bf16(precision: str, device: torch.device) -> bool:
    """`auto`: bf16 autocast on CUDA, full fp32 on CPU (CPU autocast is slow and the tests need fp32 parity)."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def precision_context(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    if uses_bf16(precision, device):
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext
