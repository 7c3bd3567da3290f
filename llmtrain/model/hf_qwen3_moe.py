"""Our Qwen3-shaped mixture of experts <-> Hugging Face `Qwen3MoeForCausalLM` (Qwen3-30B-A3B, Qwen3-235B-A22B): the
Qwen3 mapping (hf_qwen3.py: Llama's, with query and key norms) for attention, norms, embeddings and any dense block,
and Mixtral's for each mixture (hf_mixtral.py: the router `mlp.gate`, transformers 5's fused experts), whose files
hold the release's per-expert tensors

  blocks.i.mlp.experts.w_gate, w_in, w_out    model.layers.i.mlp.experts.e.{gate_proj, up_proj, down_proj}.weight

which import reads one expert at a time (or the fused ones, either layout). A mixture every `decoder_sparse_step`
blocks (model.moe.every), no shared experts, the top-k probabilities renormalised where `norm_topk_prob` says
(model.moe.renormalize: Qwen3-30B-A3B's true), each expert `moe_intermediate_size` wide (model.moe.d_ff).
`router_aux_loss_coef` is model.moe.aux_loss_coef, which llmtrain adds per block (moe.py); transformers adds its
own only with `output_router_logits`, off in the releases.
"""

from __future__ import annotations

from llmtrain.errors import ConfigError
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.hf_llama import config_from_llama_like, decoder_fields, is_llama
from llmtrain.model.hf_mixtral import MixtralWeights
from llmtrain.model.moe import MoEConfig


def is_qwen3_moe(cfg: GPTConfig) -> bool:
    """Whether transformers' Qwen3MoeForCausalLM can hold the model: the Llama family's modules with query and key
    norms, mixtures of SwiGLU experts without shared ones, every block global."""
    m = cfg.moe
    return is_llama(cfg, qk_norm=True) and m.num_experts > 0 and not m.shared_experts and not any(cfg.sliding_window)


def check_qwen3_moe(cfg: GPTConfig) -> None:
    if not is_qwen3_moe(cfg):
        raise ConfigError(
            f"a mixture of experts with query and key norms loads from or exports to Qwen3MoeForCausalLM only as a "
            f"Llama-family model without shared experts, every block global (model.moe.shared_experts="
            f"{cfg.moe.shared_experts}, model.norm={cfg.norm}, model.mlp={cfg.mlp}, model.sliding_window="
            f"{list(cfg.sliding_window)}): use conf/model/qwen3-moe-tiny.yaml's settings"
        )


def qwen3_moe_hf_config(cfg: GPTConfig, eos_id: int):
    from transformers import Qwen3MoeConfig

    m = cfg.moe
    return Qwen3MoeConfig(
        **decoder_fields(cfg, eos_id),
        rope_theta=cfg.rope_theta,  # type: ignore[call-arg]  # transformers 5 folds it into rope_parameters
        use_sliding_window=False,
        num_experts=m.num_experts,
        num_experts_per_tok=m.top_k,
        decoder_sparse_step=m.every,
        moe_intermediate_size=m.d_ff or cfg.hidden,
        norm_topk_prob=m.renormalize,
        router_aux_loss_coef=m.aux_loss_coef,
        mlp_only_layers=[],
    )


def qwen3_moe_config_of(path: str) -> GPTConfig:
    """The shape of the Qwen3MoeForCausalLM in directory `path` (its config.json), in our terms."""
    from transformers import Qwen3MoeConfig

    c = Qwen3MoeConfig.from_pretrained(path)
    if c.attention_bias or getattr(c, "use_sliding_window", False) or c.mlp_only_layers:
        raise ConfigError(
            f"model.init_from={path} is a Qwen3-MoE with attention biases, sliding windows or mlp_only_layers, which "
            f"the releases do not use and llmtrain does not model: start from a released Qwen3-MoE"
        )
    moe = MoEConfig(
        num_experts=c.num_experts,
        top_k=c.num_experts_per_tok,
        renormalize=c.norm_topk_prob,
        every=c.decoder_sparse_step,
        d_ff=c.moe_intermediate_size,
        aux_loss_coef=c.router_aux_loss_coef,
    )
    return config_from_llama_like(c, path, qk_norm=True, moe=moe)


class Qwen3MoeWeights(MixtralWeights):
    """MixtralWeights with Qwen3's query and key norms, and the release's per-expert names."""

    shape_keys: tuple[str, ...] = (*MixtralWeights.shape_keys, "qk_norm")
    legacy_module = "mlp"
    legacy_names = {"w_gate": "gate_proj", "w_in": "up_proj", "w_out": "down_proj"}

    @staticmethod
    def config_of(directory: str) -> GPTConfig:
        return qwen3_moe_config_of(directory)
