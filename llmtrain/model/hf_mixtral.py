"""Our Llama-family mixture of experts <-> Hugging Face `MixtralForCausalLM`: the Llama mapping (hf_llama.py) for
attention, norms and embeddings, and for each block's mixture

  blocks.i.mlp.router                  model.layers.i.mlp.gate                       (experts x d_model)
  blocks.i.mlp.experts.w_gate, w_in    model.layers.i.mlp.experts.gate_up_proj       (experts, 2 d_ff, d_model):
                                       the gate's rows, then the up-projection's, each our matrix transposed
  blocks.i.mlp.experts.w_out           model.layers.i.mlp.experts.down_proj          (experts, d_model, d_ff)

That is transformers 5's module layout. Its files keep Mixtral's original per-expert tensors,
block_sparse_moe.experts.e.{w1 (gate), w3 (up), w2 (down)}.weight and block_sparse_moe.gate.weight, which import
reads (either layout), one expert's tensors at a time. Mixtral has a mixture in every block and no shared experts;
its routing is ours (softmax, top-k, renormalised).
"""

from __future__ import annotations

from typing import cast

import torch

from llmtrain.errors import ConfigError
from llmtrain.model.gpt import GPT, Block
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.hf_llama import (
    LLAMA_SHAPE_KEYS,
    LlamaWeights,
    config_from_llama_like,
    is_llama,
    llama_hf_config,
    to_llama_state_dict,
)
from llmtrain.model.moe import MoE, MoEConfig


def is_mixtral(cfg: GPTConfig) -> bool:
    """Whether transformers' MixtralForCausalLM can hold the model."""
    m = cfg.moe
    return is_llama(cfg) and m.num_experts > 0 and m.every == 1 and m.shared_experts == 0


def check_mixtral(cfg: GPTConfig) -> None:
    if not is_mixtral(cfg):
        m = cfg.moe
        raise ConfigError(
            f"a mixture of experts loads from or exports to MixtralForCausalLM only as a Llama-family model with a "
            f"mixture in every block and no shared experts (model.moe.every={m.every}, "
            f"model.moe.shared_experts={m.shared_experts}, model.norm={cfg.norm}, model.mlp={cfg.mlp}): use "
            f"conf/model/mixtral-tiny.yaml's settings"
        )


def mixtral_hf_config(cfg: GPTConfig, eos_id: int):
    from transformers import MixtralConfig

    llama = llama_hf_config(cfg, eos_id).to_dict()
    for key in ("mlp_bias", "attention_bias", "pretraining_tp", "head_dim", "model_type", "architectures"):
        llama.pop(key, None)
    llama["intermediate_size"] = cfg.moe.d_ff or cfg.hidden
    return MixtralConfig(
        **llama,
        num_local_experts=cfg.moe.num_experts,
        num_experts_per_tok=cfg.moe.top_k,
        router_aux_loss_coef=cfg.moe.aux_loss_coef,
    )


def to_mixtral_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """MixtralForCausalLM's state dict (transformers 5's module names) from our whole model's: the Llama mapping,
    and each mixture's router and fused experts (Qwen3-MoE's are named alike)."""
    hf = to_llama_state_dict(model)
    for i, block in model.blocks.items():
        mlp = cast(Block, block).mlp
        if not isinstance(mlp, MoE):
            continue  # a dense block (moe.every > 1): the Llama mapping's
        prefix = f"model.layers.{i}.mlp"
        hf[f"{prefix}.gate.weight"] = mlp.router.weight.detach().cpu().clone()
        experts = mlp.experts
        assert experts.w_gate is not None  # a Llama-family (SwiGLU) mixture: check_mixtral
        gate, up, down = (w.detach().cpu() for w in (experts.w_gate, experts.w_in, experts.w_out))
        hf[f"{prefix}.experts.gate_up_proj"] = torch.cat([gate.transpose(1, 2), up.transpose(1, 2)], dim=1).clone()
        hf[f"{prefix}.experts.down_proj"] = down.transpose(1, 2).contiguous()
    return hf


def mixtral_config_of(path: str) -> GPTConfig:
    """The shape of the MixtralForCausalLM in directory `path`, in our terms."""
    from transformers import MixtralConfig

    c = MixtralConfig.from_pretrained(path)
    moe = MoEConfig(
        num_experts=c.num_local_experts,
        top_k=c.num_experts_per_tok,
        aux_loss_coef=c.router_aux_loss_coef,
    )
    return config_from_llama_like(c, path, moe=moe)


class MixtralWeights(LlamaWeights):
    """LlamaWeights for attention, norms, embeddings and dense blocks; each mixture's router and stacked experts
    from either file layout (the release's per-expert tensors under `legacy_module`, named `legacy_names`, or
    transformers 5's fused ones)."""

    shape_keys: tuple[str, ...] = (*LLAMA_SHAPE_KEYS, "expert_shape")
    legacy_module = "block_sparse_moe"
    legacy_names = {"w_gate": "w1", "w_in": "w3", "w_out": "w2"}

    @staticmethod
    def config_of(directory: str) -> GPTConfig:
        return mixtral_config_of(directory)

    def __call__(self, name: str, full: torch.Tensor) -> None:
        if ".mlp.router." not in name and ".mlp.experts." not in name:
            return super().__call__(name, full)
        layer = name.split(".")[1]
        kind = name.rsplit(".", 1)[-1]
        legacy = f"model.layers.{layer}.{self.legacy_module}"
        if name.endswith("mlp.router.weight"):
            key = f"{legacy}.gate.weight"
            full.copy_(self._read(key if key in self._keys else f"model.layers.{layer}.mlp.gate.weight"))
            return
        fused = f"model.layers.{layer}.mlp.experts"
        if f"{fused}.down_proj" in self._keys:
            if kind == "w_out":
                full.copy_(self._read(f"{fused}.down_proj").transpose(1, 2))
            else:
                gate, up = self._read(f"{fused}.gate_up_proj").chunk(2, dim=1)
                full.copy_((gate if kind == "w_gate" else up).transpose(1, 2))
            return
        which = self.legacy_names[kind]
        for e in range(full.shape[0]):
            full[e].copy_(self._read(f"{legacy}.experts.{e}.{which}.weight").T)
