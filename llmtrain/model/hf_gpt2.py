"""Our GPT <-> Hugging Face `GPT2LMHeadModel`: the same network (pre-LayerNorm blocks, tanh GELU = HF's
"gelu_new", learned positions, tied head), so conversion is renaming and reshaping:

  tok_emb / pos_emb              transformer.wte / wpe       (our vocabulary padding rows dropped / zero-filled)
  blocks.i.attn_norm, mlp_norm   transformer.h.i.ln_1, ln_2
  blocks.i.attn.{q,k,v}_proj     transformer.h.i.attn.c_attn (one fused matrix)
  blocks.i.attn.out_proj         transformer.h.i.attn.c_proj
  blocks.i.mlp.fc_in, fc_out     transformer.h.i.mlp.c_fc, c_proj
  norm                           transformer.ln_f
HF's Conv1D stores weights as (in, out), the transpose of nn.Linear's.

Export converts a whole model (`to_hf_state_dict`, one process); import (`GPT2Weights`, model.init_from) converts
one parameter at a time as each rank materialises its shards, reading the safetensors file lazily.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmtrain.errors import ConfigError
from llmtrain.model.gpt import GPT, vocabulary_mask
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.hf_files import PRESET_REMEDY, check_same_shape, lazy_tensors, local_hf_directory


def check_gpt2(cfg: GPTConfig) -> None:
    """A ConfigError unless GPT2LMHeadModel can hold the model: LayerNorm before each branch alone, learned
    positions, GELU, a tied head, biases wherever it has any, no query and key norms."""
    gpt2_modules = cfg.norm == "layernorm" and cfg.position == "learned" and cfg.mlp == "gelu" and cfg.tie_embeddings
    plain_blocks = cfg.pre_norm and not (cfg.sandwich_norm or cfg.qk_norm or cfg.embedding_scale or cfg.qkv_bias)
    if not (gpt2_modules and plain_blocks):
        raise ConfigError(
            f"the model mixes the GPT-2 and Llama families (model.norm={cfg.norm}, model.position={cfg.position}, "
            f"model.mlp={cfg.mlp}, model.tie_embeddings={cfg.tie_embeddings}, pre_norm={cfg.pre_norm}, "
            f"sandwich_norm={cfg.sandwich_norm}, qk_norm={cfg.qk_norm}, qkv_bias={cfg.qkv_bias}): no transformers "
            f"class llmtrain exports to holds it; use a gpt2 or a llama preset's settings"
        )


def hf_config(cfg: GPTConfig, eos_id: int):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=cfg.hidden,
        activation_function="gelu_new",
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.attention_dropout,
        layer_norm_epsilon=1e-5,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=True,
    )


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict from our whole model's (biases of zero where ours has none)."""
    cfg = model.cfg
    ours = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return ours[name] if name in ours else torch.zeros(shape)

    d = cfg.d_model
    hf = {
        "transformer.wte.weight": ours["tok_emb.weight"][: cfg.vocab_size].clone(),
        "transformer.wpe.weight": ours["pos_emb.weight"],
        "transformer.ln_f.weight": ours["norm.weight"],
        "transformer.ln_f.bias": get("norm.bias", (d,)),
    }
    for i in range(cfg.n_layer):
        ours_prefix, hf_prefix = f"blocks.{i}.", f"transformer.h.{i}."
        for our_norm, hf_norm in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            hf[f"{hf_prefix}{hf_norm}.weight"] = ours[f"{ours_prefix}{our_norm}.weight"]
            hf[f"{hf_prefix}{hf_norm}.bias"] = get(f"{ours_prefix}{our_norm}.bias", (d,))
        qkv = [f"{ours_prefix}attn.{p}_proj" for p in "qkv"]
        hf[f"{hf_prefix}attn.c_attn.weight"] = torch.cat([ours[f"{n}.weight"] for n in qkv]).t().contiguous()
        hf[f"{hf_prefix}attn.c_attn.bias"] = torch.cat([get(f"{n}.bias", (d,)) for n in qkv])
        for ours_name, hf_name, width in (
            ("attn.out_proj", "attn.c_proj", d),
            ("mlp.fc_in", "mlp.c_fc", cfg.hidden),
            ("mlp.fc_out", "mlp.c_proj", d),
        ):
            hf[f"{hf_prefix}{hf_name}.weight"] = ours[f"{ours_prefix}{ours_name}.weight"].t().contiguous()
            hf[f"{hf_prefix}{hf_name}.bias"] = get(f"{ours_prefix}{ours_name}.bias", (width,))
    hf["lm_head.weight"] = hf["transformer.wte.weight"]
    return hf


def _hf_source(name: str, cfg: GPTConfig) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The GPT-2 tensor (name without the "transformer." prefix) that our parameter `name` comes from, and how."""
    d = cfg.d_model

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def transpose(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t()

    outer = {"pos_emb.weight": "wpe.weight", "norm.weight": "ln_f.weight", "norm.bias": "ln_f.bias"}
    if name in outer:
        return outer[name], keep
    if name in ("tok_emb.weight", "lm_head.weight"):  # our vocabulary padding rows stay zero
        return "wte.weight", lambda wte: torch.cat([wte, wte.new_zeros(cfg.padded_vocab_size - cfg.vocab_size, d)])
    _, layer, rest = name.split(".", 2)  # blocks.<i>.<rest>
    prefix = f"h.{layer}."
    norms = {"attn_norm": "ln_1", "mlp_norm": "ln_2"}
    module, kind = rest.rsplit(".", 1)
    if module in norms:
        return f"{prefix}{norms[module]}.{kind}", keep
    if module in ("attn.q_proj", "attn.k_proj", "attn.v_proj"):
        j = "qkv".index(module[5])
        if kind == "weight":  # c_attn is (d, 3d), in then out: q, k, v side by side
            return f"{prefix}attn.c_attn.weight", lambda w: w[:, j * d : (j + 1) * d].t()
        return f"{prefix}attn.c_attn.bias", lambda b: b[j * d : (j + 1) * d]
    theirs = {"attn.out_proj": "attn.c_proj", "mlp.fc_in": "mlp.c_fc", "mlp.fc_out": "mlp.c_proj"}[module]
    return f"{prefix}{theirs}.{kind}", transpose if kind == "weight" else keep


def gpt_config_of(path: str) -> GPTConfig:
    """The shape of the GPT-2 in directory `path` (its config.json), in our terms."""
    from transformers import GPT2Config

    c = GPT2Config.from_pretrained(path)
    return GPTConfig(
        vocab_size=c.vocab_size,
        n_layer=c.n_layer,
        n_head=c.n_head,
        d_model=c.n_embd,
        max_seq_len=c.n_positions,
        d_ff=c.n_inner,
    )


class GPT2Weights:
    """Our parameters' values from a GPT-2 in Hugging Face format, one tensor at a time (`init(name, full)`, as
    llmtrain/model/materialize.py asks): safetensors are memory-mapped and each tensor is read when asked for, so
    no rank ever holds the whole checkpoint. Raises ConfigError when its shape differs from the model config."""

    shape_keys: tuple[str, ...] = ("n_layer", "n_head", "d_model", "max_seq_len", "vocab_size", "hidden")

    @staticmethod
    def config_of(directory: str) -> GPTConfig:
        return gpt_config_of(directory)

    def __init__(self, path: str, cfg: GPTConfig):
        directory = local_hf_directory(path)
        check_same_shape(path, cfg, self.config_of(directory), self.shape_keys, PRESET_REMEDY)
        self.cfg = cfg
        keys, self._read = lazy_tensors(directory)
        # save_pretrained writes "transformer.h.0..."; the original hub GPT-2 files have no prefix.
        self._prefix = "transformer." if "transformer.wte.weight" in keys else ""

    def __call__(self, name: str, full: torch.Tensor) -> None:
        if name == "lm_head.bias":  # our padded head's vocabulary mask, not a GPT-2 weight
            full.copy_(vocabulary_mask(self.cfg))
            return
        key, transform = _hf_source(name, self.cfg)
        full.copy_(transform(self._read(self._prefix + key)))
