"""AdamW with decay / no-decay groups, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (Linear weights, embeddings); none on biases and LayerNorm parameters, whose
    decay would only pull scales and offsets towards zero."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(model: nn.Module, optim_cfg) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        adamw_param_groups(model, optim_cfg.weight_decay),
        lr=optim_cfg.lr,
        betas=(optim_cfg.beta1, optim_cfg.beta2),
        eps=optim_cfg.eps,
    )


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup reaching 1 at step
    warmup_steps - 1, then cosine decay reaching min_ratio at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_schedule(optimizer: torch.optim.Optimizer, total_steps: int, optim_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, optim_cfg.warmup_steps, optim_cfg.min_lr_ratio)
    )
