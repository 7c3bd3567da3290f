"""Our GPT <-> Hugging Face `GPT2LMHeadModel`: the same network (pre-LayerNorm blocks, tanh GELU = HF's
"gelu_new", learned positions, tied head), so conversion is renaming and reshaping:

  tok_emb / pos_emb              transformer.wte / wpe       (our vocabulary padding rows dropped / zero-filled)
  blocks.i.attn_norm, mlp_norm   transformer.h.i.ln_1, ln_2
  blocks.i.attn.{q,k,v}_proj     transformer.h.i.attn.c_attn (one fused matrix)
  blocks.i.attn.out_proj         transformer.h.i.attn.c_proj
  blocks.i.mlp.fc_in, fc_out     transformer.h.i.mlp.c_fc, c_proj
  norm                           transformer.ln_f
HF's Conv1D stores weights as (in, out), the transpose of nn.Linear's.
"""

from __future__ import annotations

import torch

from llmtrain.model.gpt import GPT, GPTConfig, vocabulary_mask


def hf_config(cfg: GPTConfig, eos_id: int):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model,
                      n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=cfg.hidden, activation_function="gelu_new",
                      resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
                      layer_norm_epsilon=1e-5, bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=True)


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict from our whole model's (biases of zero where ours has none)."""
    cfg = model.cfg
    ours = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}

    def get(name: str, shape: torch.Size) -> torch.Tensor:
        return ours[name] if name in ours else torch.zeros(shape)

    d = cfg.d_model
    hf = {"transformer.wte.weight": ours["tok_emb.weight"][: cfg.vocab_size].clone(),
          "transformer.wpe.weight": ours["pos_emb.weight"],
          "transformer.ln_f.weight": ours["norm.weight"], "transformer.ln_f.bias": get("norm.bias", (d,))}
    for i in range(cfg.n_layer):
        ours_prefix, hf_prefix = f"blocks.{i}.", f"transformer.h.{i}."
        for our_norm, hf_norm in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            hf[f"{hf_prefix}{hf_norm}.weight"] = ours[f"{ours_prefix}{our_norm}.weight"]
            hf[f"{hf_prefix}{hf_norm}.bias"] = get(f"{ours_prefix}{our_norm}.bias", (d,))
        qkv = [f"{ours_prefix}attn.{p}_proj" for p in "qkv"]
        hf[f"{hf_prefix}attn.c_attn.weight"] = torch.cat([ours[f"{n}.weight"] for n in qkv]).t().contiguous()
        hf[f"{hf_prefix}attn.c_attn.bias"] = torch.cat([get(f"{n}.bias", (d,)) for n in qkv])
        for ours_name, hf_name, width in (("attn.out_proj", "attn.c_proj", d), ("mlp.fc_in", "mlp.c_fc", cfg.hidden),
                                          ("mlp.fc_out", "mlp.c_proj", d)):
            hf[f"{hf_prefix}{hf_name}.weight"] = ours[f"{ours_prefix}{ours_name}.weight"].t().contiguous()
            hf[f"{hf_prefix}{hf_name}.bias"] = get(f"{ours_prefix}{ours_name}.bias", (width,))
    hf["lm_head.weight"] = hf["transformer.wte.weight"]
    return hf


def from_hf_state_dict(hf: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict (whole model, padded vocabulary) from GPT2LMHeadModel's."""
    d = cfg.d_model
    embedding = torch.zeros(cfg.padded_vocab_size, d)
    embedding[: cfg.vocab_size] = hf["transformer.wte.weight"]
    ours = {"tok_emb.weight": embedding, "pos_emb.weight": hf["transformer.wpe.weight"],
            "norm.weight": hf["transformer.ln_f.weight"], "norm.bias": hf["transformer.ln_f.bias"],
            "lm_head.weight": embedding}
    if cfg.padded_vocab_size > cfg.vocab_size:
        ours["lm_head.bias"] = vocabulary_mask(cfg)
    for i in range(cfg.n_layer):
        ours_prefix, hf_prefix = f"blocks.{i}.", f"transformer.h.{i}."
        for our_norm, hf_norm in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            ours[f"{ours_prefix}{our_norm}.weight"] = hf[f"{hf_prefix}{hf_norm}.weight"]
            ours[f"{ours_prefix}{our_norm}.bias"] = hf[f"{hf_prefix}{hf_norm}.bias"]
        weight, bias = hf[f"{hf_prefix}attn.c_attn.weight"].t(), hf[f"{hf_prefix}attn.c_attn.bias"]
        for j, p in enumerate("qkv"):
            ours[f"{ours_prefix}attn.{p}_proj.weight"] = weight[j * d:(j + 1) * d]
            ours[f"{ours_prefix}attn.{p}_proj.bias"] = bias[j * d:(j + 1) * d]
        for ours_name, hf_name in (("attn.out_proj", "attn.c_proj"), ("mlp.fc_in", "mlp.c_fc"),
                                   ("mlp.fc_out", "mlp.c_proj")):
            ours[f"{ours_prefix}{ours_name}.weight"] = hf[f"{hf_prefix}{hf_name}.weight"].t()
            ours[f"{ours_prefix}{ours_name}.bias"] = hf[f"{hf_prefix}{hf_name}.bias"]
    return {name: tensor.contiguous() for name, tensor in ours.items()}


def load_hf_weights(model: GPT, path: str) -> None:
    """Overwrite `model`'s weights with a GPT-2 in HF format (a local directory, or a hub name where the hub is
    reachable); its shape must match the model config."""
    from transformers import GPT2LMHeadModel

    hf_model = GPT2LMHeadModel.from_pretrained(path)
    c, cfg = hf_model.config, model.cfg
    ours = {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "d_model": cfg.d_model, "max_seq_len": cfg.max_seq_len,
            "vocab_size": cfg.vocab_size, "d_ff": cfg.hidden}
    theirs = {"n_layer": c.n_layer, "n_head": c.n_head, "d_model": c.n_embd, "max_seq_len": c.n_positions,
              "vocab_size": c.vocab_size, "d_ff": c.n_inner or 4 * c.n_embd}
    differences = [f"model.{k}={ours[k]} (theirs: {theirs[k]})" for k in ours if ours[k] != theirs[k]]
    if differences:
        from llmtrain.config import ConfigError

        raise ConfigError(f"model.init_from={path} has another shape: {', '.join(differences)}: choose the model "
                          f"preset that matches it (e.g. model=gpt2) and its tokenizer (data.tokenizer.kind=hf)")
    weights = from_hf_state_dict(hf_model.state_dict(), cfg)
    model.load_state_dict({name: weights[name] for name in model.state_dict()})
