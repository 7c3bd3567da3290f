"""Random-weight transformers models of every family llmtrain imports, at tiny custom sizes no preset names, saved
as a user's checkpoint directory is: the one table the released-family tests run over."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

VOCAB = 257
# Logits of our model against transformers' in fp32 (measured: 1e-6)
LOGIT_ATOL = 1e-5
# Every weight moved by this much noise: transformers starts norms at one and biases and routers at zero, where a
# tensor read into the wrong place would not show.
SPREAD = 0.05

# What the tiny configs share: two blocks of width 64, 4 query heads sharing 2 key/value heads, rotary base 1e4;
# each family's row says what it changes.
_DECODER = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
)


@dataclass(frozen=True)
class HFFamily:
    """One transformers causal LM: its classes' names and a tiny config of it (no preset of ours has its shape)."""

    config_class: str
    model_class: str
    config: dict = field(default_factory=dict)


HF_FAMILIES = {
    "gpt2": HFFamily("GPT2Config", "GPT2LMHeadModel", dict(n_positions=128, n_embd=64, n_layer=2, n_head=4)),
    "llama": HFFamily("LlamaConfig", "LlamaForCausalLM", {**_DECODER, "tie_word_embeddings": False}),
    "qwen3": HFFamily("Qwen3Config", "Qwen3ForCausalLM", {**_DECODER, "head_dim": 32, "tie_word_embeddings": True}),
    "mixtral": HFFamily(
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            **_DECODER,
            "intermediate_size": 48,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": False,
        },
    ),  # fmt: skip
    "qwen3_moe": HFFamily(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **_DECODER,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
    ),  # fmt: skip
    "gemma3_text": HFFamily(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            **_DECODER,
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),  # fmt: skip
    "qwen2": HFFamily("Qwen2Config", "Qwen2ForCausalLM", {**_DECODER, "tie_word_embeddings": True}),
    "mistral": HFFamily(
        "MistralConfig",
        "MistralForCausalLM",
        {**_DECODER, "head_dim": 16, "sliding_window": 8, "tie_word_embeddings": False},
    ),
    "smollm3": HFFamily(
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        {
            **_DECODER,
            "num_hidden_layers": 4,
            "no_rope_layer_interval": 4,
            "pad_token_id": None,
            "tie_word_embeddings": True,
        },
    ),  # fmt: skip
    "olmo2": HFFamily("Olmo2Config", "Olmo2ForCausalLM", {**_DECODER, "tie_word_embeddings": False}),
}


def hf_model(model_type: str, **shape) -> torch.nn.Module:
    """A random transformers model of `model_type` (HF_FAMILIES' config, with `shape` over it), every weight spread,
    in eval mode."""
    import transformers

    family = HF_FAMILIES[model_type]
    config = getattr(transformers, family.config_class)(**{"vocab_size": VOCAB, **family.config, **shape})
    torch.manual_seed(0)
    model = getattr(transformers, family.model_class)(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * SPREAD)
    return model


def saved_hf_model(directory: Path, model_type: str, **shape) -> torch.nn.Module:
    """hf_model(model_type, **shape), saved to `directory` as save_pretrained writes it."""
    model = hf_model(model_type, **shape)
    model.save_pretrained(directory)
    return model
