"""Learning-rate schedules (named in llmtrain/catalog/optimizers.py): the multiplier of each group's peak rate at every
optimizer step.

  cosine    linear warmup, then cosine decay to min_lr_ratio at the last step
  wsd       warmup-stable-decay: linear warmup, the peak rate held, then a decay to min_lr_ratio over the last
            decay_fraction of the steps (shape: linear, cosine or 1-sqrt). The stable phase does not depend on
            train.steps, so a run resumed from a stable-phase checkpoint with a larger train.steps continues as if
            it had been planned that long, and branches decayed from one stable run share its first steps
  constant  linear warmup, then the peak rate
"""

from __future__ import annotations

import torch

from llmtrain.catalog import DECAY_SHAPES


def warmup_factor(step: int, warmup_steps: int) -> float | None:
    """The warmup multiplier at `step` (0-based), reaching 1 at step warmup_steps - 1; None after the warmup."""
    return (step + 1) / warmup_steps if step < warmup_steps else None


def lr_factor(step: int, total_steps: int, optim_cfg) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based) of a run of `total_steps`."""
    warmup = warmup_factor(step, optim_cfg.warmup_steps)
    if warmup is not None:
        return warmup
    floor = optim_cfg.min_lr_ratio
    if optim_cfg.lr_schedule == "constant":
        return 1.0
    if optim_cfg.lr_schedule == "wsd":
        decay_steps = max(1, round(optim_cfg.decay_fraction * total_steps))
        decay_start = max(optim_cfg.warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        # The first decay step is already below the peak and the last reaches the floor.
        progress = min(1.0, (step - decay_start + 1) / max(1, total_steps - decay_start))
        return floor + (1 - floor) * DECAY_SHAPES[optim_cfg.decay_shape](progress)
    decay_steps = max(1, total_steps - 1 - optim_cfg.warmup_steps)
    progress = min(1.0, (step - optim_cfg.warmup_steps) / decay_steps)
    return floor + (1 - floor) * DECAY_SHAPES["cosine"](progress)


def build_lr_schedule(
    optimizer: torch.optim.Optimizer, total_steps: int, optim_cfg
) -> torch.optim.lr_scheduler.LambdaLR:
    """Each group's lr = its peak (the lr it was built with) x lr_factor; its state is the step count alone, so a
    resumed run recomputes the rates from its own config (a longer train.steps continues a WSD run)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, optim_cfg))
