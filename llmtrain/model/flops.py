"""The FLOPs a training step spends per token, from the model config alone (MFU's numerator, the planner's step
time)."""

from __future__ import annotations

from llmtrain.model.gpt_config import GPTConfig


def flops_per_token(cfg: GPTConfig, n_params: int, seq_len: int, trainable: int | None = None) -> float:
    """Training FLOPs per token: 6N for the matmuls with the weights (forward 2N, backward 4N) plus the attention
    score and value matmuls, 12 * n_layer * (n_head * head size) * seq_len, causal mask not halved (PaLM, appendix
    B; nanoGPT and torchtitan count the same), a block with a sliding window counting its window instead of seq_len. N
    excludes what is a lookup rather than a matmul: the position embedding, and the token embedding when the head
    does not share it. Every weight is counted as it is (SwiGLU's three matrices, grouped-query attention's
    narrower key and value projections). In a mixture of experts a token meets only its top_k routed experts: N
    counts the active parameters (the others are left out). Packed documents (train.attention=document) are not
    counted shorter: the FLOPs are those of the window, as MFU's convention is. With low-rank adapters (`trainable`
    of the N) a frozen weight's gradient is never computed: 4 per frozen weight, 6 per adapter weight."""
    lookups = cfg.max_seq_len * cfg.d_model if cfg.position == "learned" else 0
    if not cfg.tie_embeddings:
        lookups += cfg.padded_vocab_size * cfg.d_model
    matmuls = n_params - lookups - inactive_expert_parameters(cfg)
    frozen = matmuls - trainable if cfg.lora.enabled and trainable is not None else 0
    return 6 * matmuls - 2 * frozen + attention_flops_per_token(cfg, seq_len)


def attention_flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Of flops_per_token, the attention's score and value matmuls: 12 * (n_head * head size) per key a token
    attends to in each layer (seq_len, or a sliding window's width)."""
    keys = sum(min(cfg.window_of(layer) or seq_len, seq_len) for layer in range(cfg.n_layer))
    return 12 * cfg.attention_width * keys


def inactive_expert_parameters(cfg: GPTConfig) -> int:
    """Routed-expert parameters a token does not use: (num_experts - top_k) experts in every mixture block."""
    m = cfg.moe
    if not m.num_experts:
        return 0
    per_expert = cfg.mlp_kind.matrices * cfg.d_model * (m.d_ff or cfg.hidden)
    blocks = sum(m.is_moe_block(i) for i in range(cfg.n_layer))
    return blocks * (m.num_experts - m.top_k) * per_expert
