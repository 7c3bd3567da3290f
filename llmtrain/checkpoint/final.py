"""The final weights, `model.pt`: one full state dict under the unsplit GPT's parameter names, which the layout
gathers from wherever it holds them (Strategy.full_state_dict), so any run's file loads into a plain `GPT`."""

from __future__ import annotations

import os

import torch


def save_final_model(state: dict[str, torch.Tensor], path: str) -> None:
    """Write `state` to `path` atomically (rank 0 only)."""
    # clone: a ZeRO-1 parameter is a view of a flat buffer, and torch.save would store the whole buffer.
    state = {name: tensor.detach().clone() for name, tensor in state.items()}
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_final_model(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)
