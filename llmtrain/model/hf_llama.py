"""Our Llama-family GPT (RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases) <-> Hugging Face
`LlamaForCausalLM`: the same network, rotary positions in transformers' half-split convention, so conversion is
renaming (no reshaping: both store nn.Linear weights):

  tok_emb                          model.embed_tokens          (our vocabulary padding rows dropped / zero-filled)
  blocks.i.attn_norm, mlp_norm     model.layers.i.input_layernorm, post_attention_layernorm
  blocks.i.attn.{q,k,v}_proj       model.layers.i.self_attn.{q,k,v}_proj
  blocks.i.attn.out_proj           model.layers.i.self_attn.o_proj
  blocks.i.mlp.fc_gate, fc_in      model.layers.i.mlp.gate_proj, up_proj
  blocks.i.mlp.fc_out              model.layers.i.mlp.down_proj
  norm, lm_head                    model.norm, lm_head         (lm_head only when the embeddings are untied)

Export converts a whole model; import (`LlamaWeights`, model.init_from) converts one tensor at a time as each rank
materialises its shards, reading the safetensors file lazily (llmtrain/model/hf_files.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmtrain.errors import ConfigError
from llmtrain.model.gpt import GPT, vocabulary_mask
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.hf_files import PRESET_REMEDY, check_same_shape, lazy_tensors, local_hf_directory
from llmtrain.model.rope import RopeScaling

_MODULES = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.out_proj": "self_attn.o_proj",
    "attn.q_norm": "self_attn.q_norm",  # Qwen3's (hf_qwen3.py)
    "attn.k_norm": "self_attn.k_norm",
    "mlp.fc_gate": "mlp.gate_proj",
    "mlp.fc_in": "mlp.up_proj",
    "mlp.fc_out": "mlp.down_proj",
}


def llama_blocks(cfg: GPTConfig) -> bool:
    """Llama's modules: an RMSNorm before each branch and none after, SwiGLU, no biases, embeddings unscaled,
    rotary positions in every block (one base), a query and key norm (where the model has them) over each head."""
    return (
        cfg.norm == "rmsnorm"
        and cfg.position == "rope"
        and cfg.mlp == "swiglu"
        and not cfg.bias
        and cfg.pre_norm
        and not cfg.sandwich_norm
        and not cfg.embedding_scale
        and cfg.rope_local_theta is None
        and all(cfg.layer_rotations)
        and cfg.qk_norm_scope == "head"
    )


def is_llama(cfg: GPTConfig, qk_norm: bool = False, qkv_bias: bool = False) -> bool:
    """Whether the model is one transformers' LlamaForCausalLM can hold (`qk_norm`: but with query and key norms,
    as Qwen3's class; `qkv_bias`: with the query, key and value projections' biases, as Qwen2's)."""
    return llama_blocks(cfg) and cfg.qk_norm == qk_norm and cfg.qkv_bias == qkv_bias


def hf_name(name: str) -> str:
    """The LlamaForCausalLM tensor our parameter `name` is."""
    if name.startswith("blocks."):
        _, layer, rest = name.split(".", 2)
        module, kind = rest.rsplit(".", 1)
        return f"model.layers.{layer}.{_MODULES[module]}.{kind}"
    return {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(name, name)


def decoder_fields(cfg: GPTConfig, eos_id: int) -> dict:
    """The transformers config fields every Llama-like decoder (Llama, Qwen3, Mixtral, Gemma 3) spells alike."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_size,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        attention_dropout=cfg.attention_dropout,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )


def llama_hf_config(cfg: GPTConfig, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        **decoder_fields(cfg, eos_id),
        rope_theta=cfg.rope_theta,  # type: ignore[call-arg]  # transformers 5 folds both into rope_parameters
        rope_scaling=hf_rope_scaling(cfg.rope_scaling),
        mlp_bias=False,
    )


def hf_rope_scaling(scaling: RopeScaling | None) -> dict | None:
    if scaling is None:
        return None
    if scaling.kind == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_seq_len,
    }


def to_llama_state_dict(model: GPT, name_of: Callable[[str], str] = hf_name) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's state dict from our whole model's (the vocabulary padding rows and mask dropped), or a
    class's whose names `name_of` gives."""
    cfg = model.cfg
    hf = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.bias" or (name == "lm_head.weight" and cfg.tie_embeddings):
            continue  # the padding mask; the tied head is the embedding
        if ".mlp.router." in name or ".mlp.experts." in name:
            continue  # a mixture's tensors: hf_mixtral.py maps them
        if name in ("tok_emb.weight", "lm_head.weight"):
            tensor = tensor[: cfg.vocab_size]
        hf[name_of(name)] = tensor.detach().cpu().clone()
    if cfg.tie_embeddings:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    return hf


def llama_config_of(path: str) -> GPTConfig:
    """The shape of the LlamaForCausalLM in directory `path` (its config.json), in our terms."""
    from transformers import LlamaConfig

    return config_from_llama_like(LlamaConfig.from_pretrained(path), path)


def rope_of(rope: dict, path: str, theta: float | None = None) -> tuple[float, RopeScaling | None]:
    """(base, scaling) of a transformers rope description (`rope_parameters`, or `rope_scaling` beside `theta`)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3", "linear"):
        raise ConfigError(
            f"model.init_from={path} uses rope_scaling of type {kind!r}, which llmtrain does not model (only Llama "
            f"3's 'llama3' and 'linear'): start from a checkpoint without it"
        )
    base = float(theta or rope["rope_theta"])
    if kind == "default":
        return base, None
    if kind == "linear":
        return base, RopeScaling(float(rope["factor"]), 1.0, 4.0, 8192, kind="linear")
    scaling = RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_seq_len=int(rope["original_max_position_embeddings"]),
    )
    return base, scaling


def decoder_shape(c) -> dict:
    """Our GPTConfig fields of a transformers decoder config that every Llama-like one (Llama, Qwen3, Mixtral,
    Gemma 3) spells alike."""
    return dict(
        vocab_size=c.vocab_size,
        n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        d_model=c.hidden_size,
        max_seq_len=c.max_position_embeddings,
        d_ff=c.intermediate_size,
        n_kv_head=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None),
        tie_embeddings=c.tie_word_embeddings,
        norm_eps=c.rms_norm_eps,
        bias=False,
        position="rope",
    )


def config_from_llama_like(c, path: str, **extra) -> GPTConfig:
    """Our config of a transformers config of the Llama family (Llama, Qwen3, Mixtral), plus `extra` fields."""
    # transformers 5 keeps the base and the scaling in rope_parameters; 4 has rope_theta and rope_scaling
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    theta, scaling = rope_of(rope, path, getattr(c, "rope_theta", None))
    return GPTConfig(**decoder_shape(c), norm="rmsnorm", mlp="swiglu", rope_theta=theta, rope_scaling=scaling, **extra)


LLAMA_SHAPE_KEYS = (
    "n_layer",
    "n_head",
    "kv_heads",
    "head_size",
    "d_model",
    "hidden",
    "vocab_size",
    "rope_theta",
    "rope_scaling",
    "norm_eps",
    "tie_embeddings",
)


class LlamaWeights:
    """Our parameters' values from a LlamaForCausalLM in Hugging Face format, one tensor at a time (as
    llmtrain/model/materialize.py asks). Raises ConfigError when its shape differs from the model config."""

    shape_keys: tuple[str, ...] = LLAMA_SHAPE_KEYS

    @staticmethod
    def config_of(directory: str) -> GPTConfig:
        return llama_config_of(directory)

    def __init__(self, path: str, cfg: GPTConfig):
        directory = local_hf_directory(path)
        check_same_shape(path, cfg, self.config_of(directory), self.shape_keys, PRESET_REMEDY)
        self.cfg = cfg
        self._keys, self._read = lazy_tensors(directory)

    def key_of(self, name: str) -> str:
        """The checkpoint's tensor that our parameter `name` is."""
        key = hf_name(name)
        if name == "lm_head.weight" and key not in self._keys:  # a tied checkpoint keeps the head as the embedding
            key = "model.embed_tokens.weight"
        return key

    def __call__(self, name: str, full: torch.Tensor) -> None:
        cfg = self.cfg
        if name == "lm_head.bias":
            full.copy_(vocabulary_mask(cfg))
            return
        tensor = self._read(self.key_of(name))
        if name in ("tok_emb.weight", "lm_head.weight"):  # our vocabulary padding rows stay zero
            tensor = torch.cat([tensor, tensor.new_zeros(cfg.padded_vocab_size - cfg.vocab_size, cfg.d_model)])
        full.copy_(tensor)
