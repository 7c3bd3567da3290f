"""What a rank's part of the model holds, in elements, counted from the model config alone (no model is built): each
family's FamilyShapes (named by its row in llmtrain/catalog/models.py) lists its blocks', embeddings' and head's
tensors, and `holding` splits them as a layout does.

GPT_SHAPES, the GPT's, follow llmtrain/model/gpt.py and its tensor-parallel plan (llmtrain/parallel/tp.py):
- per block: q, k, v (k and v as wide as the key/value heads) and the MLP's up-projection (and SwiGLU's gate) are
  column-parallel (weights and biases split over tp); the attention output and the MLP's down-projection
  row-parallel (weights split, biases replicated); both norms replicated (RMSNorm: a scale only);
- the token embedding is split by vocabulary rows, the position embedding (none with rotary positions) and the
  final norm replicated; the LM head is the token embedding (tied) unless the model unties them or a pipeline puts
  the two on different stages, where the last stage holds its own copy; a padded vocabulary adds the head's
  frozen bias (the -inf mask), split like the head;
- a mixture block's router is replicated, its routed experts split by hidden units over tp (like the dense MLP),
  and under expert parallelism over ep as well: a rank gathers (FSDP) and computes only 1/ep of them.
Each parameter is a PlannedTensor (its rows along the dimension FSDP splits): where FSDP shards, a rank's counts
are of FSDP's padded shards, ceil(rows / N) rows each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from llmtrain.catalog import imported, model_family, schedule_spec
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.quantize import GROUP as NF4_GROUP
from llmtrain.parallel.pipeline.split import rank_stages
from llmtrain.parallel_plan import Degrees, stage_layers
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
    # trainable before FSDP's padding: what a gradient accumulated unsharded holds (a pipeline's, until reduced)
    unpadded_trainable: int = 0

    @property
    def total(self) -> int:
        return self.trainable + self.frozen


@dataclass(frozen=True)
class PlannedTensor:
    """One parameter of a rank's part as FSDP splits it: `rows` along its first dimension (the one it shards),
    `columns` the elements of each row."""

    rows: int
    columns: int
    trainable: bool = True
    matrix: bool = False  # a block's weight matrix (Muon's; a router and the experts count)
    expert: bool = False  # a routed expert's stacked weights
    adapter: bool = False  # a low-rank adapter's A or B
    quantized: bool = False  # an NF4 base weight (model.quantize_base): FSDP splits it by whole NF4 groups
    second: int = 0  # an expert weight's second dimension, which FSDP splits once its shards outnumber the experts

    @property
    def numel(self) -> int:
        return self.rows * self.columns

    def sharded(self, shards: int, ep: int = 1, tp: int = 1) -> int:
        """The elements FSDP holds of this tensor over `shards` ranks, padding included: each shard ceil(rows /
        shards) rows, the last ones padded where the rows run out (NF4 weights split by whole groups, unpadded).
        Routed experts: split over ep by expert first, FSDP over the shards / ep left, by expert, or by their
        second dimension where those shards outnumber a rank's experts, divide it evenly and neither ep nor tp
        split them (parallel/fsdp.py's experts_placement). shards * the first shard, which is what a rank holds."""
        if self.quantized or not self.expert:  # NF4 (an expert stack's rows too) splits by whole groups, unpadded
            return self.numel if shards == 1 or self.quantized else shards * -(-self.rows // shards) * self.columns
        left = shards // ep if shards > ep else 1
        if left == 1:
            return self.numel
        experts = self.rows // ep
        if ep == 1 and tp == 1 and experts < left and self.second % left == 0:
            per_index = self.numel // self.second
            return left * -(-self.second // left) * per_index
        return ep * left * -(-experts // left) * self.columns


def norm_tensors(cfg: GPTConfig, trainable: bool = True) -> list[PlannedTensor]:
    """A norm's scale, and LayerNorm's bias where the model has biases (RMSNorm: a scale only)."""
    return [PlannedTensor(cfg.d_model, 1, trainable=trainable)] * (1 + int(cfg.bias and cfg.norm == "layernorm"))


def block_norm_tensors(cfg: GPTConfig) -> list[PlannedTensor]:
    """One of a block's norms over the residual stream, as block_tensors lists it (frozen with adapters)."""
    return norm_tensors(cfg, trainable=not cfg.lora.enabled)


QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _linear(cfg: GPTConfig, name: str, n_in: int, n_out: int, column: bool, tp: int) -> list[PlannedTensor]:
    """A projection's weight (out x in, split over tp by its output rows when column-parallel, by its input
    columns when row-parallel) and bias (split with a column-parallel weight); low-rank adapters beside it where
    lora.targets names it, the base then frozen and, under model.quantize_base=nf4, in NF4 when it is whole NF4
    groups (quantize.py)."""
    rows, columns = (n_out // tp, n_in) if column else (n_out, n_in // tp)
    lora = cfg.lora
    adapted = lora.enabled and name in lora.targets
    frozen = lora.enabled
    quantized = cfg.quantize_base == "nf4" and lora.enabled and (n_in * n_out) % NF4_GROUP == 0
    tensors = [PlannedTensor(rows, columns, trainable=not frozen, matrix=True, quantized=quantized)]
    if cfg.bias or (cfg.qkv_bias and name in QKV_PROJECTIONS):
        tensors.append(PlannedTensor(n_out // tp if column else n_out, 1, trainable=not frozen))
    if adapted:  # A (rank x in), B (out x rank), the split side as the weight's
        tensors += [PlannedTensor(lora.rank, columns, matrix=True, adapter=True),
                    PlannedTensor(rows, lora.rank, matrix=True, adapter=True)]  # fmt: skip
    return tensors


def block_tensors(cfg: GPTConfig, tp: int = 1, index: int = 0) -> list[PlannedTensor]:
    """Block `index`'s parameters on one of `tp` tensor-parallel ranks: column-parallel q, k, v (k and v as wide
    as the key/value heads) and MLP inputs, row-parallel attention output and MLP output, replicated norms; a
    mixture's router, routed experts (stacked E x d x f, no biases, split over tp by hidden units; NF4 under QLoRA)
    and shared experts as one wider MLP."""
    h, m = cfg.d_model, cfg.moe
    frozen = cfg.lora.enabled  # the adapters alone train; the base is frozen, experts included
    tensors: list[PlannedTensor] = []
    for name, (n_in, n_out, column) in block_projections(cfg, index).items():
        tensors += _linear(cfg, name, n_in, n_out, column, tp)
    # the norms before attention and the MLP (pre_norm), after each (sandwich norms); the query and key norms' scales
    # (a head's width, or the projections' split over tp)
    qk_widths = (
        (cfg.head_size, cfg.head_size)
        if cfg.qk_norm_scope == "head"
        else (cfg.attention_width // tp, cfg.kv_heads * cfg.head_size // tp)
    )
    qk_norms = [PlannedTensor(width, 1, trainable=not frozen) for width in qk_widths] if cfg.qk_norm else []
    norms = 2 * int(cfg.pre_norm) + 2 * int(cfg.sandwich_norm)
    tensors += norms * block_norm_tensors(cfg) + qk_norms
    if m.is_moe_block(index):
        f = (m.d_ff or cfg.hidden) // tp
        tensors.append(PlannedTensor(m.num_experts, h, trainable=not frozen, matrix=True))  # the router
        stacked = cfg.mlp_kind.input_projections * [(h, f)] + [(f, h)]  # w_in (, w_gate): E x h x f; w_out: E x f x h
        # under QLoRA NF4 holds a stack whose every expert is whole groups (quantize.py)
        quantized = cfg.quantize_base == "nf4" and frozen and (h * (m.d_ff or cfg.hidden)) % NF4_GROUP == 0
        tensors += [
            PlannedTensor(
                m.num_experts, n * k, trainable=not frozen, matrix=True, expert=True, quantized=quantized, second=n
            )
            for n, k in stacked
        ]
        r, inputs = cfg.lora.rank, cfg.mlp_kind.input_projections
        adapters = []  # each adapted expert projection's A (E x in x r) and B (E x r x out): model/moe.py
        if cfg.lora.adapts("experts_in"):
            adapters += [(h, r), (r, inputs * f)]
        if cfg.lora.adapts("experts_out"):
            adapters += [(f, r), (r, h)]
        tensors += [PlannedTensor(m.num_experts, n * k, expert=True, adapter=True, second=n) for n, k in adapters]
    return tensors


def _total(tensors: list[PlannedTensor], **kind: bool) -> int:
    return sum(t.numel for t in tensors if all(getattr(t, key) == value for key, value in kind.items()))


def block_projections(cfg: GPTConfig, index: int = 0) -> dict[str, tuple[int, int, bool]]:
    """Block `index`'s linear projections (a mixture's shared experts as one MLP; not its router or routed
    experts): name -> (in, out, column-parallel)."""
    m, h, a = cfg.moe, cfg.d_model, cfg.attention_width
    kv = cfg.kv_heads * cfg.head_size
    f = ((m.d_ff or cfg.hidden) * m.shared_experts) if m.is_moe_block(index) else cfg.hidden
    shapes = {"q_proj": (h, a, True), "k_proj": (h, kv, True), "v_proj": (h, kv, True), "out_proj": (a, h, False)}
    if f:
        shapes.update(fc_in=(h, f, True), fc_out=(f, h, False))
        if cfg.mlp_kind.gated:
            shapes["fc_gate"] = (h, f, True)
    return shapes


def embedding_tensors(cfg: GPTConfig, tp: int = 1) -> list[PlannedTensor]:
    """The token embedding (split by vocabulary rows over tp) and learned positions (replicated)."""
    positions = [PlannedTensor(cfg.max_seq_len, cfg.d_model)] if cfg.position == "learned" else []
    return [PlannedTensor(cfg.padded_vocab_size // tp, cfg.d_model), *positions]


def head_tensors(cfg: GPTConfig, tp: int = 1, own_weight: bool = False) -> list[PlannedTensor]:
    """The final norm and LM head: its weight only when it is not the embedding's; a padded vocabulary's frozen
    -inf bias."""
    tensors = norm_tensors(cfg)
    if own_weight or not cfg.tie_embeddings:
        tensors.append(PlannedTensor(cfg.padded_vocab_size // tp, cfg.d_model))
    if cfg.padded_vocab_size > cfg.vocab_size:
        tensors.append(PlannedTensor(cfg.padded_vocab_size // tp, 1, trainable=False))
    return tensors


@dataclass(frozen=True)
class FamilyShapes:
    """A family's tensors as the planner sizes them, each a PlannedTensor on one of `tp` tensor-parallel ranks."""

    # (config, tp, block index) -> the block's parameters
    block: Callable[[GPTConfig, int, int], list[PlannedTensor]]
    # (config, tp) -> the input end's (token and position embeddings)
    embedding: Callable[[GPTConfig, int], list[PlannedTensor]]
    # (config, tp, the head is its own weight, not the embedding's) -> the output end's (final norm, head)
    head: Callable[[GPTConfig, int, bool], list[PlannedTensor]]


GPT_SHAPES = FamilyShapes(block_tensors, embedding_tensors, head_tensors)


def family_shapes(cfg: GPTConfig) -> FamilyShapes:
    """The shapes of `cfg`'s family (model.family)."""
    return cast(FamilyShapes, imported(model_family(cfg.family).shapes))


def block_parameters(cfg: GPTConfig, tp: int = 1, index: int = 0) -> int:
    """Block `index`'s parameters on one of `tp` tensor-parallel ranks, its adapters apart (blocks differ when some
    are mixtures of experts)."""
    return _total(family_shapes(cfg).block(cfg, tp, index), adapter=False)


def whole_model_parameters(cfg: GPTConfig) -> int:
    """Trainable parameters of the unsplit model (the tied head counted once), as `num_parameters` counts them."""
    shapes = family_shapes(cfg)
    blocks = sum(block_parameters(cfg, index=i) for i in range(cfg.n_layer))
    return blocks + _total(shapes.embedding(cfg, 1)) + _total(shapes.head(cfg, 1, False), trainable=True)


def fsdp_shards(candidate: Candidate) -> int:
    """The ranks FSDP shards each parameter over in `candidate`'s layout: 1 where it shards nothing."""
    return candidate.degrees.dp_shard_cp if candidate.sharding in ("parameters", "gradients") else 1


def holding(cfg: GPTConfig, candidate: Candidate | None = None, pp_rank: int = 0) -> Holding:
    """What pipeline rank `pp_rank` of `candidate`'s layout (each a tensor-parallel rank) holds, the whole model
    without one; a block's FSDP unit gathers 1/ep of its experts. Where FSDP shards, every count is of FSDP's
    padded tensors (PlannedTensor.sharded): what its shards hold, gather and reduce."""
    layout = candidate or Candidate("single", Degrees())
    tp, pp, ep, stages_per_rank = layout.degrees.tp, layout.degrees.pp, layout.degrees.ep, layout.pp_stages_per_rank
    shards = fsdp_shards(layout)

    def size(tensors: list[PlannedTensor], **kind: bool) -> int:
        return sum(
            t.sharded(shards, ep, tp) for t in tensors if all(getattr(t, key) == value for key, value in kind.items())
        )

    n_stages = pp * stages_per_rank
    mine = rank_stages(pp_rank, pp, stages_per_rank, schedule_spec(layout.pp_schedule).style) if pp > 1 else [0]
    layers = stage_layers(cfg.n_layer, n_stages, layout.pp_edge_blocks) if pp > 1 else [range(cfg.n_layer)]
    indices = [i for stage in mine for i in layers[stage]]
    first, last = 0 in mine, n_stages - 1 in mine
    shapes = family_shapes(cfg)
    embedding, head = (shapes.embedding(cfg, tp) if first else []), (shapes.head(cfg, tp, pp > 1) if last else [])
    root_tensors = embedding + head
    # FSDP's units outside the blocks (parallel/fsdp.py's edge_units): the embedding and the head apart, or one
    # root where they are one tied weight
    edges = [embedding, head] if not cfg.tie_embeddings or pp > 1 else [root_tensors]
    root_trainable, frozen = size(root_tensors, trainable=True), size(root_tensors, trainable=False)
    in_blocks = [shapes.block(cfg, tp, i) for i in indices]
    every = [t for tensors in [root_tensors, *in_blocks] for t in tensors]
    unpadded_trainable = sum(t.numel for t in every if t.adapter or (t.trainable and not cfg.lora.enabled))
    adapters = [size(tensors, adapter=True) for tensors in in_blocks]
    per_block = [size(tensors) for tensors in in_blocks]
    experts = [size(tensors, expert=True) for tensors in in_blocks]
    gathered_blocks = [block - share + share // ep for block, share in zip(per_block, experts)]
    root = root_trainable + frozen
    trainable = sum(per_block) + root_trainable
    matrices = sum(size(tensors, matrix=True) for tensors in in_blocks)
    largest_reduced = max([*gathered_blocks, *(size(tensors, trainable=True) for tensors in edges)])
    last_block, last_block_experts = (per_block[-1], experts[-1]) if indices else (0, 0)
    if cfg.lora.enabled:  # the adapters alone train; the base is frozen, experts included
        frozen, trainable, matrices = frozen + trainable - sum(adapters), sum(adapters), sum(adapters)
        experts, largest_reduced, last_block_experts = [0], max(adapters, default=0), 0
    return Holding(
        trainable=trainable,
        frozen=frozen,
        root=root,
        largest_unit=max([*gathered_blocks, *(size(tensors) for tensors in edges)]),
        blocks=len(indices),
        first=first,
        last=last,
        experts=sum(experts),
        mixtures=sum(1 for i in indices if cfg.moe.is_moe_block(i)),
        matrices=matrices,
        largest_reduced=largest_reduced,
        last_block=last_block,
        last_block_experts=last_block_experts,
        quantized=sum(size(tensors, quantized=True) for tensors in in_blocks),
        unpadded_trainable=unpadded_trainable,
    )
