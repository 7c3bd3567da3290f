"""The optimizers (optim.name: each a row of llmtrain/catalog/optimizers.py's OPTIMIZERS, which names what builds
it) over the parameter groups of groups.py, and the learning-rate schedules (lr_schedule.py)."""

from __future__ import annotations

import torch
from torch import nn

from llmtrain.catalog import OPTIMIZERS, imported
from llmtrain.optim.compute import HOST, Compute
from llmtrain.optim.groups import adamw_options, fused_for, is_hidden_matrix, param_groups
from llmtrain.optim.lr_schedule import build_lr_schedule, lr_factor
from llmtrain.optim.muon import Muon, newton_schulz
from llmtrain.optim.offload import HostAdamW


def build_optimizer(
    model: nn.Module, optim_cfg, compute_dtype: torch.dtype = HOST.dtype, device: torch.device = HOST.device
) -> torch.optim.Optimizer:
    """`optim.name`'s optimizer over `model`'s parameters, built by its row's builder (`compute_dtype`: the run's
    compute precision; `device`: where the parameters compute, which `optim.offload` moves the state off)."""
    builder = imported(OPTIMIZERS[optim_cfg.name].builder)
    return builder(param_groups(model, optim_cfg), optim_cfg, Compute(device, compute_dtype))


def adamw(groups: list[dict], optim_cfg, compute: Compute = HOST) -> torch.optim.Optimizer:
    """AdamW over `groups` with its moments in `optim.state_bits`: torch's fp32 AdamW, or the 8-bit AdamW of
    adamw8bit.py (torchao's moments and update, one compiled call per chunk of values); with `optim.offload`,
    torch's AdamW on the host (offload.py) for parameters on `compute.device`."""
    if optim_cfg.offload:
        return HostAdamW(groups, optim_cfg, compute.device)
    if optim_cfg.state_bits == 32:
        return torch.optim.AdamW(
            [{**group, "fused": fused_for(group["params"])} for group in groups], **adamw_options(optim_cfg)
        )
    from llmtrain.optim.adamw8bit import AdamW8bit  # imports torchao, an extra only 8-bit runs need

    return AdamW8bit(groups, optim_cfg)


__all__ = [
    "Compute",
    "HostAdamW",
    "Muon",
    "adamw",
    "adamw_options",
    "build_optimizer",
    "build_lr_schedule",
    "is_hidden_matrix",
    "lr_factor",
    "newton_schulz",
    "param_groups",
]
