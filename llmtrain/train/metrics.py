"""Throughput, model FLOPs utilisation (MFU) and the GPU memory of each step."""

from __future__ import annotations

from typing import Any

import torch

# The peaks are the planner's card table (one source for MFU and the planned step times); the table is re-exported
# for tests/train/test_metrics.py, which holds it to the vendors' datasheets.
from llmtrain.planner.hardware import GPU_PEAK_BF16_FLOPS as GPU_PEAK_BF16_FLOPS
from llmtrain.planner.hardware import peak_flops_of


def peak_flops(device: torch.device, bf16: bool) -> float | None:
    """The device's peak FLOP/s for the run's precision (bf16, or fp32 on TF32 tensor cores), or None when
    unknown (any CPU, or a GPU missing from the table)."""
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device), bf16)


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    return None if peak is None else tokens_per_s_per_device * flops_per_token / peak


def begin_step_memory(device: torch.device) -> None:
    """Start the step's memory high-water marks afresh, so each step reports its own peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def step_memory(device: torch.device) -> dict[str, Any]:
    """The step's GPU memory for its metrics record; nothing on CPU. Reads the allocator's host-side counters:
    no device synchronisation."""
    if device.type != "cuda":
        return {}
    return memory_record(torch.cuda.memory_stats(device))


def memory_record(stats: dict[str, Any]) -> dict[str, Any]:
    """From the CUDA caching allocator's statistics: the step's peak of memory held by tensors (allocated) and
    by the allocator (reserved: what the card cannot give to anyone else), and the run's counts so far of
    allocation retries (the allocator freed its cache to satisfy a request: fragmentation, a slow step) and of
    out-of-memory errors."""
    return {
        "peak_memory_gib": stats.get("allocated_bytes.all.peak", 0) / 2**30,
        "peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30,
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "ooms": stats.get("num_ooms", 0),
    }
