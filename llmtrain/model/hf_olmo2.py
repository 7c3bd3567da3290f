"""Our OLMo-2-shaped GPT <-> Hugging Face `Olmo2ForCausalLM`: Llama's attention and SwiGLU, but each block normalises
its branches' outputs rather than their inputs (x + norm(attn(x)), then x + norm(mlp(x)): `model.pre_norm=false
model.sandwich_norm=true`), and the query and key projections are normalised whole, every head together, before
the heads are split (`model.qk_norm_scope=projection`):

  blocks.i.attn_post_norm, mlp_post_norm   model.layers.i.post_attention_layernorm, post_feedforward_layernorm
  blocks.i.attn.q_norm, k_norm             model.layers.i.self_attn.q_norm, k_norm   (n_head (n_kv_head) x head_dim)

and the rest by Llama's names (hf_llama.py).
"""

from __future__ import annotations

import torch

from llmtrain.errors import ConfigError
from llmtrain.model.gpt import GPT
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.hf_llama import (
    LLAMA_SHAPE_KEYS,
    LlamaWeights,
    config_from_llama_like,
    decoder_fields,
    hf_name,
    to_llama_state_dict,
)

# Our modules OLMo 2 names otherwise than Llama does.
_POST_NORMS = {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}


def olmo2_hf_name(name: str) -> str:
    """The Olmo2ForCausalLM tensor our parameter `name` is."""
    if name.startswith("blocks."):
        _, layer, rest = name.split(".", 2)
        module, kind = rest.rsplit(".", 1)
        if module in _POST_NORMS:
            return f"model.layers.{layer}.{_POST_NORMS[module]}.{kind}"
    return hf_name(name)


def is_olmo2(cfg: GPTConfig) -> bool:
    """OLMo 2's modules: RMSNorm on each branch's output alone, whole-projection query and key norms, rotary
    positions in every block, SwiGLU, no biases, dense, every block global."""
    modules = cfg.norm == "rmsnorm" and cfg.position == "rope" and cfg.mlp == "swiglu" and not cfg.bias
    norms = not cfg.pre_norm and cfg.sandwich_norm and cfg.qk_norm and cfg.qk_norm_scope == "projection"
    plain = not (cfg.qkv_bias or cfg.embedding_scale or cfg.moe.num_experts or any(cfg.sliding_window))
    return modules and norms and plain and all(cfg.layer_rotations) and cfg.rope_local_theta is None


def check_olmo2(cfg: GPTConfig) -> None:
    if not is_olmo2(cfg):
        raise ConfigError(
            f"norms on the branches' outputs alone (model.pre_norm=false) load from or export to Olmo2ForCausalLM only "
            f"with all of OLMo 2's choices (model.norm=rmsnorm, mlp=swiglu, sandwich_norm, qk_norm over the "
            f"projection, no bias, dense, every block global; this model: norm={cfg.norm}, mlp={cfg.mlp}, "
            f"sandwich_norm={cfg.sandwich_norm}, qk_norm={cfg.qk_norm} over the {cfg.qk_norm_scope}): use "
            f"conf/model/olmo2-1b.yaml's settings"
        )


def olmo2_hf_config(cfg: GPTConfig, eos_id: int):
    from transformers import Olmo2Config

    return Olmo2Config(**decoder_fields(cfg, eos_id), rope_theta=cfg.rope_theta)  # type: ignore[call-arg]


def olmo2_config_of(path: str) -> GPTConfig:
    """The shape of the Olmo2ForCausalLM in directory `path` (its config.json), in our terms."""
    from transformers import Olmo2Config

    c = Olmo2Config.from_pretrained(path)
    if c.attention_bias:
        raise ConfigError(
            f"model.init_from={path} is an OLMo 2 with attention biases, which the releases do not use and "
            f"llmtrain's OLMo 2 does not model: start from a released OLMo 2"
        )
    return config_from_llama_like(c, path, pre_norm=False, sandwich_norm=True, qk_norm=True, qk_norm_scope="projection")


def to_olmo2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Olmo2ForCausalLM's state dict from our whole model's (the vocabulary padding rows and mask dropped)."""
    return to_llama_state_dict(model, olmo2_hf_name)


class Olmo2Weights(LlamaWeights):
    """LlamaWeights with OLMo 2's norms: after each branch, and over the whole query and key projections."""

    shape_keys: tuple[str, ...] = (*LLAMA_SHAPE_KEYS, "pre_norm", "qk_norm_scope")

    @staticmethod
    def config_of(directory: str) -> GPTConfig:
        return olmo2_config_of(directory)

    def key_of(self, name: str) -> str:
        key = olmo2_hf_name(name)
        if name == "lm_head.weight" and key not in self._keys:
            key = "model.embed_tokens.weight"
        return key
