"""The final weights, `model.pt`: one full state dict under the unsplit model's parameter names, which the layout
gathers from wherever it holds them (ParallelModel.full_state_dict), so any run's file loads into an unsplit model
of its family (model.family in the run's .hydra/config.yaml: a plain `GPT` for every preset)."""

from __future__ import annotations

import os

import torch


def save_final_model(state: dict[str, torch.Tensor], path: str) -> None:
    """Write `state` to `path` atomically (rank 0 only)."""
    # A ZeRO-1 parameter is a view of a flat buffer, which torch.save would store whole: such views are cloned,
    # one at a time; other tensors are written as they are (no second copy of the model in host memory).
    state = {
        name: tensor.detach().clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor.detach()
        for name, tensor in state.items()
    }
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_final_model(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)
