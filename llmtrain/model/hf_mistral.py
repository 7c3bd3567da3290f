"""Our Mistral-shaped GPT <-> Hugging Face `MistralForCausalLM`: Llama's modules and tensor names (hf_llama.py), with
one sliding attention window for every block (Mistral 7B v0.1's 4,096 keys; v0.2 and later have none, and are
Llama-shaped: those export as LlamaForCausalLM, which computes the same). `model.sliding_window=[w]` here,
`sliding_window` there.
"""

from __future__ import annotations

from llmtrain.errors import ConfigError
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.hf_llama import LLAMA_SHAPE_KEYS, LlamaWeights, config_from_llama_like, decoder_fields, is_llama


def uniform_window(cfg: GPTConfig) -> int | None:
    """The window every block shares (None: every block global, or blocks that differ)."""
    windows = set(cfg.layer_windows)
    return windows.pop() if len(windows) == 1 else None


def check_mistral(cfg: GPTConfig) -> None:
    if not (is_llama(cfg) and not cfg.moe.num_experts and uniform_window(cfg) is not None):
        raise ConfigError(
            f"sliding windows load from or export to MistralForCausalLM only as a dense Llama-family model whose "
            f"blocks share one window (model.norm={cfg.norm}, model.mlp={cfg.mlp}, model.qk_norm={cfg.qk_norm}, "
            f"model.sliding_window={list(cfg.sliding_window)}): use conf/model/mistral-tiny.yaml's settings"
        )


def mistral_hf_config(cfg: GPTConfig, eos_id: int):
    from transformers import MistralConfig

    return MistralConfig(**decoder_fields(cfg, eos_id), rope_theta=cfg.rope_theta, sliding_window=uniform_window(cfg))  # type: ignore[call-arg]


def mistral_config_of(path: str) -> GPTConfig:
    """The shape of the MistralForCausalLM in directory `path` (its config.json), in our terms."""
    from transformers import MistralConfig

    c = MistralConfig.from_pretrained(path)
    windows = (c.sliding_window,) if c.sliding_window else ()
    return config_from_llama_like(c, path, sliding_window=windows)


class MistralWeights(LlamaWeights):
    """LlamaWeights with the blocks' windows among the shape it checks."""

    shape_keys: tuple[str, ...] = (*LLAMA_SHAPE_KEYS, "layer_windows")

    @staticmethod
    def config_of(directory: str) -> GPTConfig:
        return mistral_config_of(directory)
