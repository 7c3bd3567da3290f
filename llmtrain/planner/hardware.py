"""Which hardware config describes the device a run is on: a run plans (parallel=auto, the end summary's
prediction) for the GPU it has, not for the `hardware` default (cpu) nor for a config written for another card.

Each GPU config names its card by part of the name torch gives it (`device_name`); on a CPU the configured hardware
stands (it describes the host).
"""

from __future__ import annotations

import glob
import os

from omegaconf import OmegaConf

from llmtrain.config import CONF_DIR, HardwareConfig


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
            f"memory, links and peak_tflops (conf/hardware/h200.yaml is one)"
        )
    return max(matching, key=lambda hardware: len(hardware.device_name or ""))
