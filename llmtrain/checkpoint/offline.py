"""A checkpoint's model in one process, without the run that wrote it: for export and sampling."""

from __future__ import annotations

import os

import torch

from llmtrain.checkpoint.manager import IncompleteCheckpoint, latest_checkpoint, load_checkpoint, read_meta
from llmtrain.errors import ConfigError
from llmtrain.model import GPT, GPTConfig
from llmtrain.model.materialize import allocate


def find_checkpoint(path: str) -> str:
    """`path` itself when it is one checkpoint, else the latest complete one in it (a checkpoint directory, or a
    run directory with checkpoints/)."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        found = latest_checkpoint(path) or latest_checkpoint(os.path.join(path, "checkpoints"))
    except IncompleteCheckpoint as reason:
        raise ConfigError(f"{path} is not a complete checkpoint: {reason}") from None
    if found:
        return found
    raise ConfigError(
        f"no complete checkpoint in {path}: pass a step-* directory, a checkpoint directory or a run directory"
    )


def load_checkpoint_model(path: str) -> GPT:
    """The whole model of checkpoint `path`, whatever layout saved it (DCP reassembles the shards)."""
    with torch.device("meta"):
        model = GPT(GPTConfig.from_dict(read_meta(path)["model"]))
    allocate(model, torch.device("cpu"))  # no initial values: the checkpoint overwrites every parameter
    # In place, into the parameters; a tied one is stored as (and is) its source (llmtrain/checkpoint/state.py).
    weights = {name: tensor for name, tensor in model.state_dict().items() if name not in model.tied_parameters}
    load_checkpoint(path, {"model": weights}, distributed=False)
    return model.eval()
