"""Our Qwen2-shaped GPT <-> Hugging Face `Qwen2ForCausalLM` (Qwen2, Qwen2.5 and their distillations: DeepSeek-R1-
Distill-Qwen, Qwen2.5-Math): the Llama mapping (hf_llama.py) with the biases of the query, key and value
projections, which Llama has not,

  blocks.i.attn.{q,k,v}_proj.bias     model.layers.i.self_attn.{q,k,v}_proj.bias

(`model.qkv_bias`; the output projection and the MLP have none). The releases use no sliding window.
"""

from __future__ import annotations

from llmtrain.errors import ConfigError
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.hf_llama import (
    LLAMA_SHAPE_KEYS,
    LlamaWeights,
    config_from_llama_like,
    decoder_fields,
    is_llama,
)


def check_qwen2(cfg: GPTConfig) -> None:
    if not (is_llama(cfg, qkv_bias=True) and not cfg.moe.num_experts and not any(cfg.sliding_window)):
        raise ConfigError(
            f"query, key and value biases load from or export to Qwen2ForCausalLM only as a dense Llama-family "
            f"model with every block global (model.norm={cfg.norm}, model.mlp={cfg.mlp}, model.bias={cfg.bias}, "
            f"model.qk_norm={cfg.qk_norm}, model.moe.num_experts={cfg.moe.num_experts}): use "
            f"conf/model/qwen2.5-1.5b.yaml's settings"
        )


def qwen2_hf_config(cfg: GPTConfig, eos_id: int):
    from transformers import Qwen2Config

    return Qwen2Config(**decoder_fields(cfg, eos_id), rope_theta=cfg.rope_theta, use_sliding_window=False)  # type: ignore[call-arg]


def qwen2_config_of(path: str) -> GPTConfig:
    """The shape of the Qwen2ForCausalLM in directory `path` (its config.json), in our terms."""
    from transformers import Qwen2Config

    c = Qwen2Config.from_pretrained(path)
    if getattr(c, "use_sliding_window", False):
        raise ConfigError(
            f"model.init_from={path} is a Qwen2 with sliding windows (use_sliding_window), which the releases do not "
            f"use and llmtrain's Qwen2 does not model: start from a released Qwen2 or Qwen2.5"
        )
    return config_from_llama_like(c, path, qkv_bias=True)


class Qwen2Weights(LlamaWeights):
    """LlamaWeights with the query, key and value biases among the shape it checks (their tensors read by the
    Llama names)."""

    shape_keys: tuple[str, ...] = (*LLAMA_SHAPE_KEYS, "qkv_bias")

    @staticmethod
    def config_of(directory: str) -> GPTConfig:
        return qwen2_config_of(directory)
