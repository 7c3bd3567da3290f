"""The final weights as one full state dict under the unsplit GPT's parameter names.

`get_model_state_dict` gathers whatever the layout holds (DDP replicas, ZeRO-1 flat buffers, FSDP shards) into
full tensors on rank 0's CPU, so any run's `model.pt` loads into a plain `GPT` with `load_state_dict`.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def save_final_model(model: nn.Module, path: str, is_main: bool) -> None:
    """Collective: every rank calls it; rank 0 writes `path` atomically."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        # clone: a ZeRO-1 parameter is a view of a flat buffer, and torch.save would store the whole buffer.
        state = {name: tensor.detach().clone() for name, tensor in state.items()}
        tmp = f"{path}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)


def load_final_model(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)
