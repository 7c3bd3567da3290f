"""Our Qwen3-shaped GPT <-> Hugging Face `Qwen3ForCausalLM` (dense Qwen3): the Llama mapping (hf_llama.py), whose
table names the two tensors Llama has not,

  blocks.i.attn.q_norm, k_norm     model.layers.i.self_attn.q_norm, k_norm     (one RMSNorm weight of head_dim each)

and a head width of its own (`head_dim`: 128 in every dense Qwen3, whatever d_model / n_head is). No biases, no
sliding window (the dense releases use none), rotary base 1e6.
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


def is_qwen3(cfg: GPTConfig) -> bool:
    """Whether transformers' Qwen3ForCausalLM can hold the model: the Llama family's modules with query and key
    norms, one dense MLP a block, every block global."""
    return is_llama(cfg, qk_norm=True) and not cfg.moe.num_experts and not cfg.sliding_window


def check_qwen3(cfg: GPTConfig) -> None:
    if not is_qwen3(cfg):
        raise ConfigError(
            f"query and key norms load from or export to Qwen3ForCausalLM only as a dense Llama-family model with "
            f"every block global (model.norm={cfg.norm}, model.mlp={cfg.mlp}, model.bias={cfg.bias}, "
            f"model.moe.num_experts={cfg.moe.num_experts}, model.sliding_window={list(cfg.sliding_window)}): use "
            f"conf/model/qwen3-0.6b.yaml's settings"
        )


def qwen3_hf_config(cfg: GPTConfig, eos_id: int):
    from transformers import Qwen3Config

    fields = decoder_fields(cfg, eos_id)
    # transformers 5 folds rope_theta into rope_parameters
    return Qwen3Config(**fields, rope_theta=cfg.rope_theta, use_sliding_window=False)  # type: ignore[call-arg]


def qwen3_config_of(path: str) -> GPTConfig:
    """The shape of the Qwen3ForCausalLM in directory `path` (its config.json), in our terms."""
    from transformers import Qwen3Config

    c = Qwen3Config.from_pretrained(path)
    if c.attention_bias or getattr(c, "use_sliding_window", False):
        raise ConfigError(
            f"model.init_from={path} is a Qwen3 with attention biases or sliding windows, which the dense releases "
            f"do not use and llmtrain's Qwen3 does not model: start from a released dense Qwen3"
        )
    return config_from_llama_like(c, path, qk_norm=True)


class Qwen3Weights(LlamaWeights):
    """LlamaWeights with the query and key norms among the shape it checks."""

    shape_keys: tuple[str, ...] = (*LLAMA_SHAPE_KEYS, "qk_norm")

    @staticmethod
    def config_of(directory: str) -> GPTConfig:
        return qwen3_config_of(directory)
