"""The GPT model and its construction from the `model` config group."""

import torch

from llmtrain.model.gpt import GPT, GPTConfig, cross_entropy_loss, flops_per_token, num_parameters


def gpt_config(model_cfg, vocab_size: int) -> GPTConfig:
    """The model config group, with the vocabulary size resolved (the group's own, or the tokenizer's)."""
    return GPTConfig(vocab_size=model_cfg.vocab_size or vocab_size, n_layer=model_cfg.n_layer,
                     n_head=model_cfg.n_head, d_model=model_cfg.d_model, max_seq_len=model_cfg.max_seq_len,
                     d_ff=model_cfg.d_ff, dropout=model_cfg.dropout, bias=model_cfg.bias,
                     vocab_multiple=model_cfg.vocab_multiple)


def build_model(model_cfg, vocab_size: int, seed: int) -> GPT:
    """A GPT initialised from `seed` alone, or loaded from model.init_from: every layout starts from the same
    weights."""
    model = GPT(gpt_config(model_cfg, vocab_size))
    model.init_weights(torch.Generator().manual_seed(seed))
    if model_cfg.get("init_from"):
        from llmtrain.model.hf import load_hf_weights

        load_hf_weights(model, model_cfg.init_from)
    return model


__all__ = ["GPT", "GPTConfig", "build_model", "gpt_config", "cross_entropy_loss", "flops_per_token",
           "num_parameters"]
