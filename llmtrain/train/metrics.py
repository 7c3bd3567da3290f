"""Throughput, model FLOPs utilisation (MFU) and the GPU memory of each step."""

from __future__ import annotations

from typing import Any

import torch

# Dense bf16 tensor-core peak (FLOP/s, fp32 accumulate, no sparsity) by a substring of the device name, the first
# match winning: a card's PCIe / NVL variants come before the family name (an H100 PCIe is not an H100 SXM).
# GeForce cards accumulate in fp32 at half their fp16-accumulate rate, which is what training uses.
GPU_PEAK_BF16_FLOPS = [
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("RTX 4090", 165e12),
    ("RTX 4080", 97.5e12),
    ("RTX 3090", 71e12),
]
# fp32 matmuls run on the TF32 tensor cores (runtime.py enables them), at half the bf16 rate on every card above.
TF32_FRACTION_OF_BF16 = 0.5


def peak_flops(device: torch.device, bf16: bool) -> float | None:
    """The device's peak FLOP/s for the run's precision (bf16, or fp32 on TF32 tensor cores), or None when
    unknown (any CPU, or a GPU missing from the table)."""
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device), bf16)


def peak_flops_of(device_name: str, bf16: bool) -> float | None:
    peak = next((peak for key, peak in GPU_PEAK_BF16_FLOPS if key in device_name), None)
    return None if peak is None else peak * (1.0 if bf16 else TF32_FRACTION_OF_BF16)


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
