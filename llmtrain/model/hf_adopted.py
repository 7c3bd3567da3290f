"""`model.init_from=<directory or hub name>` alone: the model its config.json names, of the family and shape it
holds (as transformers' AutoModelForCausalLM builds it), for a command line that chooses no preset (`model=`).

The checkpoint gives every key of its shape; the run keeps its own keys (RUN_KEYS: how it trains and pads); a shape
key the command line sets must agree with the checkpoint (the format's shape keys, as the weights reader checks
them), so `model.lora.rank=16` is taken and `model.n_layer=2` is refused in one line naming it. With a preset the
command line chose, nothing changes here: the weights reader holds the preset to the checkpoint's shape."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from llmtrain.config import ModelConfig, check_domains
from llmtrain.model import gpt_config, model_group_of
from llmtrain.model.hf import hf_model_at
from llmtrain.model.hf_files import check_same_shape, local_hf_directory

# The model keys a run sets for itself, whatever the checkpoint it starts from: how it trains (adapters, a quantised
# base, dropout, the mixtures' auxiliary losses), how it pads the vocabulary, its name and where it starts.
RUN_KEYS = (
    "name",
    "init_from",
    "lora",
    "quantize_base",
    "dropout",
    "attention_dropout",
    "vocab_multiple",
    "moe.aux_loss_coef",
    "moe.z_loss_coef",
)
_PRESET = re.compile(r"^[+~]*model=")
_MODEL_KEY = re.compile(r"^[+~]*model\.([^=]+)=")


def chose_preset(overrides: Sequence[str]) -> bool:
    """Whether the command line names a model preset (`model=<name>`)."""
    return any(_PRESET.match(override) for override in overrides)


def with_init_from_model(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """`cfg` with the model group of model.init_from's checkpoint where the command line (`overrides`) chooses no
    preset; `cfg` itself otherwise. Reads config.json only (transformers' config class of its model_type)."""
    init_from = cfg.model.init_from
    if not init_from or chose_preset(overrides):
        return cfg
    composed = cfg.model
    check_domains(composed, ModelConfig, "model.")  # a path that is no model directory: its key's own line
    set_keys = [match.group(1) for override in overrides if (match := _MODEL_KEY.match(override))]
    theirs, held = hf_model_at(local_hf_directory(init_from))
    checkpoint_group = model_group_of(theirs, OmegaConf.to_object(composed))
    adopted = OmegaConf.structured(
        dataclasses.replace(checkpoint_group, name=os.path.basename(os.path.normpath(init_from)))
    )
    for key in (*RUN_KEYS[1:], *set_keys):
        OmegaConf.update(adopted, key, OmegaConf.select(composed, key), merge=False)
    ours = gpt_config(OmegaConf.to_object(adopted), theirs.vocab_size)
    check_same_shape(
        init_from, ours, theirs, held.weights.shape_keys, "leave those model keys out: the checkpoint sets them"
    )
    merged = OmegaConf.merge(cfg, {"model": adopted})
    assert isinstance(merged, DictConfig)
    return merged
