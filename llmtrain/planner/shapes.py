"""What a rank's part of the GPT holds, in elements, counted from the model config alone (no model is built).

The counts follow llmtrain/model/gpt.py and its tensor-parallel plan (llmtrain/parallel/tp.py):
- per block: q, k, v (k and v as wide as the key/value heads) and the MLP's up-projection (and SwiGLU's gate) are
  column-parallel (weights and biases split over tp); the attention output and the MLP's down-projection
  row-parallel (weights split, biases replicated); both norms replicated (RMSNorm: a scale only);
- the token embedding is split by vocabulary rows, the position embedding (none with rotary positions) and the
  final norm replicated; the LM head is the token embedding (tied) unless the model unties them or a pipeline puts
  the two on different stages, where the last stage holds its own copy; a padded vocabulary adds the head's
  frozen bias (the -inf mask), split like the head;
- a mixture block's router is replicated, its routed experts split by hidden units over tp (like the dense MLP),
  and under expert parallelism over ep as well: a rank gathers (FSDP) and computes only 1/ep of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.catalog import schedule_spec
from llmtrain.model.gpt import GPTConfig
from llmtrain.model.quantize import GROUP as NF4_GROUP
from llmtrain.parallel.pipeline.split import rank_stages
from llmtrain.plan import Degrees, stage_layers
from llmtrain.planner.candidates import Candidate


@dataclass(frozen=True)
class Holding:
    """Parameters one rank's model part holds after tensor parallelism, before data-parallel sharding."""

    trainable: int  # elements with gradients and optimizer state
    frozen: int  # elements without (the vocabulary mask)
    root: int  # elements outside the blocks: FSDP's root unit, which it keeps gathered from forward to backward
    largest_unit: int  # the largest FSDP unit (a block, or the root)
    blocks: int  # transformer blocks held
    first: bool  # holds the first stage (embeddings)
    last: bool  # holds the last stage (final norm, head, loss)
    experts: int = 0  # of trainable: the routed experts' elements (all E experts; a rank gathers experts / ep)
    mixtures: int = 0  # mixture-of-experts blocks held
    matrices: int = 0  # of trainable: the blocks' weight matrices (what Muon updates; the rest is AdamW's)
    largest_reduced: int = 0  # the most trainable elements of one FSDP unit: the largest gradient reduced at once
    # the last block's elements, and of them its routed experts': FSDP keeps it gathered from forward to backward
    last_block: int = 0
    last_block_experts: int = 0
    quantized: int = 0  # of frozen: the base's block weights held in NF4 (model.quantize_base)

    @property
    def total(self) -> int:
        return self.trainable + self.frozen


def _norm_parameters(cfg: GPTConfig) -> int:
    return cfg.d_model * (1 + int(cfg.bias and cfg.norm == "layernorm"))  # RMSNorm: a scale, no bias


def _block_norm_parameters(cfg: GPTConfig) -> int:
    """A block's norms: before attention and the MLP, after each too (sandwich norms), the query and key heads'."""
    return (4 if cfg.sandwich_norm else 2) * _norm_parameters(cfg) + 2 * cfg.head_size * int(cfg.qk_norm)


def block_parameters(cfg: GPTConfig, tp: int = 1, index: int = 0) -> int:
    """Block `index`'s parameters on one of `tp` tensor-parallel ranks (blocks differ when some are mixtures of
    experts)."""
    h, a, bias = cfg.d_model, cfg.attention_width, int(cfg.bias)
    kv = cfg.kv_heads * cfg.head_size  # the width of k and v (grouped-query attention: narrower than q's)
    up = 2 if cfg.gated_mlp else 1  # fc_in, and a gated MLP's gate
    split = h * (a + 2 * kv) + bias * (a + 2 * kv) + a * h  # column-parallel q, k, v; row-parallel out_proj
    # out_proj's bias; the two norms; the query and key heads' norms
    replicated = bias * h + _block_norm_parameters(cfg)
    m = cfg.moe
    if m.is_moe_block(index):  # router; routed experts (stacked, no biases); shared experts as one wider MLP
        f = m.d_ff or cfg.hidden
        replicated += h * m.num_experts
        split += m.num_experts * (up + 1) * h * f
        f *= m.shared_experts
    else:
        f = cfg.hidden
    if f:
        split += up * h * f + bias * up * f + f * h  # column-parallel fc_in (, gate); row-parallel fc_out
        replicated += bias * h
    return split // tp + replicated


def block_matrices(cfg: GPTConfig, tp: int = 1, index: int = 0) -> int:
    """Block `index`'s weight-matrix elements on one of `tp` tensor-parallel ranks: block_parameters without the
    biases and norms."""
    h, bias, m = cfg.d_model, int(cfg.bias), cfg.moe
    kv = cfg.kv_heads * cfg.head_size
    vectors = bias * (cfg.attention_width + 2 * kv) // tp + bias * h + _block_norm_parameters(cfg)
    f = ((m.d_ff or cfg.hidden) * m.shared_experts) if m.is_moe_block(index) else cfg.hidden
    if f:
        up = 2 if cfg.gated_mlp else 1
        vectors += bias * up * f // tp + bias * h
    return block_parameters(cfg, tp, index) - vectors


def block_projections(cfg: GPTConfig, index: int = 0) -> dict[str, tuple[int, int, bool]]:
    """Block `index`'s linear projections (a mixture's shared experts as one MLP; not its router or routed
    experts): name -> (in, out, column-parallel)."""
    m, h, a = cfg.moe, cfg.d_model, cfg.attention_width
    kv = cfg.kv_heads * cfg.head_size
    f = ((m.d_ff or cfg.hidden) * m.shared_experts) if m.is_moe_block(index) else cfg.hidden
    shapes = {"q_proj": (h, a, True), "k_proj": (h, kv, True), "v_proj": (h, kv, True), "out_proj": (a, h, False)}
    if f:
        shapes.update(fc_in=(h, f, True), fc_out=(f, h, False))
        if cfg.gated_mlp:
            shapes["fc_gate"] = (h, f, True)
    return shapes


def block_adapters(cfg: GPTConfig, tp: int = 1, index: int = 0) -> int:
    """Block `index`'s low-rank adapter elements on one of `tp` tensor-parallel ranks: rank x (in + out) for each
    adapted projection, the side its weight splits divided by tp (B's rows beside a column-parallel weight, A's
    columns beside a row-parallel one); the routed experts have none."""
    lora = cfg.lora
    if not lora.enabled:
        return 0
    return sum(
        lora.rank * ((n_in + n_out // tp) if column else (n_in // tp + n_out))
        for name, (n_in, n_out, column) in block_projections(cfg, index).items()
        if name in lora.targets
    )


def block_quantized(cfg: GPTConfig, index: int = 0) -> int:
    """Block `index`'s weights NF4 holds under model.quantize_base=nf4 (model/quantize.py): its projections' that
    are whole NF4 groups (tensor parallelism never runs with it)."""
    if cfg.quantize_base != "nf4" or not cfg.lora.enabled:
        return 0
    sizes = [n_in * n_out for n_in, n_out, _ in block_projections(cfg, index).values()]
    return sum(size for size in sizes if size % NF4_GROUP == 0)


def expert_parameters(cfg: GPTConfig, tp: int = 1, index: int = 0) -> int:
    """Block `index`'s routed experts on one of `tp` tensor-parallel ranks (0 in a dense block)."""
    m = cfg.moe
    if not m.is_moe_block(index):
        return 0
    up = 2 if cfg.gated_mlp else 1
    return m.num_experts * (up + 1) * cfg.d_model * (m.d_ff or cfg.hidden) // tp


def embedding_parameters(cfg: GPTConfig, tp: int = 1) -> int:
    positions = cfg.max_seq_len * cfg.d_model if cfg.position == "learned" else 0
    return cfg.padded_vocab_size * cfg.d_model // tp + positions


def head_parameters(cfg: GPTConfig, tp: int = 1, own_weight: bool = False) -> tuple[int, int]:
    """(trainable, frozen) of the final norm and LM head; the weight counts only when it is not the embedding's."""
    norm = _norm_parameters(cfg)
    weight = cfg.padded_vocab_size * cfg.d_model // tp if own_weight or not cfg.tie_embeddings else 0
    mask = cfg.padded_vocab_size // tp if cfg.padded_vocab_size > cfg.vocab_size else 0
    return norm + weight, mask


def whole_model_parameters(cfg: GPTConfig) -> int:
    """Trainable parameters of the unsplit model (the tied head counted once), as `num_parameters` counts them."""
    blocks = sum(block_parameters(cfg, index=i) for i in range(cfg.n_layer))
    return blocks + embedding_parameters(cfg) + head_parameters(cfg)[0]


def holding(cfg: GPTConfig, candidate: Candidate | None = None, pp_rank: int = 0) -> Holding:
    """What pipeline rank `pp_rank` of `candidate`'s layout (each a tensor-parallel rank) holds, the whole model
    without one; a block's FSDP unit gathers 1/ep of its experts."""
    layout = candidate or Candidate("single", Degrees())
    tp, pp, ep, stages_per_rank = layout.degrees.tp, layout.degrees.pp, layout.degrees.ep, layout.pp_stages_per_rank
    n_stages = pp * stages_per_rank
    mine = rank_stages(pp_rank, pp, stages_per_rank, schedule_spec(layout.pp_schedule).style) if pp > 1 else [0]
    layers = stage_layers(cfg.n_layer, n_stages, layout.pp_edge_blocks) if pp > 1 else [range(cfg.n_layer)]
    indices = [i for stage in mine for i in layers[stage]]
    blocks = len(indices)
    first, last = 0 in mine, n_stages - 1 in mine
    root_trainable, frozen = 0, 0
    if first:
        root_trainable += embedding_parameters(cfg, tp)
    if last:
        head, frozen = head_parameters(cfg, tp, own_weight=pp > 1)
        root_trainable += head
    adapters = [block_adapters(cfg, tp, i) for i in indices]
    per_block = [block_parameters(cfg, tp, i) + adapter for i, adapter in zip(indices, adapters)]
    experts = [expert_parameters(cfg, tp, i) for i in indices]
    gathered_blocks = [block - share + share // ep for block, share in zip(per_block, experts)]
    root = root_trainable + frozen
    trainable = sum(per_block) + root_trainable
    matrices = sum(block_matrices(cfg, tp, i) for i in indices) + sum(adapters)
    largest_reduced = max([*gathered_blocks, root_trainable])
    last_block, last_block_experts = (per_block[-1], experts[-1]) if indices else (0, 0)
    if cfg.lora.enabled:  # the adapters alone train; the base is frozen, experts included
        frozen, trainable, matrices = frozen + trainable - sum(adapters), sum(adapters), sum(adapters)
        experts, largest_reduced, last_block_experts = [0], max(adapters, default=0), 0
    return Holding(
        trainable=trainable,
        frozen=frozen,
        root=root,
        largest_unit=max([*gathered_blocks, root]),
        blocks=blocks,
        first=first,
        last=last,
        experts=sum(experts),
        mixtures=sum(1 for i in indices if cfg.moe.is_moe_block(i)),
        matrices=matrices,
        largest_reduced=largest_reduced,
        last_block=last_block,
        last_block_experts=last_block_experts,
        quantized=sum(block_quantized(cfg, i) for i in indices),
    )
