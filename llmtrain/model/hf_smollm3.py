"""Our SmolLM3-shaped GPT <-> Hugging Face `SmolLM3ForCausalLM`: Llama's modules and tensor names (hf_llama.py), with
blocks that leave their queries and keys unrotated (NoPE; every fourth in the releases): `model.rope_layers` here,
`no_rope_layers` there (1: the block rotates). The releases use no sliding window and no biases.
"""

from __future__ import annotations

import dataclasses

from llmtrain.errors import ConfigError
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.hf_llama import LLAMA_SHAPE_KEYS, LlamaWeights, config_from_llama_like, decoder_fields, llama_blocks


def is_smollm3(cfg: GPTConfig) -> bool:
    """Llama's modules with some blocks unrotated, dense, every block global."""
    rotating = cfg.position == "rope" and not all(cfg.layer_rotations)
    llama_otherwise = llama_blocks(dataclasses.replace(cfg, rope_layers=()))
    plain = not (cfg.qk_norm or cfg.qkv_bias or cfg.moe.num_experts or any(cfg.sliding_window))
    return rotating and llama_otherwise and plain


def check_smollm3(cfg: GPTConfig) -> None:
    if not is_smollm3(cfg):
        raise ConfigError(
            f"blocks without rotary positions (model.rope_layers={list(cfg.rope_layers)}) load from or export to "
            f"SmolLM3ForCausalLM only as a dense Llama-family model with every block global (model.norm={cfg.norm}, "
            f"model.mlp={cfg.mlp}, model.qk_norm={cfg.qk_norm}): use conf/model/smollm3-3b.yaml's settings"
        )


def smollm3_hf_config(cfg: GPTConfig, eos_id: int):
    from transformers import SmolLM3Config

    return SmolLM3Config(  # type: ignore[call-arg]
        **decoder_fields(cfg, eos_id),
        rope_theta=cfg.rope_theta,
        no_rope_layers=[int(rotates) for rotates in cfg.layer_rotations],
        use_sliding_window=False,
        mlp_bias=False,
        pad_token_id=None,  # its default is the release's (128,004), beyond a smaller vocabulary
    )


def smollm3_config_of(path: str) -> GPTConfig:
    """The shape of the SmolLM3ForCausalLM in directory `path` (its config.json), in our terms."""
    from transformers import SmolLM3Config

    c = SmolLM3Config.from_pretrained(path)
    if c.attention_bias or c.mlp_bias or c.use_sliding_window:
        raise ConfigError(
            f"model.init_from={path} is a SmolLM3 with biases or sliding windows, which the releases do not use and "
            f"llmtrain's SmolLM3 does not model: start from a released SmolLM3"
        )
    return config_from_llama_like(c, path, rope_layers=tuple(int(r) for r in c.no_rope_layers or ()))


class SmolLM3Weights(LlamaWeights):
    """LlamaWeights with the blocks that rotate among the shape it checks."""

    shape_keys: tuple[str, ...] = (*LLAMA_SHAPE_KEYS, "layer_rotations")

    @staticmethod
    def config_of(directory: str) -> GPTConfig:
        return smollm3_config_of(directory)
