"""The `model` group's keys (conf/model/): the model's family (its class), the network's shape, the Llama family's
choices, mixture-of-experts blocks, low-rank adapters, and `mlp_width`, the rule that fills in the MLP width a
preset leaves null."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from llmtrain import catalog
from llmtrain.domains import DirectoryOrHub, Flag, ListOf, Number, OneOf, Text, at_least, fraction, key, positive


@dataclass
class RopeScalingConfig:
    """Stretched rotary frequencies (llmtrain/model/rope.py): Llama 3's of the slow ones (the numbers are Llama
    3.1's), or a linear one of all."""

    type: str = key(
        "none",
        OneOf(("none", "llama3", "linear")),
        "`none` (plain RoPE), `llama3`: Llama 3's stretch of the slow rotary frequencies (transformers' `rope_type: "
        "llama3`): rotations with more than `high_freq_factor` turns over the original context keep their frequency, "
        "those with fewer than `low_freq_factor` slow by `factor`, the band between blends the two (`llama3.2-1b` "
        "sets Meta's (32, 1, 4, 8192), so its weights load with `model.init_from`); or `linear`: every frequency "
        "slowed by `factor` (positions interpolated; Gemma 3 4B's global blocks, factor 8)",
    )
    factor: float = key(
        8.0,
        Number(low=1),
        "`llama3`: the stretched context is `factor` × `original_max_seq_len`; `linear`: every rotation slows by it",
    )
    low_freq_factor: float = key(
        1.0,
        positive(),
        "`llama3`: rotations with fewer turns than this over the original context slow by `factor`",
    )
    high_freq_factor: float = key(4.0, positive(), "`llama3`: rotations with more turns than this keep their frequency")
    original_max_seq_len: int = key(8192, at_least(1), "`llama3`: the context the model was pretrained on")


@dataclass
class MoEGroupConfig:
    """Mixture-of-experts blocks (llmtrain/model/moe.py); num_experts 0 keeps every MLP dense."""

    num_experts: int = key(
        0,
        at_least(0),
        "routed experts per mixture-of-experts block; 0 keeps every MLP dense. `moe-tiny` (8, GPT-2 family) and "
        "`mixtral-tiny` (8, Llama family) set it",
    )
    top_k: int = key(
        2,
        at_least(1),
        "experts each token goes to; their router probabilities weight the outputs (renormalised to sum to 1 with "
        "`renormalize`). Dropless: no capacity limit, no token dropped",
    )
    renormalize: bool = key(
        True,
        Flag(),
        "the top_k router probabilities divided by their sum (Mixtral's rule; Qwen3-MoE's `norm_topk_prob`); false: "
        "each weighs its expert's output as the softmax over all experts gave it (OLMoE, Qwen1.5-MoE)",
    )
    every: int = key(
        1,
        at_least(1),
        "block i is a mixture when (i + 1) % every == 0 (1: every block; 2: every second, as `moe-tiny`)",
    )
    shared_experts: int = key(
        0,
        at_least(0),
        "always-on experts beside the routed ones (DeepSeek-style), run as one MLP of shared_experts × the expert "
        "width",
    )
    d_ff: Optional[int] = key(
        None,
        at_least(1),
        "one expert's hidden width; null = the dense MLP's (`model.d_ff`, or its default)",
    )
    aux_loss_coef: float = key(
        0.01,
        Number(low=0),
        "Switch / GShard load-balancing loss, coef · E · Σ_e (share of routed slots_e · mean router probability_e), "
        "per micro-batch",
    )
    z_loss_coef: float = key(0.0, Number(low=0), "ST-MoE router z-loss, coef · mean(logsumexp(router logits)²)")


@dataclass
class LoRAGroupConfig:
    """Low-rank adapters (llmtrain/model/lora.py): rank 0 trains every parameter."""

    rank: int = key(
        0,
        at_least(0),
        "low-rank adapters of this rank beside each targeted projection, the rest of the model frozen (no gradients, "
        "no optimizer state; bf16 where FSDP gathers bf16); 0 trains every parameter. 8 to 64 is usual",
    )
    alpha: float = key(16.0, positive(), "the adapters' update is scaled by alpha / rank (PEFT's `lora_alpha`)")
    dropout: float = key(0.0, fraction(), "dropout on each adapter's input (PEFT's `lora_dropout`)")
    targets: list[str] = key(
        list(catalog.LORA_TARGETS),
        ListOf(
            OneOf(
                (
                    *catalog.LORA_TARGETS,
                    *catalog.LORA_TARGETS.values(),
                    *catalog.EXPERT_LORA_TARGETS,
                    *catalog.EXPERT_LORA_TARGETS.values(),
                )
            )
        ),
        "the projections adapted: `q_proj k_proj v_proj out_proj` (attention), `fc_gate fc_in fc_out` (the MLP), or "
        "by the names Hugging Face's Llama, Qwen3 and PEFT give them (`o_proj gate_proj up_proj down_proj`), all of "
        "them by default; a mixture's routed experts, each with adapters of its own, only when named: `experts_in` "
        "(the gate and input projections, as transformers' fused `experts.gate_up_proj`) and `experts_out` "
        "(`experts.down_proj`)",
    )


def mlp_width(d_model: int, d_ff: int | None, mlp: str) -> int:
    """The MLP's hidden width: `d_ff`, else the MLP kind's rule (catalog MLP_KINDS: 4·d_model, or 8/3·d_model
    rounded up to 64 for the gated ones: the same parameter count). The one rule the model, the plan's checks and the
    planner read; it sits with the keys it reads rather than in llmtrain/model/ (whose package loads torch) because
    train.py checks a layout before torch loads."""
    return d_ff or catalog.mlp_kind(mlp).width(d_model)


@dataclass
class ModelConfig:
    name: str = key(MISSING, Text(), "the preset's name, shown in summaries")
    family: str = key(
        "gpt",
        OneOf(tuple(catalog.MODEL_FAMILIES)),
        "the model's family (its row in llmtrain/catalog/models.py MODEL_FAMILIES; checkpoints record it, and export, "
        "generate, evaluate and resume rebuild it): " + catalog.described(catalog.MODEL_FAMILIES),
    )
    n_layer: int = key(MISSING, at_least(1), "transformer blocks; each preset sets its own")
    n_head: int = key(MISSING, at_least(1), "attention heads (`d_model` divisible by it); each preset sets its own")
    d_model: int = key(MISSING, at_least(1), "the residual stream's width; each preset sets its own")
    d_ff: Optional[int] = key(
        None,
        at_least(1),
        "MLP hidden width; null = the `mlp` kind's rule: 4 × d_model, or 8/3 × d_model rounded up to 64 for a gated "
        "kind (swiglu, geglu)",
    )
    max_seq_len: int = key(
        1024,
        at_least(1),
        "learned position embeddings; 1024 in the GPT-2 presets, 2048 in `gpt3-2.7b`",
    )
    vocab_size: Optional[int] = key(
        None,
        at_least(1),
        "null = the tokenizer's vocabulary size; must be at least the tokenizer's. The GPT-2 presets and `gpt3-2.7b` "
        "set GPT-2's 50257, `smollm2-135m` 49152 and `llama3.2-1b` 128256 (their tokenizers'); the tiny ones null",
    )
    dropout: float = key(
        0.0,
        fraction(),
        "on embeddings and residual branches. Each element's mask bit is a hash of the seed and its index in the "
        "unsplit tensor, so tensor/sequence parallel and recomputed blocks drop exactly what one process drops, no "
        "rank draws more than its own elements, and under `train.compile` the mask is fused into the block's kernel "
        "(data-parallel ranks draw independent masks; a compiled run draws its seeds through the compiler's "
        "random-number path, so its masks differ from an eager run's but are as reproducible)",
    )
    attention_dropout: float = key(
        0.0,
        fraction(),
        "on the attention weights, with the same split-invariant masks; > 0 materialises the (batch, heads, t, t) "
        "weights instead of the fused attention kernel: memory grows with t², so keep it for short contexts",
    )
    bias: bool = key(True, Flag(), "biases in Linear and LayerNorm, as GPT-2")
    vocab_multiple: int = key(
        64,
        at_least(1),
        "pad the vocabulary (embedding rows, head outputs) to a multiple of this; the padded logits are masked to "
        "-inf, so the loss is the unpadded model's; tensor parallelism needs it divisible by tp. The printed "
        "parameter count leaves the padding out",
    )
    init_from: Optional[str] = key(
        None,
        DirectoryOrHub(("config.json",)),
        "start from a model in Hugging Face format (a local directory, or a hub name where the hub is reachable), "
        "read one tensor at a time into each rank's shards. Alone (no `model=`), it is the model: its config.json "
        "gives the family and every shape key, and the run keeps its own (`lora`, `quantize_base`, dropout, "
        "`vocab_multiple`); a shape key set beside it, or a preset chosen with it, must match it (a mismatch names "
        "the keys). Use its tokenizer: `data.tokenizer.kind=hf data.tokenizer.name=<same>`",
    )
    # The Llama family's choices (GPT-2's are the defaults): conf/model/llama-tiny.yaml and the presets set them.
    norm: str = key(
        "layernorm",
        OneOf(("layernorm", "rmsnorm", "offset_rmsnorm")),
        "`layernorm` (GPT-2), `rmsnorm` (Llama, Qwen3) or `offset_rmsnorm` (Gemma: RMSNorm computed in fp32 whose "
        "weight is stored as its offset from one, x̂ · (1 + w), starting at zero)",
    )
    sandwich_norm: bool = key(
        False,
        Flag(),
        "a norm on the attention's and the MLP's outputs too, before each joins the residual stream (Gemma 2 and 3: "
        "four norms a block)",
    )
    embedding_scale: bool = key(
        False, Flag(), "multiply the token embeddings by sqrt(d_model), in their dtype (Gemma; the tied head is not)"
    )
    rope_local_theta: Optional[float] = key(
        None,
        positive(),
        "the rotary base of the blocks with a sliding window (`model.sliding_window`), which rotate without "
        "`model.rope_scaling` (Gemma 3: 1e4 beside the global blocks' 1e6); null: every block rotates alike",
    )
    position: str = key(
        "learned",
        OneOf(("learned", "rope")),
        "`learned` (a position embedding, GPT-2) or `rope` (rotary on queries and keys, transformers' half-split "
        "convention)",
    )
    rope_theta: float = key(10000.0, positive(), "base of the rotary frequencies (SmolLM2 1e5, Llama 3 5e5)")
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # rope: llama3 or linear stretches it
    mlp: str = key(
        "gelu",
        OneOf(tuple(catalog.MLP_KINDS)),
        "what every dense block's MLP (and every routed expert) computes; `model.d_ff` is its hidden width: "
        + catalog.described(catalog.MLP_KINDS),
    )
    n_kv_head: Optional[int] = key(
        None,
        at_least(1),
        "key/value heads: grouped-query attention when below `n_head` (must divide it; 1 = multi-query); null = "
        "`n_head`. Tensor parallelism splits them with their query heads, so tp must divide it",
    )
    head_dim: Optional[int] = key(
        None,
        at_least(1),
        "width of one attention head; null = d_model / n_head. Qwen3 sets 128 whatever its width (0.6B: 16 heads "
        "of 128 over a d_model of 1024), so q, k, v and the output projection are n_head · head_dim wide",
    )
    qk_norm: bool = key(
        False,
        Flag(),
        "an RMSNorm over each query and key head (one weight of head_dim, shared by the heads) before the rotation, "
        "as Qwen3 and Gemma 3",
    )
    qk_norm_scope: str = key(
        "head",
        OneOf(("head", "projection")),
        "with `qk_norm`: `head` normalises each head over its own width (Qwen3, Gemma 3); `projection` the whole "
        "query and key projections, every head together, with a weight as wide (OLMo 2)",
    )
    qkv_bias: bool = key(
        False, Flag(), "biases on the query, key and value projections alone, none elsewhere (Qwen2 and Qwen2.5)"
    )
    pre_norm: bool = key(
        True,
        Flag(),
        "a norm on the input of each block's attention and MLP (GPT-2, Llama); false: the branches read the "
        "residual stream as it is and `sandwich_norm` normalises their outputs alone (OLMo 2)",
    )
    rope_layers: Optional[list[int]] = key(
        None,
        ListOf(OneOf((0, 1))),
        "with `position=rope`, which blocks rotate their queries and keys, one per block in turn and repeated over "
        "the blocks: 1 rotates, 0 leaves the block without positions (NoPE), e.g. `[1,1,1,0]` (SmolLM3's every "
        "fourth block); null: every block rotates",
    )
    tie_embeddings: bool = key(True, Flag(), "the LM head shares the token embedding's weights")
    norm_eps: float = key(1e-5, positive(), "epsilon of the norms")
    sliding_window: Optional[list[int]] = key(
        None,
        ListOf(at_least(0)),
        "attention windows, one per block in turn and repeated over the blocks: a block attends to each query's "
        "last N keys (0: all of them), e.g. `[1024,1024,1024,0]` (three local blocks, one global); within "
        "`train.attention=document`'s documents too; null: every block global (`model/documents.py`)",
    )
    moe: MoEGroupConfig = field(default_factory=MoEGroupConfig)
    lora: LoRAGroupConfig = field(default_factory=LoRAGroupConfig)
    quantize_base: str = key(
        "none",
        OneOf(("none", "nf4")),
        "`nf4` (QLoRA): the frozen base's block weights held in 4-bit NormalFloat with double-quantised block scales "
        "(torchao, the `fp8` extra; 0.52 bytes a weight against bf16's 2; `model/quantize.py`), dequantised per "
        "matmul, beside adapters that train in the compute dtype; needs `model.lora.rank` > 0. `none`: the compute "
        "dtype",
    )
