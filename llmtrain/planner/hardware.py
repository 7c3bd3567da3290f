"""The GPUs llmtrain knows the peak of, and which hardware config describes the device a run is on: a run plans
(parallel=auto, the end summary's prediction) for the GPU it has, not for the `hardware` default (cpu) nor for a
config written for another card.

Each GPU config names its card by part of the name torch gives it (`device_name`), which also finds the card's peak
in GPU_PEAK_BF16_FLOPS: the one table of peaks, for the planner's step times and a run's MFU. On a CPU the
configured hardware stands (it describes the host).
"""

from __future__ import annotations

import glob
import os

from omegaconf import OmegaConf

from llmtrain.config import CONF_DIR, HardwareConfig
from llmtrain.model.moe import FUSED_GROUPED_GEMM_MAJORS

# Dense bf16 tensor-core peak (FLOP/s, fp32 accumulate, no sparsity) by a substring of the device name (torch's, or
# a hardware config's device_name, which holds it), the first match winning: a card's PCIe / NVL variants come
# before the family name (an H100 PCIe is not an H100 SXM).
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
# Memory bandwidth (bytes/s) by the same substrings: what decoding a token reads its weights and KV cache at
# (planner/rollout.py). The vendors' datasheets: HBM3e 4.8 TB/s (H200), HBM3 3.35 TB/s (H100 SXM), 3.9 (H100 NVL),
# HBM2e 2.0 (H100 PCIe, A100 80GB), GDDR6 864 GB/s (L40S) and 600 (A10G), GDDR6X 1,008 (RTX 4090), 717 (RTX 4080)
# and 936 (RTX 3090).
GPU_MEMORY_BANDWIDTH = [
    ("H200 NVL", 4.8e12),
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100", 2.0e12),
    ("L40S", 0.864e12),
    ("A10G", 0.6e12),
    ("RTX 4090", 1.008e12),
    ("RTX 4080", 0.717e12),
    ("RTX 3090", 0.936e12),
]
# Compute capability majors by the same substrings: whether torch's grouped GEMM has a fused kernel for a mixture's
# experts there (model/moe.py's FUSED_GROUPED_GEMM_MAJORS: Hopper 9, Blackwell 10; not Ampere's or Ada's 8).
GPU_ARCHITECTURE_MAJOR = [
    ("H200", 9),
    ("H100", 9),
    ("B200", 10),
    ("A100", 8),
    ("L40S", 8),
    ("A10G", 8),
    ("RTX 4090", 8),
    ("RTX 4080", 8),
    ("RTX 3090", 8),
]
# fp32 matmuls run on the TF32 tensor cores (runtime.py enables them), at half the bf16 rate on every card above.
TF32_FRACTION_OF_BF16 = 0.5


def peak_flops_of(device_name: str, bf16: bool) -> float | None:
    """The peak FLOP/s of the card `device_name` names (torch's name for it, or a hardware config's part of that
    name) for the run's precision (bf16, or fp32 on TF32 tensor cores); None for a card missing from the table."""
    peak = next((peak for key, peak in GPU_PEAK_BF16_FLOPS if key in device_name), None)
    return None if peak is None else peak * (1.0 if bf16 else TF32_FRACTION_OF_BF16)


def runs_experts_one_by_one(device_name: str) -> bool:
    """Whether a mixture's experts run one by one on the card `device_name` names (no fused grouped GEMM there; a
    card missing from the table counts as having one)."""
    major = next((major for key, major in GPU_ARCHITECTURE_MAJOR if key in device_name), None)
    return major is not None and major not in FUSED_GROUPED_GEMM_MAJORS


def memory_bandwidth_of(device_name: str) -> float | None:
    """The bytes/s the card `device_name` names reads its memory at; None for a card missing from the table."""
    return next((bandwidth for key, bandwidth in GPU_MEMORY_BANDWIDTH if key in device_name), None)


def hardware_configs() -> list[HardwareConfig]:
    """Every config of conf/hardware/, by name."""
    found = []
    for path in sorted(glob.glob(os.path.join(CONF_DIR, "hardware", "*.yaml"))):
        merged = OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(path))
        found.append(OmegaConf.to_object(merged))
    return found  # type: ignore[return-value]


def describes(hardware: HardwareConfig, device_name: str) -> bool:
    return hardware.device_name is not None and hardware.device_name.lower() in device_name.lower()


def hardware_for_device(configured: HardwareConfig, device_type: str, device_name: str) -> HardwareConfig | str:
    """The hardware to plan a run on this device with: the configured one where it describes the device (or the
    device is the host), else the config of conf/hardware/ that names the card (the longest name matched); where
    none does, a GPU's config the user chose for it (their word for a card no file names), or the one line that
    says there is none."""
    if device_type == "cpu" or describes(configured, device_name):
        return configured
    matching = [hardware for hardware in hardware_configs() if describes(hardware, device_name)]
    if not matching and configured.device_name is not None:
        return configured
    if not matching:
        return (
            f"no hardware config describes {device_name}: add conf/hardware/<name>.yaml with its device_name, "
            f"memory and links (conf/hardware/h200.yaml is one), and the card's peak to GPU_PEAK_BF16_FLOPS in "
            f"llmtrain/planner/hardware.py"
        )
    return max(matching, key=lambda hardware: len(hardware.device_name or ""))
