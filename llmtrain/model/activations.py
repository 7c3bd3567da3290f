"""The elementwise activations of the MLP kinds (llmtrain/catalog/models.py MLP_KINDS) that torch has no one
function for."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU by its tanh approximation, as GPT-2 and Gemma compute it."""
    return F.gelu(x, approximate="tanh")


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)², Primer's (So et al. 2021)."""
    return F.relu(x).square()
