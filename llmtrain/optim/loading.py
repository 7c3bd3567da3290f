"""Loading a checkpoint's optimizer state into state an optimizer keeps itself (host copies, flat 8-bit buffers):
torch's own load would replace those tensors with the loaded ones, placed beside the weights."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import torch


def load_in_place(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], state_of: Callable[[torch.Tensor], dict]
) -> None:
    """Copy `state_dict` (torch's format, what `Optimizer.state_dict` writes) into each parameter's `state_of`
    dict in place, and the saved group options into the optimizer's groups."""
    saved_groups = state_dict["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError("the checkpoint's optimizer has other parameter groups than this one")
    for saved, group in zip(saved_groups, optimizer.param_groups):
        group.update({option: value for option, value in saved.items() if option != "params"})
    saved_ids = chain.from_iterable(g["params"] for g in saved_groups)
    for param_id, param in zip(saved_ids, chain.from_iterable(g["params"] for g in optimizer.param_groups)):
        if param_id in state_dict["state"]:
            state = state_of(param)
            for key, value in state_dict["state"][param_id].items():
                state[key].copy_(value)
