"""A model with low-rank adapters, exported: merged into a model without them (`merged`), and the adapters alone in
PEFT's format (`save_peft_adapter`: `adapter_config.json` and `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base, directory)` puts onto the Hugging Face base model they were trained on).

PEFT names an adapter by the base's module path, `base_model.model.<module>.lora_A.weight` (our `lora_a`, rank x in)
and `...lora_B.weight` (our `lora_b`, out x rank), and scales its update by lora_alpha / r as we do. The Llama family
(Qwen3 too, and Mixtral's attention) keeps one module per projection, so each of our adapters is one of PEFT's;
GPT-2's fused, transposed `c_attn` has no such module for q, k and v apart, so its adapters are exported merged
only. A mixture's adapted experts go to PEFT's `target_parameters` on transformers' fused expert stacks
(`_expert_adapters`).
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
PEFT_FAMILIES = ("llama", "qwen3", "mixtral", "qwen3_moe", "qwen2", "mistral", "smollm3", "olmo2", "gemma3_text")
# A mixture's adapted experts -> the parameter of transformers' fused experts PEFT adapts (target_parameters), in
# the order PEFT nests their wrappers: the first named is the innermost (`experts.base_layer` when both are).
EXPERT_PARAMETERS = {"in": "gate_up_proj", "out": "down_proj"}
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
    parameters = _expert_adapters(model, tensors)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha,
        "lora_dropout": cfg.lora.dropout,
        "target_modules": sorted(adapted),
        **({"target_parameters": [f"mlp.experts.{name}" for name in parameters]} if parameters else {}),
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


def _expert_adapters(model: GPT, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Each block's adapted experts into `tensors` as PEFT's ParamWrapper holds them on transformers' fused stacks
    (E, out, in): A (E·r, in), its rows expert-major, and B (out, r·E), its columns rank-major, so that expert e's
    update is Σ_r B[:, r, e] A[e, r, :] (PEFT's ParamWrapper); the parameters adapted, in PEFT's order."""
    adapted = [
        side
        for side in EXPERT_PARAMETERS
        if any(isinstance(m, Experts) and getattr(m, f"{side}_lora_a") is not None for m in model.modules())
    ]
    for name, module in model.named_modules():
        if not isinstance(module, Experts):
            continue
        _, layer, _ = name.split(".", 2)  # blocks.<i>.mlp.experts
        hf_module = f"base_model.model.model.layers.{layer}.mlp.experts"
        for depth, side in enumerate(adapted):
            a, b = (getattr(module, f"{side}_lora_{factor}").detach() for factor in "ab")  # (E, in, r), (E, r, out)
            wrapper = hf_module + ".base_layer" * (len(adapted) - 1 - depth)
            tensors[f"{wrapper}.lora_A.weight"] = a.transpose(1, 2).reshape(-1, a.shape[1]).contiguous()
            tensors[f"{wrapper}.lora_B.weight"] = b.permute(2, 1, 0).reshape(b.shape[2], -1).contiguous()
    return [EXPERT_PARAMETERS[side] for side in adapted]


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
