"""Rotary position embedding (RoPE) in transformers' Llama convention, and Llama 3's stretching of its low
frequencies ("llama3" rope scaling) or a linear one of all ("linear"), so that a Llama or Gemma 3 checkpoint computes
here what it computed where it was trained.

Dimension i < d/2 of a head pairs with i + d/2 (the half-split rotation, not interleaved pairs) and turns by
position x f_i, with f_i = theta^(-2i/d).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """`kind` llama3: Llama 3.1's frequency-dependent interpolation: rotations that complete a turn within
    original_max_seq_len / high_freq_factor positions keep their frequency, rotations slower than
    original_max_seq_len / low_freq_factor positions slow down by `factor`, and the band between blends the two,
    so a model pretrained on original_max_seq_len tokens reads `factor` times longer contexts. `kind` linear: every
    rotation slows by `factor` (position interpolation; Gemma 3's global blocks), the other fields unused."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int
    kind: str = "llama3"  # model.rope_scaling.type


def frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """f_i for i < head_dim / 2, in float32, made on `device` (no host-to-device copy in the forward)."""
    base = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    if scaling is None:
        return base
    if scaling.kind == "linear":
        return base / scaling.factor
    turns_in_context = scaling.original_max_seq_len * base / (2 * math.pi)  # original context / wavelength
    # 0 at (and below) low_freq_factor turns, 1 at (and above) high_freq_factor turns
    blend = ((turns_in_context - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(
        0.0, 1.0
    )
    return base * (blend + (1 - blend) / scaling.factor)


def rotation(positions: torch.Tensor, frequencies: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles of `positions`, (t, head_dim) for positions (t,), shared by every row and head; or
    (batch, 1, t, head_dim) for positions (batch, t), each row's own (packed documents, model/documents.py)."""
    angles = positions.float()[..., None] * frequencies
    angles = torch.cat([angles, angles], dim=-1)
    if positions.ndim == 2:
        angles = angles[:, None]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, heads, t, head_dim) rotated by the angles of `rotation`, computed in float32."""
    first, second = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-second, first], dim=-1) * sin).type_as(x)
