"""Throughput and model FLOPs utilisation (MFU)."""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peak (FLOP/s, fp32 accumulate, no sparsity) by a substring of the device name. GeForce
# cards accumulate in fp32 at half their fp16-accumulate rate, which is what training uses.
GPU_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is lower, so its MFU reads high
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
    "RTX 4080": 97.5e12,
    "RTX 3090": 71e12,
}


def peak_flops(device: torch.device) -> float | None:
    """The device's peak bf16 FLOP/s, or None when unknown (any CPU, or a GPU missing from the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_PEAK_BF16_FLOPS.items() if key in name), None)


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    return None if peak is None else tokens_per_s_per_device * flops_per_token / peak


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
