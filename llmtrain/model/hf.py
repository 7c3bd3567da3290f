"""The Hugging Face families llmtrain converts to and from, in one table. Each family's module (hf_gpt2.py,
hf_llama.py, hf_qwen3.py, hf_mixtral.py, hf_gemma3.py) knows its tensor names and its config; this one picks the
family of a model config or of a directory, and is what model.init_from, export and sampling call."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llmtrain.errors import ConfigError
from llmtrain.model import hf_gemma3, hf_gpt2, hf_llama, hf_mixtral, hf_qwen3
from llmtrain.model.gpt import GPT, GPTConfig
from llmtrain.model.hf_files import local_hf_directory


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    transformers_class: str  # the transformers model that holds it
    preset: str  # a conf/model preset of the family
    check: Callable[[GPTConfig], None]  # ConfigError unless transformers_class can hold the model
    config_of: Callable[[str], GPTConfig]  # our config of a directory of this family
    weights: Callable[[str, GPTConfig], Callable[[str, torch.Tensor], None]]  # one tensor at a time
    hf_config: Callable[[GPTConfig, int], Any]  # the transformers config of our model (and an eos id)
    state_dict: Callable[[GPT], dict[str, torch.Tensor]]  # the transformers state dict of our whole model


GEMMA3 = Family(
    "gemma3_text",
    "Gemma3ForCausalLM",
    "model=gemma3-1b",
    hf_gemma3.check_gemma3,
    hf_gemma3.gemma3_config_of,
    hf_gemma3.Gemma3Weights,
    hf_gemma3.gemma3_hf_config,
    hf_gemma3.to_gemma3_state_dict,
)

FAMILIES = {
    family.model_type: family
    for family in (
        Family(
            "gpt2",
            "GPT2LMHeadModel",
            "model=gpt2",
            hf_gpt2.check_gpt2,
            hf_gpt2.gpt_config_of,
            hf_gpt2.GPT2Weights,
            hf_gpt2.hf_config,
            hf_gpt2.to_hf_state_dict,
        ),
        Family(
            "llama",
            "LlamaForCausalLM",
            "model=smollm2-135m",
            lambda cfg: None,
            hf_llama.llama_config_of,
            hf_llama.LlamaWeights,
            hf_llama.llama_hf_config,
            hf_llama.to_llama_state_dict,
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            "model=qwen3-0.6b",
            hf_qwen3.check_qwen3,
            hf_qwen3.qwen3_config_of,
            hf_qwen3.Qwen3Weights,
            hf_qwen3.qwen3_hf_config,
            hf_llama.to_llama_state_dict,
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            "model=mixtral-tiny",
            hf_mixtral.check_mixtral,
            hf_mixtral.mixtral_config_of,
            hf_mixtral.MixtralWeights,
            hf_mixtral.mixtral_hf_config,
            hf_mixtral.to_mixtral_state_dict,
        ),
        GEMMA3,
    )
}
# Gemma 3's multimodal releases (4B and up): their text model is a Gemma3ForCausalLM's, read from inside them.
IMPORTED_AS = {**FAMILIES, "gemma3": GEMMA3}


def family_of(cfg: GPTConfig) -> Family:
    """The family our model config belongs to (a mixture: Mixtral; query and key norms: Qwen3; RMSNorm + RoPE +
    SwiGLU: Llama; else GPT-2),
    checked to fit its transformers class (ConfigError naming the keys that do not). Only the GPT class
    (model.family=gpt) has one: another family's modules compute what no transformers class does."""
    if cfg.family != "gpt":
        raise ConfigError(
            f"model.family={cfg.family} has no Hugging Face class (transformers' GPT-2, Llama and Mixtral hold "
            f"model.family=gpt's modules), so its weights neither come from nor go to that format: its checkpoints "
            f"sample and evaluate as they are (llmtrain.generate, llmtrain.evaluate)"
        )
    if cfg.moe.num_experts:
        name = "mixtral"
    elif cfg.norm == "offset_rmsnorm":
        name = "gemma3_text"
    else:
        name = "qwen3" if cfg.qk_norm else "llama" if hf_llama.is_llama(cfg) else "gpt2"
    family = FAMILIES[name]
    if family is not GEMMA3 and any(cfg.sliding_window):
        raise ConfigError(
            f"model.sliding_window={list(cfg.sliding_window)}: {family.transformers_class}, the transformers class "
            f"this model would go to or come from, attends over the whole context in every block, so it would "
            f"compute another model (Gemma3ForCausalLM holds windows, beside all of Gemma 3's modules)"
        )
    family.check(cfg)
    return family


def hf_weights(path: str, cfg: GPTConfig) -> Callable[[str, torch.Tensor], None]:
    """The one-tensor-at-a-time reader of a Hugging Face directory (or hub name) for our model `cfg`
    (model.init_from); ConfigError when it holds another family or shape."""
    directory = local_hf_directory(path)
    family = family_of(cfg)
    held = _model_type(path, directory)
    if IMPORTED_AS[held] is not family:
        raise ConfigError(
            f"model.init_from={path} holds a {held} model but the model config is a {family.model_type}: choose a "
            f"{held} preset (e.g. {IMPORTED_AS[held].preset}) with the checkpoint's shape"
        )
    return family.weights(directory, cfg)


def hf_config_of(directory: str) -> GPTConfig:
    """Our config of the model a Hugging Face directory holds."""
    return IMPORTED_AS[_model_type(directory, directory)].config_of(directory)


def _model_type(path: str, directory: str) -> str:
    """config.json's model_type in `directory` (found as `path`), one of FAMILIES (ConfigError otherwise)."""
    config_file = os.path.join(directory, "config.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            described = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"model.init_from={path}: {config_file} is not a readable JSON file ({error})") from None
    model_type = described.get("model_type") if isinstance(described, dict) else None
    if model_type not in IMPORTED_AS:
        architectures = ", ".join((described.get("architectures") or []) if isinstance(described, dict) else [])
        raise ConfigError(
            f"model.init_from={path} holds a {model_type!r} model ({architectures or 'no architectures listed'}), "
            f"which llmtrain does not import: it imports {', '.join(IMPORTED_AS)}"
        )
    return model_type
