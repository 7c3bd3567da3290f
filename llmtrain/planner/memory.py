"""Per-rank memory of a layout: model states by the ZeRO paper's accounting, activations by Korthikanti et al.

Model states (Rajbhandari et al., 2020), with Ψ the parameters a rank's part holds (after tensor and pipeline
parallelism), N the data-parallel sharding degree and K the optimizer's bytes per parameter (each optimizer's row
in llmtrain/catalog/optimizers.py counts its fp32 moments, apart for the blocks' weight matrices: Muon's keep one
fewer than AdamW's, K - 4 on their share of Ψ):
    replicas (single, ddp, tp, pp)   Ψ·param + Ψ·grad + Ψ·K
    ZeRO-1 (zero1)                   Ψ·param + Ψ·grad + Ψ·K/N
    ZeRO-2 (zero2, FSDP in stages)   Ψ·param/N + Ψ·grad/N + Ψ·K/N, plus Ψ gathered (compute dtype) for the step
    ZeRO-3 (fsdp, hsdp)              Ψ·param/N + Ψ·grad/N + Ψ·K/N, plus the two largest units gathered at a time
The paper's ZeRO-2 keeps whole parameters and no shard; llmtrain's is FSDP keeping what it gathered from forward
to backward, which holds the shard too ("gathered" is reported apart so the formulas stay visible).

Activations (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer Models"), bytes
per layer and micro-batch of s tokens × b sequences, width h, a heads, 16-bit activations, tensor degree t:
    no parallelism                       s·b·h·(34 + 5·a·s/h)
    tensor parallel                      s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tensor + sequence parallel           s·b·h·(34 + 5·a·s/h)/t, plus the projections' all-gathered inputs
                                         (whole sequence) their matmuls keep: 6·(1 - 1/t)
    selective recompute                  the 5·a·s/h term (attention scores, softmax, its dropout) is dropped
    full recompute                       2·s·b·h (/t with sequence parallelism), plus one layer while it reruns
The 5·a·s/h term exists only where attention weights are materialised: llmtrain's fused attention kernel stores
no score matrix unless model.attention_dropout > 0. The 34 = 10 + 24 is GPT-2's layer; `layer_terms` counts the
same tensors for any model of the family (grouped-query attention's narrower k and v, the MLP's own width, SwiGLU's
four stored hidden-width tensors: gate, up, silu(gate), their product). fp32 activations double everything. The
last stage adds the logits and the fp32 log-probabilities the loss keeps, s·b·V·(compute bytes + 4)/t with loss
parallelism.
A pipeline rank holds the activations of several micro-batches at its peak (`in_flight_microbatches`), and each
one's stage input and output; a context-parallel rank those of s/cp tokens (the ring keeps no score matrix: its
per-layer tensors are the fused kernel's). A mixture's blocks keep each token's top_k routed slots. Where no FSDP
casts the weights, bf16 runs under autocast (LayerTerms.under_autocast). Every term is held to the dry run over
llmtrain.bench.planner_vs_dry_run's grid (docs/planner.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmtrain.catalog import schedule_spec
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.losses import LOSS_CHUNK_VALUES
from llmtrain.model.quantize import GROUP as NF4_GROUP
from llmtrain.planner.candidates import Candidate
from llmtrain.planner.shapes import Holding

FLOAT8_BYTES = 1


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state, and of activations and gathered copies (the compute dtype)."""

    param: float = 2
    grad: float = 2
    optimizer: float = 12  # of the parameters outside the blocks' weight matrices (the optimizer's row's moments)
    compute: float = 2
    matrix_optimizer: float = 12  # of the blocks' weight matrices (the optimizer's row's matrix_moments)
    # train.float8=tensorwise: the share of the blocks' Linear weights float8 converts, which FSDP gathers in float8
    float8_share: float = 0.0
    optimizer_on_host: bool = False  # optim.offload: the optimizer's bytes are in host memory, not the device's
    nf4: float = 0.0  # model.quantize_base=nf4: bytes of a base weight NF4 holds (Holding.quantized), held and gathered

    def optimizer_bytes(self, trainable: float, matrices: float) -> float:
        return (trainable - matrices) * self.optimizer + matrices * self.matrix_optimizer

    def gathered(self, held: Holding) -> float:
        """Bytes per parameter FSDP gathers of `held`: the compute dtype, or 1 for the blocks' Linear weights
        float8 converts under float8 all-gathers (the experts' stacked weights and everything outside the blocks
        stay)."""
        if not held.total:
            return self.compute
        nf4 = held.quantized / held.total
        share = self.float8_share * (held.matrices - held.experts) / held.total
        return share * FLOAT8_BYTES + nf4 * self.nf4 + (1 - share - nf4) * self.compute


@dataclass(frozen=True)
class StepShape:
    """One rank's optimizer step as a candidate runs it: `gpt` over `microbatches` micro-batches of `rows`
    sequences of `seq_len` tokens each (before context parallelism splits them), with `recompute` (the activation
    checkpointing the candidate runs with), its states and activations `sizes` bytes a parameter."""

    gpt: GPTConfig
    seq_len: int
    rows: int
    microbatches: int
    recompute: str
    sizes: StateBytes
    loss: str = "chunked"  # a LOSS_FORMS name


@dataclass(frozen=True)
class RankMemory:
    parameters: float
    gradients: float
    optimizer: float
    gathered: float
    activations: float
    # One micro-batch per step: backward frees the activations as it makes the gradients, so the peak holds the
    # larger of the two, not both (with more, the first micro-batch's gradients wait beside the next one's).
    gradients_replace_activations: bool = False
    # a rollout's KV cache (planner/rollout.py): held while sampling, before the step's gradients exist, freed
    # before training's forward passes
    sampling: float = 0.0

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def while_sampling(self) -> float:
        """The peak of a rollout (none: the model's states and gathered parameters)."""
        return self.parameters + self.optimizer + self.gathered + self.sampling

    @property
    def while_training(self) -> float:
        if self.gradients_replace_activations:
            return self.parameters + self.optimizer + self.gathered + max(self.gradients, self.activations)
        return self.model_states + self.gathered + self.activations

    @property
    def total(self) -> float:
        return max(self.while_sampling, self.while_training)

    def as_dict(self) -> dict[str, float]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "gathered": self.gathered,
            "activations": self.activations,
            "sampling": self.sampling,
            "total": self.total,
        }


def updated_parameters(candidate: Candidate, held: Holding) -> float:
    """The parameters whose update this rank computes: all it holds, or its 1/N under ZeRO and FSDP."""
    if candidate.sharding == "none":
        return held.trainable
    d = candidate.degrees
    return held.trainable / (d.dp if candidate.sharding == "optimizer" else d.dp_shard_cp)


def model_states(candidate: Candidate, held: Holding, sizes: StateBytes) -> tuple[float, float, float, float]:
    """(parameters, gradients, optimizer, gathered) bytes of one rank holding `held`."""
    n = candidate.degrees.dp_shard_cp if candidate.sharding != "optimizer" else candidate.degrees.dp
    # FSDP holds a frozen weight (the base beside low-rank adapters) as it gathers it, in the compute dtype
    frozen = sizes.compute if candidate.sharding in ("gradients", "parameters") else sizes.param
    plain_frozen = held.frozen - held.quantized
    params = held.trainable * sizes.param + plain_frozen * min(frozen, sizes.param) + held.quantized * sizes.nf4
    trainable = held.trainable
    optimizer = 0.0 if sizes.optimizer_on_host else sizes.optimizer_bytes(trainable, held.matrices)
    sharding = candidate.sharding
    if sharding == "none":
        return params, trainable * sizes.grad, optimizer, 0.0
    if sharding == "optimizer":
        return params, trainable * sizes.grad, optimizer / n, 0.0
    states = (params / n, trainable * sizes.grad / n, optimizer / n)
    gathered = sizes.gathered(held)
    if sharding == "gradients":  # everything gathered for the step; under expert parallelism 1/ep of the experts
        return (*states, (held.total - held.experts + held.experts // candidate.degrees.ep) * gathered)
    return (*states, 2 * held.largest_unit * gathered)


def bytes_per_parameter(candidate: Candidate, sizes: StateBytes) -> float:
    """Model-state bytes per parameter of the model on one rank (the coefficient `max_parameters` divides by):
    the ZeRO paper's 16, 4 + 12/N, 2 + 14/N, 16/N with the default sizes, over tp x pp model-parallel ranks."""
    d = candidate.degrees
    split = d.tp * d.pp
    sharding = candidate.sharding
    if sizes.optimizer_on_host:
        sizes = replace(sizes, optimizer=0.0)
    if sharding == "none":
        per = sizes.param + sizes.grad + sizes.optimizer
    elif sharding == "optimizer":
        per = sizes.param + sizes.grad + sizes.optimizer / d.dp
    else:
        per = (sizes.param + sizes.grad + sizes.optimizer) / d.dp_shard_cp
        if sharding == "gradients":
            per += sizes.compute
    return per / split


@dataclass(frozen=True)
class LayerTerms:
    """A layer's stored 16-bit activations in units of s·b·h (beside the attention scores): `replicated`, what
    tensor parallelism leaves whole on every rank (the two norms' inputs, the attention and MLP inputs, the two
    residual dropout masks, which Korthikanti counts whatever the dropout rate), and `split`, what it divides by t
    (q, k, v, the attention output, the MLP's hidden tensors). GPT-2: 10 and 24 (Korthikanti's 34)."""

    replicated: float = 10.0
    split: float = 24.0
    # What model/recompute.py's selective policy keeps, per 16-bit element of s·b·h: the column-parallel matmuls'
    # outputs and the attention's (q, k and v, SDPA's output, the MLP's d_ff-wide inputs), which tensor
    # parallelism splits. GPT-2: 1 + 2 + 1 + 4 = 8.
    selective_split: float = 8.0
    # `replicated` under autocast (bf16 over fp32 weights, where FSDP does not cast): the residual stream and the
    # norms' saved tensors in fp32, and each projection's own bf16 copy of its input (q, k and v each, the MLP's
    # one or two). GPT-2: 8 + 2 x 4 = 16.
    autocast_replicated: float = 16.0
    autocast_casts: float = 8.0  # of it, each projection's bf16 copy of its input: 2 x (q, k, v, the MLP's 1 or 2)
    stream: float = 1.0  # the residual stream's bytes against bf16's: 2 under autocast
    # of `replicated`, what sequence parallelism does not cut: under autocast, each projection's bf16 copy of
    # its input, which it casts after the all-gather of the sequence
    uncut: float = 0.0

    def under_autocast(self) -> LayerTerms:
        """These terms where autocast computes (replicated tensors as autocast keeps them, an fp32 stream)."""
        return replace(self, replicated=self.autocast_replicated, stream=2.0, uncut=self.autocast_casts)


def layer_terms(cfg: GPTConfig) -> LayerTerms:
    """Korthikanti's count for this model: q and the attention output 2 + 2, k and v 2 x 2 x n_kv_head / n_head (each
    x n_head · head size / d_model where heads are not d_model / n_head wide; query and key norms 8 more each),
    the MLP kind's saved hidden tensors 2 x d_ff / d_model each (GELU's input and output, SwiGLU's gate, up,
    silu(gate) and product). RMSNorm as torch composes it outside CUDA keeps its input and the normalised copy both
    in fp32, 6 more per norm than the 16-bit input Korthikanti counts (CUDA's fused kernel keeps only that input:
    there this overestimates by 12 a block); the dry run measures the composed one."""
    kind = cfg.mlp_kind
    mlp = 2 * kind.saved_hidden * cfg.hidden / cfg.d_model
    m = cfg.moe
    # a mixture's share of the blocks: its routed experts keep their hidden tensors for each of a token's top_k
    # slots, and the routing keeps the slots gathered (bf16) and their weighted outputs in fp32 (two copies)
    mixtures = sum(m.is_moe_block(i) for i in range(cfg.n_layer)) / cfg.n_layer if m.num_experts else 0.0
    if mixtures:
        # frozen experts (the base beside low-rank adapters) need no input of their output projection for a
        # weight's gradient: autograd does not keep it
        saved = kind.saved_hidden - (1 if cfg.lora.enabled else 0)
        experts = 2 * saved * (m.d_ff or cfg.hidden) / cfg.d_model
        shared = experts * m.shared_experts
        mlp = (1 - mixtures) * mlp + mixtures * (m.top_k * experts + shared)
    # (frozen, the router and experts need neither the gathered slots nor the weighted outputs for a gradient)
    routing = 0.0 if cfg.lora.enabled else mixtures * m.top_k * (2 + 2 * 4)
    # RMSNorm keeps its input and the normalised copy in fp32, 6 bytes an element beyond the 16-bit input counted
    # in `replicated`; sandwich norms are two more, whose inputs (the branch outputs) nothing else keeps. Under
    # autocast the norms' inputs are fp32 already, and only the normalised copies are more.
    sandwich = 8.0 if cfg.sandwich_norm else 0.0
    pre_norms = cfg.norm != "layernorm" and cfg.pre_norm  # OLMo 2's blocks normalise their branches' outputs alone
    norms = (4.0 if pre_norms else 0.0) + sandwich
    composed_norms = (12.0 if pre_norms else 0.0) + 2 * sandwich
    mlp_projections = kind.input_projections
    mlp_inputs = mlp_projections * cfg.hidden / cfg.d_model
    heads = cfg.attention_width / cfg.d_model  # attention's width against the residual stream's (Qwen3: not 1)
    grouped = cfg.kv_heads / cfg.n_head
    head_norms = 8 * (1 + grouped) * heads if cfg.qk_norm else 0.0  # queries' and keys' norms, as the blocks'
    return LayerTerms(
        replicated=10.0 + composed_norms + routing,
        split=(4 + 4 * grouped) * heads + head_norms + mlp,
        selective_split=(2 + 2 * grouped) * heads + mlp_inputs,
        autocast_replicated=8.0 + 2 * norms + 2 * (3 + mlp_projections) + routing,
        autocast_casts=2 * (3 + mlp_projections),
    )


def layer_activations(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int,
    sequence_parallel: bool,
    recompute: str,
    scores_stored: bool,
    terms: LayerTerms = LayerTerms(),
) -> float:
    """Bytes per layer and micro-batch (16-bit activations): Korthikanti's count without recomputation and for
    `full` (the block's input); for `selective`, what llmtrain's policy keeps (model/recompute.py): the block's
    input, the column-parallel and attention outputs (`terms.selective_split`, split by t), and per projection
    back to the residual stream (the attention's and the MLP's) one whole-width output (the matmul's partial sum)
    and, under tensor parallelism, its reduction, which the policy keeps so that backward does not communicate
    again: the reduce-scatter's 1/t with sequence parallelism, the all-reduce's whole width without (a functional
    collective: a new tensor beside the partial sum). Under autocast (LayerTerms.under_autocast) the residual
    stream is fp32 (the block's input twice as large) and every projection casts its input itself. Held to the dry
    run (llmtrain.bench.planner_vs_dry_run)."""
    stream = terms.stream
    if recompute == "full":
        return stream * 2 * s * b * h / (t if sequence_parallel else 1)
    if recompute == "selective":
        residual = stream * (1 / t if sequence_parallel else 1.0)
        reduced = (2 / t if sequence_parallel else 2.0) if t > 1 else 0.0
        return 2 * s * b * h * (residual + terms.selective_split / t + 2 + reduced)
    scores = 5 * a * s / h if scores_stored else 0.0
    if sequence_parallel and t > 1 and not terms.uncut:
        # the projections' all-gathered inputs (whole sequence, bf16) stay with the matmuls that saved them,
        # beyond Korthikanti's sequence shards: about three a block (the 70B 3-D dry run in docs/planner.md)
        gathered = 6 * (1 - 1 / t)
        return s * b * h * ((terms.replicated + terms.split + scores) / t + gathered)
    if sequence_parallel or t == 1:
        return s * b * h * ((terms.replicated - terms.uncut + terms.split + scores) / t + terms.uncut)
    return s * b * h * (terms.replicated + (terms.split + scores) / t)


def in_flight_microbatches(schedule: str, pp: int, pp_rank: int, m: int, stages_per_rank: int) -> float:
    """Micro-batches whose activations (of all this rank's layers) pipeline rank `pp_rank` holds at its peak:
    GPipe runs every forward first; 1F1B lets rank r run pp - r ahead; interleaving adds the other virtual stages'
    warm-up, 1 + (pp - 1)/(pp·v) times more on rank 0 (Narayanan et al., 2021), and ZB-V's V as much (the dry
    run); DualPipeV pp + 1."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in ("1f1b", "1f1b_reference"):
        return float(min(m, pp - pp_rank))
    if schedule in ("interleaved_1f1b", "zero_bubble", "zbv"):
        v = stages_per_rank
        if schedule_spec(schedule).splits_backward:  # deferred weight gradients keep the later ranks' as long
            pp_rank = 0
        return min(m * v, 2 * (pp - pp_rank - 1) + (v - 1) * pp + 1) / v
    return float(min(m, pp + 1))  # dualpipev


def under_autocast(candidate: Candidate, sizes: StateBytes) -> bool:
    """Whether the layout computes in bf16 by autocast over fp32 weights: where FSDP does not shard the
    parameters (and so does not gather bf16 copies), parallel/precision.py."""
    d = candidate.degrees
    return sizes.compute == 2 and not candidate.spec.fsdp_shards(d.dp * d.cp)


def residual_bytes(candidate: Candidate, sizes: StateBytes) -> float:
    """Bytes of an element of the residual stream: fp32 under autocast (its adds run in fp32), else the compute
    dtype's."""
    return 4 if under_autocast(candidate, sizes) else sizes.compute


def activations(candidate: Candidate, held: Holding, pp_rank: int, step: StepShape) -> float:
    """Bytes of activations pipeline rank `pp_rank` holds at its peak, and the temporaries beside them."""
    d, gpt, sizes = candidate.degrees, step.gpt, step.sizes
    s, b, h, a = step.seq_len // d.cp, step.rows, gpt.d_model, gpt.n_head  # a cp rank's tokens
    scores_stored, terms = gpt.attention_dropout > 0, layer_terms(gpt)
    sp = candidate.sequence_parallel
    autocast = under_autocast(candidate, sizes)
    if autocast:
        terms = terms.under_autocast()
    per_layer = layer_activations(s, b, h, a, d.tp, sp, step.recompute, scores_stored, terms)
    in_flight = in_flight_microbatches(
        candidate.pp_schedule, d.pp, pp_rank, step.microbatches if d.pp > 1 else 1, candidate.pp_stages_per_rank
    )
    per_microbatch = held.blocks * per_layer * sizes.compute / 2
    if autocast and step.recompute != "full":
        # each micro-batch's forward casts the weights to bf16 afresh, and its matmuls keep the casts to backward
        per_microbatch += 2 * held.matrices
    if d.pp > 1:
        # a stage keeps, per micro-batch in flight, the activation it received and the one it sent (the residual
        # stream, cut by sequence parallelism), for their backward
        boundaries = int(not held.first) + int(not held.last)
        per_microbatch += boundaries * s * b * h / (d.tp if sp else 1) * residual_bytes(candidate, sizes)
    total = in_flight * per_microbatch
    buffer = pipeline_gradient_buffer(candidate, held)
    if buffer:
        # torch's schedules reduce a stage's gradients once, after its last micro-batch: until then FSDP
        # accumulates them whole, in fp32. The buffer is whole once the first micro-batch's backward is done, so it
        # sits beside the micro-batches still in flight then, not all of them (the dry run: GPT-2's pp_fsdp)
        after_first = min(in_flight, step.microbatches - 1)
        total = max(total, after_first * per_microbatch + buffer)
    fresh = fresh_embedding_gradient(candidate, held, step)
    if fresh:
        # the embedding's backward, a micro-batch's last op, writes its rows' gradient before adding it to the
        # accumulated one: beside the micro-batches still in flight (the dry run: 3-D's first stage)
        total = max(total, (in_flight - 1) * per_microbatch + buffer + fresh)
    rerun = layer_activations(s, b, h, a, d.tp, sp, "none", scores_stored, terms) * sizes.compute / 2
    if step.recompute == "full" and held.blocks:  # the layer being recomputed holds its activations meanwhile
        total += rerun
    if held.last:
        total += loss_activations(candidate, step, s * b)
    return total + gradient_being_reduced(candidate, held, sizes) + dequantized_experts(candidate, gpt)


# torchao's NF4 dequantisation goes through fp32: at its peak it holds three times the dequantised tensor's bf16
# bytes (its fp32 copy and the result; measured on its ops, and Qwen3-30B-A3B's dry run agrees)
DEQUANTIZING_PEAK = 3


def dequantized_experts(candidate: Candidate, gpt: GPTConfig) -> float:
    """A block's NF4 experts (model.quantize_base=nf4 under QLoRA) dequantised while it computes, one stack at a time
    (model/moe.py's _FrozenStack): this rank's experts, at torchao's dequantising peak; 0 where NF4 holds none."""
    m, d = gpt.moe, candidate.degrees
    width = m.d_ff or gpt.hidden
    if not (
        m.num_experts and gpt.quantize_base == "nf4" and gpt.lora.enabled and (gpt.d_model * width) % NF4_GROUP == 0
    ):
        return 0.0
    stack = m.num_experts // d.ep * gpt.d_model * width // d.tp
    return DEQUANTIZING_PEAK * stack * 2  # bf16, the dtype NF4 dequantises to


def fresh_embedding_gradient(candidate: Candidate, held: Holding, step: StepShape) -> float:
    """The token embedding's fp32 gradient of one micro-batch (this rank's vocabulary rows) where autograd adds it
    to the weight's gradient accumulated over the micro-batches (no FSDP: fp32 weights under autocast); 0 on a rank
    without the embedding, where it does not train, or under FSDP, whose gradients it reduces or accumulates
    itself (the dry run: pp_fsdp's first stage holds no such copy beside its buffer)."""
    d, gpt = candidate.degrees, step.gpt
    if not held.first or gpt.lora.enabled or step.microbatches == 1 or candidate.spec.fsdp_shards(d.dp * d.cp):
        return 0.0
    return gpt.padded_vocab_size // d.tp * gpt.d_model * 4


def pipeline_gradient_buffer(candidate: Candidate, held: Holding) -> float:
    """The fp32 gradients FSDP accumulates whole inside a pipeline stage until the schedule reduces them, less
    the shards the model state counts (0 without FSDP in the stages)."""
    d = candidate.degrees
    if d.pp == 1 or not candidate.spec.fsdp_shards(d.dp * d.cp):
        return 0.0
    return held.unpadded_trainable * 4 - held.trainable * 4 / d.dp_shard_cp


# How a run's loss holds the logits (parallel/step_setup.py): `chunked`, llmtrain's eager loss, a chunk of positions
# at a time where they exceed one (model.chunked_cross_entropy); `fused`, train.compile's graph, which never writes
# them in fp32; `whole`, an eager loss over all of them at once (torchtitan's, which its published runs used).
LOSS_FORMS = ("chunked", "fused", "whole")


def loss_activations(candidate: Candidate, step: StepShape, positions: int) -> float:
    """What the loss over a micro-batch of `positions` holds at its peak, per micro-batch in flight. Whole (over
    vocabulary shards, which llmtrain never chunks, or values that fit one chunk): its fp32 log-probabilities kept,
    two fp32 gradients of that size in backward (the log-probabilities' and the logits'; a pipeline's last stage
    returns no logits: parallel/pipelined.py). Chunked: the logits kept in the compute dtype, their gradient beside
    them, and one chunk's fp32 log-probabilities and their two gradients. Fused: the logits and their gradient
    alone."""
    d, vocabulary = candidate.degrees, step.gpt.padded_vocab_size
    logits_in_flight = step.microbatches if candidate.pp_schedule == "gpipe" and d.pp > 1 else 1
    values = positions * vocabulary
    split = candidate.loss_parallel and d.tp > 1
    form = "whole" if split else "chunked" if step.loss == "fused" and d.tp > 1 else step.loss
    if form == "whole" or (form == "chunked" and values <= chunk_values(vocabulary)):
        return (logits_in_flight * 4 + 2 * 4) * values / (d.tp if split else 1)
    chunk = 3 * 4 * chunk_values(vocabulary) if form == "chunked" else 0
    return (logits_in_flight + 1) * step.sizes.compute * values + chunk


def chunk_values(vocabulary: int) -> int:
    """The fp32 values in one of the chunked loss's chunks: whole rows of the vocabulary."""
    return max(1, LOSS_CHUNK_VALUES // vocabulary) * vocabulary


def gradient_being_reduced(candidate: Candidate, held: Holding, sizes: StateBytes) -> float:
    """FSDP's unit being reduced: its gradient in the compute dtype and, where that is not fp32, the fp32 copy the
    reduce-scatter takes. A temporary of every token count, beside the activations. The unit has been resharded
    by then (ZeRO-2 too, after its backward): its gathered copy, counted in `model_states`' gathered, is free, and
    the reduction fills it first (the dry run's peak shows it)."""
    if candidate.sharding not in ("parameters", "gradients"):
        return 0.0
    reduced = held.largest_reduced * (sizes.compute + (4 if sizes.compute != 4 else 0))
    return max(0.0, reduced - held.largest_unit * sizes.gathered(held))
