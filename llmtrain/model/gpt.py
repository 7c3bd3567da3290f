"""The decoder of every preset (GPT-2, Llama, Qwen3, Gemma 3, Mixtral by its config's keys), read top to bottom.

Layout choices made for the parallel layouts that wrap it:
- blocks live in a ModuleDict keyed "0".."n-1", so a pipeline stage that keeps a slice of them keeps their names
  and checkpoints do not care how the model was cut;
- the embeddings, the blocks and the head are separate attributes, so a stage can own any of them;
- q, k, v are separate projections so tensor parallelism can split each by heads with a plain column plan;
- the head reshape is written in units of head_dim, so it holds for a rank that owns only some heads;
- the model tells the layouts what they need to know about it (its tied parameters, its tensor-parallel plan, how
  to cut a pipeline part and a stage out of it, each parameter's initial value), so llmtrain/parallel/ never
  names one of its modules.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.distributed.tensor import DTensor

from llmtrain.catalog import imported
from llmtrain.model.base import LayeredModel
from llmtrain.model.documents import PackedDocuments, document_attention, visible, whole_window_documents
from llmtrain.model.dropout import Dropout
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.kv_cache import KVCache
from llmtrain.model.lora import adapter_kind, freeze_base, init_adapter, linear
from llmtrain.model.materialize import write_parameters
from llmtrain.model.moe import Experts, HiddenSplit, MoE, expert_init_std
from llmtrain.model.quantize import quantize_base
from llmtrain.model.recompute import recomputed
from llmtrain.model.rope import frequencies, rotate, rotation


class WholeSequence:
    """Which positions of the sequence a forward sees, and how its attention reaches the rest: here all of them,
    in order, and attention is local. Context parallelism hands the model its own layout instead (made by
    llmtrain/parallel/context.py, handed over by family.py): a shard of positions, attention over a ring of ranks;
    decoding, a KVCache (model/kv_cache.py)."""

    # A sliding-window block's attention is masked by packed documents (one, the whole window, where none is given).
    windows_by_documents = True

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        return torch.arange(t, device=device)

    def documents(self, starts: torch.Tensor, windows: Iterable[int | None]) -> PackedDocuments:
        """Packed documents (model/documents.py) from where each position's document starts (batch, t), with a
        mask for each of the attention `windows`."""
        return whole_window_documents(starts, windows)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: PackedDocuments | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        return causal_attention(q, k, v) if documents is None else document_attention(q, k, v, documents.masks[window])


# The dtypes in which CUDA's flash kernel runs, the one fused kernel that takes fewer key/value heads than queries.
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over (batch, heads, t, head_dim). Grouped-query attention is handed to SDPA as such in half
    precision, where flash attention takes it; in fp32 (no flash kernel) CUDA's memory-efficient kernel does not
    take it and SDPA would fall back to the math kernel, which materialises (t x t) scores per head: Llama 3.2 1B in
    fp32 would not fit 16 GB. There the key/value heads are repeated, as ring attention does."""
    if q.shape[1] == k.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q.dtype not in _FLASH_DTYPES:
        k, v = (z.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for z in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # enable_gqa a constant: under torch.compile with dynamic shapes (GRPO's rows and lengths change from step to
    # step) the comparison of head counts stays symbolic, and SDPA takes no SymBool
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class CausalSelfAttention(nn.Module):
    """Multi-head attention, or grouped-query attention when the model has fewer key/value heads (each serves
    n_head / n_kv_head consecutive query heads, so a tensor-parallel rank's query heads find their keys on it)."""

    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.window = cfg.window_of(layer)  # attention to the last `window` keys (None: all)
        self.head_dim = cfg.head_size
        self.rope = cfg.rope_of(layer) if cfg.rotates(layer) else None
        kv_width = cfg.kv_heads * self.head_dim
        qkv_bias = cfg.bias or cfg.qkv_bias
        self.q_proj = linear(cfg.d_model, cfg.attention_width, qkv_bias, cfg.lora, "q_proj")
        self.k_proj = linear(cfg.d_model, kv_width, qkv_bias, cfg.lora, "k_proj")
        self.v_proj = linear(cfg.d_model, kv_width, qkv_bias, cfg.lora, "v_proj")
        self.out_proj = linear(cfg.attention_width, cfg.d_model, cfg.bias, cfg.lora, "out_proj")
        # Over each head: one weight of a head's width for all heads (a tensor-parallel rank normalises its own
        # heads with it); over the projection: a weight as wide as it, every head's values normalised together.
        self.norm_heads = cfg.qk_norm_scope == "head"
        if self.norm_heads:
            self.q_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else None
            self.k_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else None
        else:
            self.q_norm = ProjectionRMSNorm(cfg.attention_width, cfg.norm_eps) if cfg.qk_norm else None
            self.k_norm = ProjectionRMSNorm(kv_width, cfg.norm_eps) if cfg.qk_norm else None
        self.attn_dropout = Dropout(cfg.attention_dropout)
        self.resid_dropout = Dropout(cfg.dropout)
        self.sequence: WholeSequence = WholeSequence()

    def forward(self, x: torch.Tensor, documents: PackedDocuments | None = None) -> torch.Tensor:
        """`documents`: the packed documents the attention stays within (None: causal over the whole window)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None and self.k_norm is not None and not self.norm_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (rearrange(z, "b t (h d) -> b t h d", d=self.head_dim) for z in (q, k, v))
        if self.q_norm is not None and self.k_norm is not None and self.norm_heads:
            # Normalised where each head's values lie together: the output keeps the projection's layout, so the
            # attention's output needs no copy to reach out_proj.
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (batch, heads, t, head_dim)
        if self.rope is not None:
            # Recomputed per call rather than cached: a few head_dim x t elements, made on the device (a cache
            # would be a buffer that meta-device construction and every layout would have to carry).
            positions = self.sequence.positions(q.shape[2], q.device) if documents is None else documents.positions
            cos, sin = rotation(positions, frequencies(self.head_dim, *self.rope, device=q.device))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.training and self.attn_dropout.p > 0:
            # Dropout on the attention weights needs them materialised, (batch, heads, t, t): the fused kernel
            # draws its own mask, which would depend on how heads are split across ranks. Hence its own key.
            if q.shape[1] != k.shape[1]:
                k, v = (z.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for z in (k, v))
            index = torch.arange(q.shape[2], device=q.device)
            if documents is None:
                seen = index[None, :] <= index[:, None]
            else:
                seen = visible(documents.starts, index, index, self.window)
            scores = (q @ k.transpose(-2, -1) / self.head_dim**0.5).masked_fill(~seen, float("-inf"))
            y = self.attn_dropout(torch.softmax(scores, dim=-1)) @ v
        else:
            y = self.sequence.attention(q, k, v, documents, self.window)
        return self.resid_dropout(self.out_proj(rearrange(y, "b h t d -> b t (h d)")))


class MLP(nn.Module):
    """fc_out(act(fc_in(x))), or with a gated kind fc_out(act(fc_gate(x)) * fc_in(x)): the model.mlp kind's
    (catalog MLP_KINDS), GPT-2's GELU, Llama's SwiGLU, Gemma's GeGLU or Primer's squared ReLU."""

    def __init__(self, cfg: GPTConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or cfg.hidden
        kind = cfg.mlp_kind
        self.fc_in = linear(cfg.d_model, hidden, cfg.bias, cfg.lora, "fc_in")
        self.fc_gate = linear(cfg.d_model, hidden, cfg.bias, cfg.lora, "fc_gate") if kind.gated else None
        self.fc_out = linear(hidden, cfg.d_model, cfg.bias, cfg.lora, "fc_out")
        self.activation: Callable[[torch.Tensor], torch.Tensor] = imported(kind.activation)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fc_gate is not None:
            hidden = self.activation(self.fc_gate(x)) * self.fc_in(x)
        else:
            hidden = self.activation(self.fc_in(x))
        return self.dropout(self.fc_out(hidden))


class OffsetRMSNorm(nn.RMSNorm):
    """Gemma's RMSNorm: normalised in fp32 and scaled by (1 + w), its weight stored as the offset from one (zero
    at initialisation), the result in the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normalised = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (normalised * (1.0 + self.weight.float())).type_as(x)


class ProjectionRMSNorm(nn.RMSNorm):
    """RMSNorm over a whole projection, every head's values together (OLMo 2's query and key norms), computed in
    fp32 and scaled there, as transformers' Olmo2RMSNorm. Where tensor parallelism splits the projection by heads, a
    rank holds some of its columns and the matching slice of the weight, and its `split` (parallel/tp.py) sums the
    squares over the ranks: one number per position."""

    def __init__(self, width: int, eps: float):
        super().__init__(width, eps=eps)
        self.split: HiddenSplit | None = None  # None: the projection is whole here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.float().pow(2).sum(-1, keepdim=True)
        if self.split is not None:  # summed forward, and backward: each rank's gradient of the sum is a partial one
            squares = self.split.into(self.split.out_of(squares))
        # a tensor-parallel weight is a DTensor of this rank's slice, which the local columns meet
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        width, eps = self.normalized_shape[0], cast(float, self.eps)
        return (x.float() * torch.rsqrt(squares / width + eps) * weight.float()).type_as(x)


def make_norm(cfg: GPTConfig, width: int | None = None) -> nn.Module:
    """The model's norm over `width` features (None: the residual stream's)."""
    width = width or cfg.d_model
    if cfg.norm == "offset_rmsnorm":
        return OffsetRMSNorm(width, eps=cfg.norm_eps)
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(width, eps=cfg.norm_eps)
    return nn.LayerNorm(width, eps=cfg.norm_eps, bias=cfg.bias)


def make_mixture(cfg: GPTConfig) -> MoE:
    m = cfg.moe
    hidden = m.d_ff or cfg.hidden
    shared = MLP(cfg, hidden * m.shared_experts) if m.shared_experts else None
    return MoE(cfg.d_model, hidden, cfg.mlp_kind, m, shared, cfg.lora)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)); with model.sandwich_norm each branch's
    output normalised too before it joins the residual stream (Gemma), or that alone without model.pre_norm
    (OLMo 2: x + norm(attn(x))). The MLP is a mixture of experts in the blocks model.moe picks."""

    def __init__(self, cfg: GPTConfig, index: int, recompute: str = "none"):
        super().__init__()
        self.attn_norm = make_norm(cfg) if cfg.pre_norm else None
        self.attn = CausalSelfAttention(cfg, index)
        self.attn_post_norm = make_norm(cfg) if cfg.sandwich_norm else None
        self.mlp_norm = make_norm(cfg) if cfg.pre_norm else None
        self.mlp: nn.Module = make_mixture(cfg) if cfg.moe.is_moe_block(index) else MLP(cfg)
        self.mlp_post_norm = make_norm(cfg) if cfg.sandwich_norm else None
        self.recompute = recompute  # what backward recomputes (train.activation_checkpointing, model/recompute.py)

    def forward(self, x: torch.Tensor, documents: PackedDocuments | None = None) -> torch.Tensor:
        return recomputed(partial(self._residual, documents=documents), self.recompute, x)

    def _residual(self, x: torch.Tensor, documents: PackedDocuments | None) -> torch.Tensor:
        attended = self.attn(x if self.attn_norm is None else self.attn_norm(x), documents=documents)
        x = x + (attended if self.attn_post_norm is None else self.attn_post_norm(attended))
        transformed = self.mlp(x if self.mlp_norm is None else self.mlp_norm(x))
        return x + (transformed if self.mlp_post_norm is None else self.mlp_post_norm(transformed))


# Residual-branch output projections: GPT-2 scales their initial std by 1/sqrt(2 * n_layer) so the residual
# stream's variance does not grow with depth (two branches per block).
RESIDUAL_PROJECTIONS = ("attn.out_proj", "mlp.fc_out", "mlp.shared.fc_out")


class GPT(LayeredModel):
    """The whole model, or a pipeline rank's part of it: `layers` picks the blocks (named as in the whole model),
    `embedding` and `head` whether the part holds the input embeddings and the final norm + LM head. The head is
    tied to the token embedding when the part holds both, unless `tie_head=False`: a pipeline keeps the two on
    different stages as copies whose gradients it sums (llmtrain/parallel/pipeline/). A family whose blocks differ
    subclasses it with its own `block_class` (built as Block is: config, index, recompute mode)."""

    block_class: type[Block] = Block

    def __init__(
        self,
        cfg: GPTConfig,
        layers: Sequence[int] | None = None,
        embedding: bool = True,
        head: bool = True,
        tie_head: bool = True,
        recompute: str = "none",
    ):
        super().__init__()
        self.cfg, self.recompute = cfg, recompute
        layers = range(cfg.n_layer) if layers is None else layers
        self.tok_emb: nn.Embedding | None = None
        self.pos_emb: nn.Embedding | None = None
        self.emb_dropout: Dropout | None = None
        self.norm: nn.Module | None = None
        self.lm_head: nn.Linear | None = None
        self.sequence: WholeSequence = WholeSequence()
        if embedding:
            self.tok_emb = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
            if cfg.position == "learned":
                self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
            self.emb_dropout = Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): self.block_class(cfg, i, recompute) for i in layers})
        if head:
            padded = cfg.padded_vocab_size > cfg.vocab_size
            self.norm = make_norm(cfg)
            self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=padded)
            if self.tok_emb is not None and tie_head and cfg.tie_embeddings:
                self.lm_head.weight = self.tok_emb.weight  # tied, as GPT-2
            if padded:
                # The head's bias is a fixed mask: -inf on the padding rows, so their logits never enter the
                # softmax and the loss is the unpadded model's. A (frozen) parameter rather than a buffer so that
                # tensor parallelism shards it with the head's rows.
                self.lm_head.bias.requires_grad_(False)

    def forward(
        self, x: torch.Tensor, documents: torch.Tensor | None = None, last_logits_only: bool = False
    ) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab); a part without the embedding takes the residual
        stream (batch, seq, d_model) instead, and a part without the head returns it. `documents`: where the
        packed document of each position starts (batch, seq; model/documents.py), or None for causal attention over
        the whole window. `last_logits_only`: the logits of the last position alone (batch, 1, vocab), what a
        sampler reads (the head over a prompt's every position would cost more than its blocks)."""
        windows = {self.cfg.window_of(int(name)) for name in self.blocks}
        if documents is None and windows != {None} and self.sequence.windows_by_documents:  # one document
            documents = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
        packed = None if documents is None else self.sequence.documents(documents, windows)
        if self.tok_emb is not None and self.emb_dropout is not None:
            embedded = self.tok_emb(x)
            if self.cfg.embedding_scale:  # Gemma rounds the factor to the embedding's dtype first
                embedded = embedded * torch.tensor(self.cfg.d_model**0.5, dtype=embedded.dtype)
            if self.pos_emb is not None:
                positions = self.sequence.positions(x.shape[1], x.device) if packed is None else packed.positions
                embedded = embedded + self.pos_emb(positions)
            x = self.emb_dropout(embedded)
        for block in self.blocks.values():
            x = block(x, documents=packed)
        if self.lm_head is None or self.norm is None:
            return x
        return self.lm_head(self.norm(x[:, -1:] if last_logits_only else x))

    def finish(self) -> None:
        """With low-rank adapters the base is frozen, and with model.quantize_base=nf4 its block weights NF4: over
        every module of the finished model, whichever family's class built it."""
        if self.cfg.lora.enabled:
            freeze_base(self)
        if self.cfg.quantize_base == "nf4":
            quantize_base(self)

    @property
    def context_length(self) -> int:
        return self.cfg.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        with torch.no_grad(), self._decoding(cache):
            return self(tokens, last_logits_only=True)

    @contextmanager
    def _decoding(self, cache: KVCache) -> Iterator[None]:
        """Forward passes compute the next positions of `cache`'s rows over their cached keys, until the block ends."""
        attentions = [cast(Block, block).attn for block in self.blocks.values()]
        kept = self.sequence, [attention.sequence for attention in attentions]
        self.sequence = cast(WholeSequence, cache)
        for name, attention in zip(self.blocks, attentions):
            attention.sequence = cast(WholeSequence, cache.layer(int(name)))
        try:
            yield
        finally:
            self.sequence = kept[0]
            for attention, sequence in zip(attentions, kept[1]):
                attention.sequence = sequence

    # -- what parallel layouts need to know about this model ------------------------------------------------
    @property
    def tied_parameters(self) -> dict[str, str]:
        """Parameter name -> the name of the parameter it is (the LM head's weight is the token embedding), also
        on a pipeline part that holds the head as its own copy: checkpoints store it once, under the source."""
        return {"lm_head.weight": "tok_emb.weight"} if self.cfg.tie_embeddings else {}

    def take_expert_load(self, device: torch.device) -> torch.Tensor | None:
        if not self.cfg.moe.num_experts:
            return None
        loads = [block.mlp.take_load() for block in self.blocks.values() if isinstance(block.mlp, MoE)]
        return (
            torch.stack(loads).sum(0)
            if loads
            else torch.zeros(self.cfg.moe.num_experts, dtype=torch.long, device=device)
        )

    # -- initialisation ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_parameter(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full`, the whole (unsplit) tensor of parameter `name`, with its GPT-2 initial value: N(0, 0.02)
        for matrices and embeddings, scaled by 1/sqrt(2 n_layer) on the residual projections, LayerNorm at
        identity, biases zero; the padded head's bias is the vocabulary mask; adapters as model/lora.py starts them."""
        module_name, _, kind = name.rpartition(".")
        module = self.get_submodule(module_name)
        if (factor := adapter_kind(kind)) is not None:
            init_adapter(factor, full, generator)
        elif isinstance(module, OffsetRMSNorm):
            full.zero_()  # a scale of 1 + 0
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            full.fill_(1.0 if kind == "weight" else 0.0)
        elif isinstance(module, Experts):
            full.normal_(mean=0.0, std=expert_init_std(kind, self.cfg.n_layer), generator=generator)
        elif kind == "bias":
            full.copy_(vocabulary_mask(self.cfg)) if module is self.lm_head else full.zero_()
        else:
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if module_name.endswith(RESIDUAL_PROJECTIONS) else 0.02
            full.normal_(mean=0.0, std=std, generator=generator)

    def init_weights(self, seed: int) -> None:
        """Initialise this (materialised) model in place from `seed`, as every layout does."""
        write_parameters(self, seeded_init(self, seed))


def parameter_seed(seed: int, name: str) -> int:
    """A generator seed per (run seed, parameter name): a parameter's initial value depends on nothing else, so
    a rank can draw any one tensor without drawing the others first, in any order and under any split."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def seeded_init(model: GPT, seed: int) -> Callable[[str, torch.Tensor], None]:
    """init(name, full): fill the whole CPU tensor of parameter `name` (the parameter it is tied to, for a tied
    one) with its initial value for `seed`."""

    def init(name: str, full: torch.Tensor) -> None:
        name = model.tied_parameters.get(name, name)
        model.init_parameter(name, full, torch.Generator().manual_seed(parameter_seed(seed, name)))

    return init


def vocabulary_mask(cfg: GPTConfig) -> torch.Tensor:
    mask = torch.zeros(cfg.padded_vocab_size)
    mask[cfg.vocab_size :] = float("-inf")
    return mask


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters, frozen ones too (a tied weight counts once; the padded head's bias, a fixed vocabulary
    mask rather than a weight, not at all)."""
    return sum(p.numel() for name, p in model.named_parameters() if not name.endswith("lm_head.bias"))


def trainable_parameters(model: nn.Module) -> int:
    """Distinct parameters that train: all of num_parameters, or the low-rank adapters alone (model/lora.py)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
