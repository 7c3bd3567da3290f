"""Our Qwen3-shaped GPT <-> Hugging Face `Qwen3ForCausalLM` (dense Qwen3): the Llama mapping (hf_llama.py), whose
table names the two tensors Llama has not,

  blocks.i.attn.q_norm, k_norm     model.layers.i.self_attn.q_norm, k_norm     (one RMSNorm weight of head_dim each)

and a head width of its own (`head_dim`: 128 in every dense Qwen3, whatever d_model / n_head is). No biases, no
sliding window (the dense releases use none), rotary base 1e6.
"""

from __future__ import annotations

from llmtrain.errors import ConfigError
from llmtrain.model.gpt import GPTConfig
from llmtrain.model.hf_llama import LLAMA_SHAPE_KEYS, LlamaWeights, config_from_llama_like, is_llama


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

    return Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_size,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,  # type: ignore[call-arg]  # transformers 5 folds it into rope_parameters
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        use_sliding_window=False,
        attention_dropout=cfg.attention_dropout,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )


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

    shape_keys = (*LLAMA_SHAPE_KEYS, "qk_norm")

    @staticmethod
    def config_of(directory: str) -> GPTConfig:
        return qwen3_config_of(directory)
