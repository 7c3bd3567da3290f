"""Our Gemma-3-shaped GPT <-> Hugging Face `Gemma3ForCausalLM` (Gemma 3's text model):

  tok_emb                                 model.embed_tokens     (times sqrt(d_model) in the forward, both sides)
  blocks.i.attn_norm, attn_post_norm      model.layers.i.input_layernorm, post_attention_layernorm
  blocks.i.mlp_norm, mlp_post_norm        model.layers.i.pre_feedforward_layernorm, post_feedforward_layernorm
  blocks.i.attn.{q,k,v}_proj, out_proj    model.layers.i.self_attn.{q,k,v}_proj, o_proj
  blocks.i.attn.q_norm, k_norm            model.layers.i.self_attn.q_norm, k_norm
  blocks.i.mlp.fc_gate, fc_in, fc_out     model.layers.i.mlp.gate_proj, up_proj, down_proj
  norm                                    model.norm             (the head is tied to the embedding)

Every norm is Gemma's (1 + w) RMSNorm, stored as w on both sides. Gemma 3 interleaves sliding-window blocks (five to
one global in the releases) with their own rotary base (1e4, unscaled) beside the global blocks' (1e6; 4B and up
stretched linearly by 8): `model.sliding_window` and `model.rope_local_theta` here, `layer_types` and the
per-layer-type `rope_parameters` there. The multimodal releases (4B and up) keep the text model's tensors under
`language_model` (transformers 5: model.language_model.layers.i...; earlier: language_model.model.layers.i...),
which import finds; their config's `text_config` is the text model's.
"""

from __future__ import annotations

import json
import os
from typing import Any

from llmtrain.errors import ConfigError
from llmtrain.model.gpt import GPT
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.hf_llama import (
    LLAMA_SHAPE_KEYS,
    LlamaWeights,
    decoder_fields,
    decoder_shape,
    hf_rope_scaling,
    rope_of,
)

_MODULES = {
    "attn_norm": "input_layernorm",
    "attn_post_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "mlp_post_norm": "post_feedforward_layernorm",
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.out_proj": "self_attn.o_proj",
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
    "mlp.fc_gate": "mlp.gate_proj",
    "mlp.fc_in": "mlp.up_proj",
    "mlp.fc_out": "mlp.down_proj",
}
# Where the multimodal releases keep the text model's tensors, for a text model's "model." prefix.
_TEXT_MODEL_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def gemma3_hf_name(name: str) -> str:
    """The Gemma3ForCausalLM tensor our parameter `name` is."""
    if name.startswith("blocks."):
        _, layer, rest = name.split(".", 2)
        module, kind = rest.rsplit(".", 1)
        return f"model.layers.{layer}.{_MODULES[module]}.{kind}"
    return {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(name, name)


def sliding_window_of(cfg: GPTConfig) -> int | None:
    """The one window every sliding block of the model has (Gemma 3's config holds one); None if none has one."""
    windows = {window for window in cfg.layer_windows if window is not None}
    return windows.pop() if len(windows) == 1 else None


def is_gemma3(cfg: GPTConfig) -> bool:
    """Whether transformers' Gemma3ForCausalLM can hold the model."""
    gemma_modules = (
        cfg.norm == "offset_rmsnorm"
        and cfg.position == "rope"
        and cfg.mlp == "geglu"
        and not cfg.bias
        and cfg.qk_norm
        and cfg.sandwich_norm
        and cfg.embedding_scale
        and cfg.tie_embeddings
        and cfg.pre_norm
        and cfg.qk_norm_scope == "head"
        and not cfg.qkv_bias
        and all(cfg.layer_rotations)
    )
    one_window = sliding_window_of(cfg) is not None or not cfg.sliding_window
    return gemma_modules and one_window and not cfg.moe.num_experts


def check_gemma3(cfg: GPTConfig) -> None:
    if not is_gemma3(cfg):
        raise ConfigError(
            f"a model with Gemma's norms loads from or exports to Gemma3ForCausalLM only with all of Gemma 3's choices "
            f"(model.norm=offset_rmsnorm, mlp=geglu, qk_norm, sandwich_norm, embedding_scale, tie_embeddings, no "
            f"bias, one window size, no experts; this model: norm={cfg.norm}, mlp={cfg.mlp}, "
            f"windows={sorted({w for w in cfg.layer_windows if w})}): use conf/model/gemma3-1b.yaml's settings"
        )


def gemma3_hf_config(cfg: GPTConfig, eos_id: int):
    from transformers import Gemma3TextConfig

    local_theta = cfg.rope_local_theta or cfg.rope_theta
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(hf_rope_scaling(cfg.rope_scaling) or {})}
    return Gemma3TextConfig(
        **decoder_fields(cfg, eos_id),
        query_pre_attn_scalar=cfg.head_size,
        sliding_window=sliding_window_of(cfg) or cfg.max_seq_len,
        layer_types=["full_attention" if w is None else "sliding_attention" for w in cfg.layer_windows],
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        hidden_activation="gelu_pytorch_tanh",
    )


def gemma3_config_of(path: str) -> GPTConfig:
    """The shape of the Gemma 3 text model in directory `path` (a text release's config.json, or a multimodal one's
    text_config), in our terms."""
    from transformers import Gemma3Config, Gemma3TextConfig

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        multimodal = json.load(f).get("model_type") == "gemma3"
    c: Any = Gemma3Config.from_pretrained(path).text_config if multimodal else Gemma3TextConfig.from_pretrained(path)
    unmodelled = {
        "query_pre_attn_scalar": c.query_pre_attn_scalar if c.query_pre_attn_scalar != c.head_dim else None,
        "final_logit_softcapping": c.final_logit_softcapping,
        "attn_logit_softcapping": c.attn_logit_softcapping,
        "use_bidirectional_attention": c.use_bidirectional_attention or None,
    }
    named = [f"{key}={value}" for key, value in unmodelled.items() if value is not None]
    if named or c.hidden_activation != "gelu_pytorch_tanh":
        raise ConfigError(
            f"model.init_from={path} is a Gemma 3 with {', '.join(named) or c.hidden_activation}, which llmtrain's "
            f"Gemma 3 does not model (the 1B and 4B releases have none): start from one of those"
        )
    rope = c.rope_parameters
    theta, scaling = rope_of(rope["full_attention"], path)
    local_theta, _ = rope_of(rope["sliding_attention"], path)
    return GPTConfig(
        **decoder_shape(c),
        norm="offset_rmsnorm",
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        mlp="geglu",
        qk_norm=True,
        sandwich_norm=True,
        embedding_scale=True,
        sliding_window=tuple(c.sliding_window if kind == "sliding_attention" else 0 for kind in c.layer_types),
    )


def to_gemma3_state_dict(model: GPT) -> dict:
    """Gemma3ForCausalLM's state dict from our whole model's (the vocabulary padding rows and mask dropped)."""
    cfg = model.cfg
    hf = {}
    for name, tensor in model.state_dict().items():
        if name in ("lm_head.bias", "lm_head.weight"):
            continue  # the padding mask; the head is the embedding
        if name == "tok_emb.weight":
            tensor = tensor[: cfg.vocab_size]
        hf[gemma3_hf_name(name)] = tensor.detach().cpu().clone()
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    return hf


class Gemma3Weights(LlamaWeights):
    """Our parameters' values from a Gemma 3 text model (a text release, or a multimodal one's language model),
    one tensor at a time; ConfigError when its shape differs from the model config."""

    shape_keys: tuple[str, ...] = (
        *(key for key in LLAMA_SHAPE_KEYS if key != "tie_embeddings"),
        "rope_local_theta",
        "layer_windows",
    )

    @staticmethod
    def config_of(directory: str) -> GPTConfig:
        return gemma3_config_of(directory)

    def key_of(self, name: str) -> str:
        key = gemma3_hf_name("tok_emb.weight" if name == "lm_head.weight" else name)
        inner = key.removeprefix("model.")
        for prefix in _TEXT_MODEL_PREFIXES:
            if prefix + inner in self._keys:
                return prefix + inner
        return key
