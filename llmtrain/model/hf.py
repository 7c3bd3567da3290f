"""The Hugging Face formats llmtrain converts to and from. A model family's row (llmtrain/catalog/models.py) names
its HFFormats: the GPT's are GPT-2, Llama, Qwen3, Mixtral, Qwen3-MoE, Gemma 3, Qwen2, Mistral, SmolLM3 and OLMo 2,
each format's module (hf_gpt2.py, hf_llama.py, hf_qwen3.py, ...) knowing its tensor names and its config.
This one picks the format of a model config or of a directory, and is what model.init_from, export and sampling
call."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from llmtrain.catalog import MODEL_FAMILIES, imported, model_family
from llmtrain.errors import ConfigError
from llmtrain.model import (
    hf_gemma3,
    hf_gpt2,
    hf_llama,
    hf_mistral,
    hf_mixtral,
    hf_olmo2,
    hf_qwen2,
    hf_qwen3,
    hf_qwen3_moe,
    hf_smollm3,
)
from llmtrain.model.gpt import GPT
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.hf_files import local_hf_directory


class WeightsReader(Protocol):
    """A format's reader of a Hugging Face directory for our model config `cfg`, one tensor at a time (as
    llmtrain/model/materialize.py asks); made, it has checked that the two agree on `shape_keys` (GPTConfig
    fields or properties)."""

    shape_keys: tuple[str, ...]

    def __init__(self, path: str, cfg: GPTConfig) -> None: ...

    def __call__(self, name: str, full: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class HFFormat:
    """One transformers class a family's model converts to and from."""

    model_type: str  # config.json's model_type
    transformers_class: str  # the transformers model that holds it
    preset: str  # a conf/model preset of the family
    check: Callable[[GPTConfig], None]  # ConfigError unless transformers_class can hold the model
    config_of: Callable[[str], GPTConfig]  # our config of a directory of this family
    weights: type[WeightsReader]
    hf_config: Callable[[GPTConfig, int], Any]  # the transformers config of our model (and an eos id)
    state_dict: Callable[[GPT], dict[str, torch.Tensor]]  # the transformers state dict of our whole model


GEMMA3 = HFFormat(
    "gemma3_text",
    "Gemma3ForCausalLM",
    "model=gemma3-1b",
    hf_gemma3.check_gemma3,
    hf_gemma3.gemma3_config_of,
    hf_gemma3.Gemma3Weights,
    hf_gemma3.gemma3_hf_config,
    hf_gemma3.to_gemma3_state_dict,
)

FORMATS = {
    family.model_type: family
    for family in (
        HFFormat(
            "gpt2",
            "GPT2LMHeadModel",
            "model=gpt2",
            hf_gpt2.check_gpt2,
            hf_gpt2.gpt_config_of,
            hf_gpt2.GPT2Weights,
            hf_gpt2.hf_config,
            hf_gpt2.to_hf_state_dict,
        ),
        HFFormat(
            "llama",
            "LlamaForCausalLM",
            "model=smollm2-135m",
            lambda cfg: None,
            hf_llama.llama_config_of,
            hf_llama.LlamaWeights,
            hf_llama.llama_hf_config,
            hf_llama.to_llama_state_dict,
        ),
        HFFormat(
            "qwen3",
            "Qwen3ForCausalLM",
            "model=qwen3-0.6b",
            hf_qwen3.check_qwen3,
            hf_qwen3.qwen3_config_of,
            hf_qwen3.Qwen3Weights,
            hf_qwen3.qwen3_hf_config,
            hf_llama.to_llama_state_dict,
        ),
        HFFormat(
            "mixtral",
            "MixtralForCausalLM",
            "model=mixtral-tiny",
            hf_mixtral.check_mixtral,
            hf_mixtral.mixtral_config_of,
            hf_mixtral.MixtralWeights,
            hf_mixtral.mixtral_hf_config,
            hf_mixtral.to_mixtral_state_dict,
        ),
        HFFormat(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "model=qwen3-moe-tiny",
            hf_qwen3_moe.check_qwen3_moe,
            hf_qwen3_moe.qwen3_moe_config_of,
            hf_qwen3_moe.Qwen3MoeWeights,
            hf_qwen3_moe.qwen3_moe_hf_config,
            hf_mixtral.to_mixtral_state_dict,
        ),
        GEMMA3,
        HFFormat(
            "qwen2",
            "Qwen2ForCausalLM",
            "model=qwen2.5-1.5b",
            hf_qwen2.check_qwen2,
            hf_qwen2.qwen2_config_of,
            hf_qwen2.Qwen2Weights,
            hf_qwen2.qwen2_hf_config,
            hf_llama.to_llama_state_dict,
        ),
        HFFormat(
            "mistral",
            "MistralForCausalLM",
            "model=mistral-tiny",
            hf_mistral.check_mistral,
            hf_mistral.mistral_config_of,
            hf_mistral.MistralWeights,
            hf_mistral.mistral_hf_config,
            hf_llama.to_llama_state_dict,
        ),
        HFFormat(
            "smollm3",
            "SmolLM3ForCausalLM",
            "model=smollm3-3b",
            hf_smollm3.check_smollm3,
            hf_smollm3.smollm3_config_of,
            hf_smollm3.SmolLM3Weights,
            hf_smollm3.smollm3_hf_config,
            hf_llama.to_llama_state_dict,
        ),
        HFFormat(
            "olmo2",
            "Olmo2ForCausalLM",
            "model=olmo2-1b",
            hf_olmo2.check_olmo2,
            hf_olmo2.olmo2_config_of,
            hf_olmo2.Olmo2Weights,
            hf_olmo2.olmo2_hf_config,
            hf_olmo2.to_olmo2_state_dict,
        ),
    )
}
# Gemma 3's multimodal releases (4B and up): their text model is a Gemma3ForCausalLM's, read from inside them.
IMPORTED_AS = {**FORMATS, "gemma3": GEMMA3}


@dataclass(frozen=True)
class HFFormats:
    """A family's Hugging Face formats: those it reads by config.json's model_type, and the one a config of the
    family converts to (ConfigError naming the keys where none holds it)."""

    imported_as: dict[str, HFFormat]
    format_of: Callable[[GPTConfig], HFFormat]


def hf_format_of(cfg: GPTConfig) -> HFFormat:
    """The transformers format our model config converts to and from, checked to hold it; a family whose row names
    none refuses in one line."""
    reference = model_family(cfg.family).hf
    if reference is None:
        raise ConfigError(
            f"model.family={cfg.family} has no Hugging Face class (its row in llmtrain/catalog/models.py names none), "
            f"so its weights neither come from nor go to that format: its checkpoints sample and evaluate as they are "
            f"(llmtrain.generate, llmtrain.evaluate)"
        )
    formats: HFFormats = imported(reference)
    return formats.format_of(cfg)


def gpt_format_of(cfg: GPTConfig) -> HFFormat:
    """The GPT's format of `cfg` (a mixture: Qwen3-MoE with query and key norms, else Mixtral; Gemma's offset
    norms: Gemma 3; norms after the branches alone: OLMo 2; query, key and value biases: Qwen2; unrotated blocks:
    SmolLM3; query and key norms: Qwen3; RMSNorm + RoPE + SwiGLU: Mistral with one window in every block, else
    Llama; else GPT-2), checked to fit its transformers class (ConfigError naming the keys that do not)."""
    if cfg.moe.num_experts:
        name = "qwen3_moe" if cfg.qk_norm else "mixtral"
    elif cfg.norm == "offset_rmsnorm":
        name = "gemma3_text"
    elif not cfg.pre_norm:
        name = "olmo2"
    elif cfg.qkv_bias:
        name = "qwen2"
    elif cfg.position == "rope" and not all(cfg.layer_rotations):
        name = "smollm3"
    elif cfg.qk_norm:
        name = "qwen3"
    elif hf_llama.is_llama(cfg):
        name = "mistral" if any(cfg.sliding_window) else "llama"
    else:
        name = "gpt2"
    chosen = FORMATS[name]
    if chosen not in (GEMMA3, FORMATS["mistral"]) and any(cfg.sliding_window):
        raise ConfigError(
            f"model.sliding_window={list(cfg.sliding_window)}: {chosen.transformers_class}, the transformers class "
            f"this model would go to or come from, attends over the whole context in every block, so it would "
            f"compute another model (Gemma3ForCausalLM holds windows, beside all of Gemma 3's modules)"
        )
    chosen.check(cfg)
    return chosen


GPT_FORMATS = HFFormats(IMPORTED_AS, gpt_format_of)


def hf_weights(path: str, cfg: GPTConfig) -> Callable[[str, torch.Tensor], None]:
    """The one-tensor-at-a-time reader of a Hugging Face directory (or hub name) for our model `cfg`
    (model.init_from); ConfigError when it holds another family or shape."""
    directory = local_hf_directory(path)
    wanted = hf_format_of(cfg)
    _, held = _model_type(path, directory)
    found = _readers()[held][1]
    if found is not wanted:
        raise ConfigError(
            f"model.init_from={path} holds a {held} model but the model config is a {wanted.model_type}: leave "
            f"model= out to take the model from its config.json, or choose a {held} preset (e.g. {found.preset}) "
            f"with the checkpoint's shape"
        )
    return wanted.weights(directory, cfg)


def hf_config_of(directory: str) -> GPTConfig:
    """Our config of the model a Hugging Face directory holds, of the family whose formats read it."""
    return hf_model_at(directory)[0]


def hf_model_at(directory: str) -> tuple[GPTConfig, HFFormat]:
    """Our config of the model a Hugging Face directory holds (of the family whose formats read it), and the
    format that reads it."""
    family, model_type = _model_type(directory, directory)
    held = _readers()[model_type][1]
    return dataclasses.replace(held.config_of(directory), family=family), held


def _readers() -> dict[str, tuple[str, HFFormat]]:
    """config.json's model_type -> the family (model.family) that reads it and its format, over every family's row."""
    readers: dict[str, tuple[str, HFFormat]] = {}
    for name, row in MODEL_FAMILIES.items():
        if row.hf is not None:
            formats: HFFormats = imported(row.hf)
            readers.update({model_type: (name, held) for model_type, held in formats.imported_as.items()})
    return readers


def _model_type(path: str, directory: str) -> tuple[str, str]:
    """The family that reads `directory` (found as `path`) and its config.json's model_type (ConfigError where no
    family reads it)."""
    config_file = os.path.join(directory, "config.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            described = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"model.init_from={path}: {config_file} is not a readable JSON file ({error})") from None
    model_type = described.get("model_type") if isinstance(described, dict) else None
    readers = _readers()
    if model_type not in readers:
        architectures = ", ".join((described.get("architectures") or []) if isinstance(described, dict) else [])
        raise ConfigError(
            f"model.init_from={path} holds a {model_type!r} model ({architectures or 'no architectures listed'}), "
            f"which llmtrain does not import: it imports {', '.join(readers)}"
        )
    return readers[model_type][0], model_type
