"""A model with low-rank adapters, exported: merged into a model without them (`merged`), and the adapters alone in
PEFT's format (`save_peft_adapter`: `adapter_config.json` and `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base, directory)` puts onto the Hugging Face base model they were trained on).

PEFT names an adapter by the base's module path, `base_model.model.<module>.lora_A.weight` (our `lora_a`, rank x in)
and `...lora_B.weight` (our `lora_b`, out x rank), and scales its update by lora_alpha / r as we do. The Llama family
(Qwen3 too, and Mixtral's attention) keeps one module per projection, so each of our adapters is one of PEFT's;
GPT-2's fused, transposed `c_attn` has no such module for q, k and v apart, so its adapters are exported merged
only.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import torch

from llmtrain.catalog import LORA_TARGETS
from llmtrain.errors import ConfigError
from llmtrain.model.gpt import GPT
from llmtrain.model.hf import hf_format_of
from llmtrain.model.hf_llama import hf_name
from llmtrain.model.lora import ADAPTERS, LoRAConfig, LoRALinear, is_adapter
from llmtrain.model.moe import Experts
from llmtrain.model.quantize import dequantized

# The Hugging Face families whose adapters PEFT can hold as we train them.
PEFT_FAMILIES = ("llama", "qwen3", "mixtral")
# Our adapter's name -> PEFT's, after the module path.
PEFT_ADAPTERS = dict(zip(ADAPTERS, ("lora_A.weight", "lora_B.weight")))


def save_peft_adapter(model: GPT, base: str | None, directory: str) -> None:
    """Write `model`'s adapters in PEFT's format into `directory`; `base`: the Hugging Face model they adapt (its
    directory or hub name, as PEFT records it)."""
    from safetensors.torch import save_file

    cfg = model.cfg
    family = hf_format_of(cfg).model_type
    if family not in PEFT_FAMILIES:
        raise ConfigError(
            f"a {family} model's adapters have no PEFT form (its q, k and v are one fused, transposed layer in "
            f"transformers): export the merged model"
        )
    tensors, adapted = {}, set()
    for name, tensor in model.state_dict().items():
        module, _, kind = name.rpartition(".")
        if kind in PEFT_ADAPTERS:
            hf_module = hf_name(f"{module}.weight").removesuffix(".weight")
            tensors[f"base_model.model.{hf_module}.{PEFT_ADAPTERS[kind]}"] = tensor.detach().contiguous().clone()
            adapted.add(LORA_TARGETS[module.rpartition(".")[2]])
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha,
        "lora_dropout": cfg.lora.dropout,
        "target_modules": sorted(adapted),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def merged(model: GPT) -> GPT:
    """The same model (of its family) without adapters: each adapted layer's weight is W + (alpha / rank) B A, and
    each adapted expert's (an NF4 base dequantised: the model exported computes what the trained one did)."""
    plain = type(model)(replace(model.cfg, lora=LoRAConfig(), quantize_base="none"))
    state = {name: dequantized(t) for name, t in model.state_dict().items() if not is_adapter(name)}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                state[f"{name}.weight"] = module.merged_weight()
            elif isinstance(module, Experts):  # NF4 stacks as (E, in, out), each with its adapters' update
                for attribute in ("w_in", "w_gate", "w_out"):
                    if getattr(module, attribute) is not None:
                        state[f"{name}.{attribute}"] = module.merged(attribute)
    plain.load_state_dict(state)
    return plain.eval()
