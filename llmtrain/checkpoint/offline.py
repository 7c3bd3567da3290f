"""A checkpoint's model in one process, without the run that wrote it: for export and sampling."""

from __future__ import annotations

import os

import torch.distributed.checkpoint as dcp

from llmtrain.checkpoint.manager import (complete_checkpoints, incomplete_reason, is_checkpoint_name, read_meta,
                                         single_process_quiet)
from llmtrain.model import GPT, GPTConfig


def find_checkpoint(path: str) -> str:
    """`path` itself when it is one checkpoint, else the latest complete one in it (a checkpoint directory, or a
    run directory with checkpoints/)."""
    path = os.path.abspath(os.path.expanduser(path))
    if is_checkpoint_name(path):
        reason = incomplete_reason(path)
        if reason:
            raise SystemExit(f"error: {path} is not a complete checkpoint: {reason}")
        return path
    for directory in (path, os.path.join(path, "checkpoints")):
        found = complete_checkpoints(directory)
        if found:
            return found[-1]
    raise SystemExit(f"error: no complete checkpoint in {path}: pass a step-* directory, a checkpoint directory or "
                     f"a run directory")


def load_checkpoint_model(path: str) -> GPT:
    """The whole model of checkpoint `path`, whatever layout saved it (DCP reassembles the shards)."""
    model = GPT(GPTConfig(**read_meta(path)["model"]))
    # In place, into the parameters; the tied head is stored as (and is) the embedding (Strategy.checkpoint_state).
    weights = {name: tensor for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
    with single_process_quiet():
        dcp.load({"model": weights}, checkpoint_id=path, no_dist=True)
    return model.eval()
