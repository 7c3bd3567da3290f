"""A trained model in one process, without the run that wrote it: a checkpoint's or an exported directory's, for
export, sampling and chat."""

from __future__ import annotations

import os
from typing import Any

import torch

from llmtrain.checkpoint.manager import (
    DamagedCheckpoint,
    IncompleteCheckpoint,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
    verify,
)
from llmtrain.errors import ConfigError
from llmtrain.model import GPT, GPTConfig, ParameterInit, family_class, materialize, pretrained_or_seeded
from llmtrain.model.hf_files import local_hf_directory, weights_fingerprint
from llmtrain.model.lora import is_adapter
from llmtrain.model.materialize import allocate, write_parameters


def find_checkpoint(path: str) -> str:
    """`path` itself when it is one checkpoint, else the latest complete one in it (a checkpoint directory, or a
    run directory with checkpoints/), verified against its checksums: a damaged one is named, never read."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        found = latest_checkpoint(path) or latest_checkpoint(os.path.join(path, "checkpoints"))
    except IncompleteCheckpoint as reason:
        raise ConfigError(f"{path} is not a complete checkpoint: {reason}") from None
    if not found:
        raise ConfigError(
            f"no complete checkpoint in {path}: pass a step-* directory, a checkpoint directory or a run directory"
        )
    try:
        verify(found)
    except DamagedCheckpoint as damage:
        raise ConfigError(f"checkpoint {found} is damaged: {damage}: use an earlier step-* directory") from None
    return found


def load_checkpoint_model(path: str) -> GPT:
    """The whole model of checkpoint `path`, of the family its meta.json records, whatever layout saved it (DCP
    reassembles the shards); with low-rank adapters, the base its meta.json names (read again, and checked against
    the fingerprint it recorded) under the adapters it holds."""
    meta = read_meta(path)
    cfg = GPTConfig.from_dict(meta["model"])
    with torch.device("meta"):
        model = family_class(cfg.family)(cfg)
    allocate(model, torch.device("cpu"))  # no initial values: the checkpoint overwrites every parameter it holds
    if model.cfg.lora.enabled:
        write_parameters(model, _base_weights(path, model, meta["base"]))
    # In place, into the parameters; a tied one is stored as (and is) its source (llmtrain/checkpoint/state.py).
    weights = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if name not in model.tied_parameters and (is_adapter(name) or not model.cfg.lora.enabled)
    }
    load_checkpoint(path, {"model": weights}, distributed=False)
    return model.eval()


def load_model_and_tokenizer(path: str) -> tuple[GPT, Any]:
    """(the whole model in eval mode on the CPU, its transformers tokenizer) of an exported Hugging Face directory
    (llmtrain.export, or a released model's) or of a checkpoint, checkpoint directory or run directory."""
    from transformers import AutoTokenizer

    if os.path.isfile(os.path.join(path, "config.json")):
        from llmtrain.model.hf import hf_config_of, hf_weights

        with torch.device("meta"):
            model = GPT(hf_config_of(path))
        materialize(model, torch.device("cpu"), hf_weights(path, model.cfg))
        return model.eval(), AutoTokenizer.from_pretrained(path)
    checkpoint = find_checkpoint(path)
    return load_checkpoint_model(checkpoint), AutoTokenizer.from_pretrained(os.path.join(checkpoint, "tokenizer"))


def _base_weights(path: str, model: GPT, base: dict) -> ParameterInit:
    init_from = base.get("init_from")
    if init_from:
        directory = local_hf_directory(init_from)
        if weights_fingerprint(directory) != base["fingerprint"]:
            raise ConfigError(
                f"checkpoint {path} holds low-rank adapters of {init_from} with weights {base['fingerprint']}, but "
                f"{directory} now holds other weights: restore the base the adapters were trained on"
            )
    return pretrained_or_seeded(init_from, model, base.get("seed", 0))
