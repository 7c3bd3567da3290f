"""A layout's plan (memory per rank, traffic per step, predicted step time), and the choice among layouts.

Step time = compute + pipeline bubble + the communication nothing hides:
- compute: the model's training FLOPs per token (6N + attention, llmtrain/model/gpt.py; 8N-equivalent with full
  recompute) x the rank's tokens / (peak x hardware.mfu); a CPU without a listed peak is timed with a matmul;
- bubble: (pp - 1)/m of the compute for GPipe and 1F1B, divided by the virtual stages when interleaved, and by
  another 3 for the zero-bubble schedules (their backward splits fill most of it);
- communication (links.py): DDP's and FSDP's gradient and parameter traffic overlaps the compute and costs only
  what exceeds it; ZeRO-1's reduce-scatter and all-gather, tensor parallelism's per-layer collectives and
  pipeline sends sit on the critical path.
The estimate ranks layouts; it is not a benchmark (llmtrain.bench.layout_benchmark measures them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import reduce
from typing import Any

from llmtrain.catalog import MOMENT_BYTES, OPTIMIZERS, schedule_spec
from llmtrain.model.flops import attention_flops_per_token, flops_per_token
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.planner.candidates import Candidate
from llmtrain.planner.comm import (
    Traffic,
    context_parallel_traffic,
    data_parallel_traffic,
    expert_parallel_traffic,
    muon_traffic,
    pipeline_traffic,
    tensor_parallel_traffic,
)
from llmtrain.planner.links import Links
from llmtrain.planner.memory import (
    RankMemory,
    StateBytes,
    StepShape,
    activations,
    bytes_per_parameter,
    model_states,
    updated_parameters,
)
from llmtrain.planner.rollout import (
    RolloutRank,
    RolloutSpeed,
    Sampling,
    kv_cache_bytes,
    rollout_rank,
    rollout_seconds,
    unsampled,
)
from llmtrain.planner.shapes import Holding, holding, whole_model_parameters

GIB = 2**30
TIE_TOLERANCE = 0.03
# How far the planner's peak per rank may fall below the dry run's over llmtrain.bench.planner_vs_dry_run's grid
# (its worst today: 16.4% short, Llama's fsdp_tp without sequence parallelism at 64 ranks; tests/planner/
# test_dry_run.py holds a daily sample to it): a layout fits when its planned peak leaves that much of the usable
# memory free, so that what the pick really holds fits.
PEAK_ERROR_BOUND = 0.20


@dataclass(frozen=True)
class FeatureSpeeds:
    """Step speed with a feature against without it, as measured on the device (hardware.*_speed); 1: unmeasured."""

    compile: float = 1.0
    float8: float = 1.0
    document_mask: float = 1.0
    selective_recompute: float = 1.0


@dataclass(frozen=True)
class Machine:
    """What the plan runs on: ranks, memory and speed per rank, links."""

    world_size: int
    ranks_per_node: int
    memory_bytes: float  # per rank
    reserved_bytes: float  # of it, kept for the CUDA context, communication buffers and fragmentation
    peak_flops: float  # per rank, for the run's precision
    mfu: float  # of eager bf16 training without the features `speeds` scales
    links: Links
    speeds: FeatureSpeeds = FeatureSpeeds()
    memory_bandwidth: float = float("inf")  # bytes/s a rank reads its memory at (decoding's limit); inf: not known
    # seconds to launch one expert's matmul where the experts run one by one (no fused grouped GEMM); 0: they do not
    expert_launch_s: float = 0.0

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes

    @property
    def plannable_bytes(self) -> float:
        """What a layout's planned peak may take: the usable memory less the planner's error bound."""
        return self.usable_bytes * (1 - PEAK_ERROR_BOUND)


@dataclass(frozen=True)
class Workload:
    """The model and batch being planned."""

    gpt: GPTConfig
    seq_len: int
    batch_size: int
    micro_batch_size: int
    recompute: str  # train.activation_checkpointing
    sizes: StateBytes
    parameters: int | None = None  # "what if" override of the model's parameter count (model states only)
    optimizer: str = "adamw"  # optim.name
    whole_matrices: str = "spread"  # optim.whole_matrices: how Muon assembles split matrices
    loss: str = "chunked"  # how the loss holds the logits (memory.LOSS_FORMS): train.compile's fused, or eager
    # forward passes a step makes without gradients besides training's: DPO's reference and policy (train/dpo.py)
    forwards_alone: int = 0
    compile: bool = False  # train.compile
    float8: bool = False  # train.float8 other than none
    document_mask: bool = False  # train.attention=document
    sampling: Sampling | None = None  # a step samples completions first (train.objective=grpo)

    def speeds(self, speeds: FeatureSpeeds, recompute: str) -> tuple[float, float]:
        """The speed of (the weights' matmuls and what compiles around them, the attention kernel) against eager
        bf16 without these features, on a device that measured `speeds`: compile and float8 act on the first
        (the attention is one fused kernel either way, which float8 leaves in bf16), document masks on the
        second, recomputation on both."""
        matmuls = speeds.compile if self.compile else 1.0
        matmuls *= speeds.float8 if self.float8 else 1.0
        attention = speeds.document_mask if self.document_mask else 1.0
        recomputing = speeds.selective_recompute if recompute == "selective" else 1.0
        return matmuls * recomputing, attention * recomputing

    def step(self, candidate: Candidate) -> StepShape:
        """One rank's step of this workload under `candidate`, with the micro-batch size and recomputation it
        turns where it turns them."""
        micro_batch_size = candidate.micro_batch_size or self.micro_batch_size
        rows, microbatches = candidate.micro_batching(self.batch_size, micro_batch_size)
        recompute = candidate.recompute or self.recompute
        return StepShape(self.gpt, self.seq_len, rows, microbatches, recompute, self.sizes, self.loss)


@dataclass
class LayoutCost:
    candidate: Candidate
    ranks: list[RankMemory]  # per pipeline rank (one entry without a pipeline)
    traffic: list[Traffic]  # per pipeline rank
    fits: bool
    compute_s: float
    bubble_s: float
    comm_s: float
    exposed_comm_s: float
    max_parameters: int
    max_parameters_with_activations: int
    # What the planner's memory does not model for this layout, in words; such a layout never fits (auto skips it)
    unmodelled: str | None = None
    sampling_s: float = 0.0  # the step's rollout before training (planner/rollout.py)
    gathers_once: bool = False  # the rollout gathers FSDP's weights once, not for every decoded token

    @property
    def name(self) -> str:
        return self.candidate.name

    @property
    def heaviest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def step_time_s(self) -> float:
        return self.sampling_s + self.compute_s + self.bubble_s + self.exposed_comm_s

    @property
    def comm_bytes_per_step(self) -> float:
        return max(sum(t.bytes.values()) for t in self.traffic)

    def as_dict(self) -> dict[str, Any]:
        busiest = max(self.traffic, key=lambda t: sum(t.bytes.values()))
        return {
            "layout": self.name,
            "command_line": self.candidate.command_line(),
            "degrees": self.candidate.degrees.__dict__,
            "per_rank_bytes": {k: round(v) for k, v in self.heaviest.as_dict().items()},
            "per_pipeline_rank_bytes": [{k: round(v) for k, v in r.as_dict().items()} for r in self.ranks],
            "fits": self.fits,
            "comm_bytes_per_step": round(self.comm_bytes_per_step),
            "comm_bytes_by_op": {op: round(b) for op, b in sorted(busiest.bytes.items())},
            "comm_bytes_by_pipeline_rank": [{op: round(b) for op, b in sorted(t.bytes.items())} for t in self.traffic],
            "step_time_s": self.step_time_s,
            "sampling_s": self.sampling_s,
            "gathers_once": self.gathers_once,
            "compute_s": self.compute_s,
            "bubble_s": self.bubble_s,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "max_parameters": self.max_parameters,
            "max_parameters_with_activations": self.max_parameters_with_activations,
            "unmodelled": self.unmodelled,
        }


def _scaled(held: Holding, factor: float) -> Holding:
    if factor == 1.0:
        return held
    return replace(
        held,
        trainable=round(held.trainable * factor),
        frozen=round(held.frozen * factor),
        root=round(held.root * factor),
        largest_unit=round(held.largest_unit * factor),
        matrices=round(held.matrices * factor),
        largest_reduced=round(held.largest_reduced * factor),
        quantized=round(held.quantized * factor),
        unpadded_trainable=round(held.unpadded_trainable * factor),
    )


def _spans_nodes(candidate: Candidate, dim: str, ranks_per_node: int) -> bool:
    """Whether a group along mesh dimension `dim` crosses nodes (consecutive ranks share the inner dimensions)."""
    d = candidate.degrees
    inner = {
        "tp": 1,
        "cp": d.tp,
        "dp_shard_cp": d.tp,
        "ep": d.tp,  # ep is the inner part of dp_shard x cp
        "dp_shard": d.tp * d.cp,
        "dp_replicate": d.tp * d.cp * d.dp_shard,
        "pp": d.tp * d.cp * d.dp,
    }[dim]
    return inner * getattr(d, dim) > ranks_per_node


def _bubble_fraction(c: Candidate, m: int) -> float:
    pp = c.degrees.pp
    if pp == 1:
        return 0.0
    v = c.pp_stages_per_rank
    fraction = (pp - 1) / (m * v)
    return fraction / 3 if schedule_spec(c.pp_schedule).splits_backward else fraction


# What hides a term of a rank's communication: the step's compute, under DDP's and FSDP's overlap (OVERLAPPED); the
# attention blocks, which the context-parallel ring posts each transfer ahead of (RING); nothing (EXPOSED).
OVERLAPPED, RING, EXPOSED = "overlapped", "ring", "exposed"


def layout_cost(c: Candidate, work: Workload, machine: Machine) -> LayoutCost:
    d, gpt, step = c.degrees, work.gpt, work.step(c)
    factor = work.parameters / whole_model_parameters(gpt) if work.parameters else 1.0
    rollout = rollout_rank(work.sampling, d, work.batch_size, work.seq_len) if work.sampling else None
    ranks: list[RankMemory] = []
    traffic: list[Traffic] = []
    comm_s = dict.fromkeys((OVERLAPPED, EXPOSED, RING), 0.0)  # the slowest pipeline rank's, by what hides it
    for pp_rank in range(d.pp):
        held = holding(gpt, c, pp_rank)
        scaled = _scaled(held, factor)
        states = model_states(c, scaled, work.sizes)
        acts = activations(c, held, pp_rank, step)
        cache = kv_cache_bytes(gpt, d, rollout, work.sizes.compute) if rollout else 0.0
        replaced = step.microbatches == 1 and d.pp == 1
        ranks.append(RankMemory(*states, acts, gradients_replace_activations=replaced, sampling=cache))
        terms = _communication(c, work, machine, step, pp_rank, held, scaled)
        traffic.append(reduce(Traffic.merge, (term for _, term, _ in terms)))
        rank_s = dict.fromkeys(comm_s, 0.0)
        for hidden_by, _, seconds in terms:
            rank_s[hidden_by] += seconds
        comm_s = {hidden_by: max(slowest, rank_s[hidden_by]) for hidden_by, slowest in comm_s.items()}
    tokens_per_rank = work.batch_size * work.seq_len / machine.world_size
    whole = holding(gpt)
    # low-rank adapters: their weights are matmuls too, and the frozen base's weights need no gradient
    adapters = whole.trainable if gpt.lora.enabled else 0
    n_params = whole_model_parameters(gpt) - gpt.padding_parameters + adapters
    # a forward is a third of a training step's flops (backward two): full recomputation runs it once more, and
    # DPO twice more without gradients
    forwards = 1 + (step.recompute == "full") + work.forwards_alone
    per_token = flops_per_token(gpt, n_params, work.seq_len, adapters if gpt.lora.enabled else None)
    attention = attention_flops_per_token(gpt, work.seq_len)
    matmul_speed, attention_speed = work.speeds(machine.speeds, step.recompute)
    seconds_per_flop = (per_token - attention) / matmul_speed + attention / attention_speed
    compute = seconds_per_flop * tokens_per_rank * (forwards + 2) / 3 / (machine.peak_flops * machine.mfu)
    compute += experts_one_by_one_s(c, gpt, step, machine, forwards)
    overlapped = comm_s[OVERLAPPED]
    exposed = comm_s[EXPOSED] + (max(0.0, overlapped - compute) if c.spec.overlaps else overlapped)
    exposed += max(0.0, comm_s[RING] - compute)
    heaviest = max(ranks, key=lambda r: r.total)
    unmodelled = unmodelled_memory(c, gpt, step) or (unsampled(d, c.sequence_parallel) if rollout else None)
    sampling_s, once = 0.0, False
    if rollout:
        ranks, sampling_s, once = _rollout(c, work, machine, ranks, rollout, whole, factor, n_params)
        heaviest = max(ranks, key=lambda r: r.total)
    matrix_share = whole.matrices / whole.trainable
    per_param = bytes_per_parameter(c, replace(work.sizes, optimizer=work.sizes.optimizer_bytes(1, matrix_share)))
    return LayoutCost(
        candidate=c,
        ranks=ranks,
        traffic=traffic,
        fits=heaviest.total <= machine.plannable_bytes and unmodelled is None,
        compute_s=compute,
        bubble_s=compute * _bubble_fraction(c, step.microbatches),
        comm_s=overlapped + comm_s[EXPOSED] + comm_s[RING],
        exposed_comm_s=exposed,
        max_parameters=int(machine.usable_bytes // per_param),  # model states: exact (the dry run agrees to 1%)
        max_parameters_with_activations=max(0, int((machine.plannable_bytes - heaviest.activations) // per_param)),
        unmodelled=unmodelled,
        sampling_s=sampling_s,
        gathers_once=once,
    )


def experts_one_by_one_s(c: Candidate, gpt: GPTConfig, step: StepShape, machine: Machine, forwards: int) -> float:
    """Where the card has no fused grouped GEMM (Machine.expert_launch_s > 0), what a rank's mixtures cost beyond
    their FLOPs: each matmul of each of its experts launched on its own after a host read, forward (`forwards`
    passes) and backward (the input's gradient, and the weights' where they train), in every micro-batch."""
    m = gpt.moe
    if not (m.num_experts and machine.expert_launch_s):
        return 0.0
    mixtures = sum(m.is_moe_block(i) for i in range(gpt.n_layer)) / c.degrees.pp
    backward = 1 if gpt.lora.enabled else 2
    matmuls = gpt.mlp_kind.matrices * (m.num_experts // c.degrees.ep) * (forwards + backward)
    return step.microbatches * mixtures * matmuls * machine.expert_launch_s


def _rollout(
    c: Candidate,
    work: Workload,
    machine: Machine,
    ranks: list[RankMemory],
    rollout: RolloutRank,
    whole: Holding,
    factor: float,
    n_params: int,
) -> tuple[list[RankMemory], float, bool]:
    """A sampling step's rollout (planner/rollout.py) on this layout: the ranks' memory with it, its seconds, and
    whether FSDP's weights are gathered once for it (rl.gather_weights; `auto`: where the whole model fits)."""
    d, gpt = c.degrees, work.gpt
    assert work.sampling is not None, "a rollout is planned for a sampling workload"
    forward = flops_per_token(gpt, n_params, work.seq_len) / 3  # a forward pass: a third of full training's
    held_bytes = (whole.total - whole.quantized) * work.sizes.compute + whole.quantized * work.sizes.nf4
    weight_bytes = held_bytes * factor / d.tp  # what a rank computes with: its tensor-parallel share of every weight
    sharded = c.sharding == "parameters"
    gathering = [replace(r, sampling=r.sampling + weight_bytes) for r in ranks]
    once = sharded and (
        work.sampling.gather == "once"
        or (work.sampling.gather == "auto" and max(r.while_sampling for r in gathering) <= machine.plannable_bytes)
    )
    gathers, reductions = Traffic(), Traffic()
    if sharded:  # every block, once or for each decoded token
        gathers.add("all_gather", weight_bytes * (d.dp_shard - 1) / d.dp_shard, gpt.n_layer)
    if d.tp > 1:  # each decoded token's activations summed after every block's attention and MLP
        reductions.add("all_reduce", 2 * gpt.n_layer * rollout.rows * gpt.d_model * work.sizes.compute, 2 * gpt.n_layer)

    def seconds(traffic: Traffic, dim: str) -> float:
        return sum(_seconds(machine, traffic, op, *_group(c, dim, op, machine.ranks_per_node)) for op in traffic.bytes)

    # a row's forward is computed by its tensor-parallel group together, each rank over its share of the weights
    flops = machine.peak_flops * machine.mfu * d.tp
    speed = RolloutSpeed(flops, machine.memory_bandwidth, seconds(gathers, "dp"), seconds(reductions, "tp"))
    cache = kv_cache_bytes(gpt, d, rollout, work.sizes.compute)
    return gathering if once else ranks, rollout_seconds(rollout, forward, weight_bytes, cache, speed, once), once


def _communication(
    c: Candidate, work: Workload, machine: Machine, step: StepShape, pp_rank: int, held: Holding, scaled: Holding
) -> list[tuple[str, Traffic, float]]:
    """Pipeline rank `pp_rank`'s communication per step, term by term: (what hides it, its bytes between ranks, its
    seconds), in the order the seconds add up (floating point: another order moves the predictions' last digits).
    `scaled`: what the rank holds, scaled to work.parameters."""

    def along(dim: str, term: Traffic) -> tuple[Traffic, float]:
        """The term's bytes and seconds, over the ranks of mesh dimension `dim` ("dp": the one each op uses)."""
        return term, sum(_seconds(machine, term, op, *_group(c, dim, op, machine.ranks_per_node)) for op in term.bytes)

    muon_dp, muon_tp = Traffic(), Traffic()
    if OPTIMIZERS[work.optimizer].needs_whole_matrices:  # in the optimizer step: nothing to hide it behind
        muon_dp, muon_tp = muon_traffic(c, work.gpt, scaled, work.whole_matrices)
    # optim.offload: gradients down and weights up the host link (not between ranks), fp32, nothing hides it
    host_bytes = 2 * MOMENT_BYTES[32] * updated_parameters(c, scaled) if work.sizes.optimizer_on_host else 0.0
    return [
        (OVERLAPPED, *along("dp", data_parallel_traffic(c, scaled, step))),
        (EXPOSED, *along("tp", tensor_parallel_traffic(c, held, step))),
        (EXPOSED, *along("tp", muon_tp)),
        (EXPOSED, *along("dp", muon_dp)),
        (EXPOSED, *along("pp", pipeline_traffic(c, pp_rank, step))),
        (EXPOSED, Traffic(), host_bytes / (machine.links.intra * 1e9)),
        (RING, *along("cp", context_parallel_traffic(c, held, step))),
        # The exchange waits for the routing before it and the experts wait for it: nothing hides it.
        (EXPOSED, *along("ep", expert_parallel_traffic(c, held, step))),
    ]


def unmodelled_memory(c: Candidate, gpt: GPTConfig, step: StepShape) -> str | None:
    """Why the planner's memory for this layout cannot be trusted to PEAK_ERROR_BOUND, where the dry run's grid
    (llmtrain.bench.planner_vs_dry_run) shows a term it does not model; None where it can."""
    d, m = c.degrees, gpt.moe
    expert_shards = d.dp_shard_cp // d.ep if c.sharding in ("parameters", "gradients") else 1
    if m.num_experts and expert_shards > m.num_experts // d.ep:
        return (
            f"FSDP splits each rank's {m.num_experts // d.ep} expert(s) over {expert_shards} ranks, finer than by "
            f"expert: its padding and copies of the gathered experts are not modelled"
        )
    if d.pp == 1:
        return None
    if m.num_experts:
        return "experts inside pipeline stages: the routed slots each stage keeps per micro-batch in flight"
    if not c.spec.fsdp_shards(d.dp * d.cp) and step.recompute != "none":
        return "recomputation in pipeline stages without FSDP (autocast's casts of each micro-batch's rerun)"
    return None


def _dp_dim(c: Candidate, op: str) -> str:
    if c.spec.mechanism.sharding != "parameters" or c.degrees.dp_shard_cp == 1 or op == "all_reduce":
        return "dp_replicate"
    return "dp_shard_cp"


def _group(c: Candidate, dim: str, op: str, ranks_per_node: int) -> tuple[int, bool]:
    """The ranks an op along mesh dimension `dim` runs over (a pair for a point-to-point op; "dp": the data-parallel
    dimension the op uses), and whether they span nodes."""
    dim = _dp_dim(c, op) if dim == "dp" else dim
    return 2 if op in ("send", "recv") else getattr(c.degrees, dim), _spans_nodes(c, dim, ranks_per_node)


def _seconds(machine: Machine, traffic: Traffic, op: str, group: int, spans_nodes: bool) -> float:
    return machine.links.seconds(op, traffic.bytes[op], traffic.message_bytes(op), group, spans_nodes)


@dataclass(frozen=True)
class Decision:
    chosen: LayoutCost | None
    runner_up: LayoutCost | None
    reason: str


def choose(plans: list[LayoutCost], machine: Machine) -> Decision:
    """The fastest layout that fits (ties within 3% to the simplest), the runner-up, and why, in one line."""
    usable = machine.plannable_bytes / GIB
    fitting = sorted((p for p in plans if p.fits), key=lambda p: p.step_time_s)
    fitting_names = {f.name for f in fitting}
    unsized = list(dict.fromkeys(p.name for p in plans if p.unmodelled and p.name not in fitting_names))
    too_big = list(
        dict.fromkeys(p.name for p in plans if not p.fits and p.name not in fitting_names and p.name not in unsized)
    )
    if not plans:
        return Decision(None, None, "no layout can split this model and batch over these ranks")
    if not fitting:
        smallest = min((p for p in plans if p.unmodelled is None), key=lambda p: p.heaviest.total, default=None)
        if smallest is None:
            return Decision(None, None, f"the planner cannot size any layout here: {plans[0].unmodelled}")
        return Decision(
            None,
            smallest,
            f"no layout fits {usable:.1f} GiB per rank (the usable memory less the planner's "
            f"{PEAK_ERROR_BOUND:.0%} error bound): the smallest, {smallest.name}, needs "
            f"{smallest.heaviest.total / GIB:.1f} GiB",
        )
    fastest = fitting[0].step_time_s
    close = [p for p in fitting if p.step_time_s <= fastest * (1 + TIE_TOLERANCE)]
    # Ties go to the simplest layout (the earliest row of LAYOUTS), then to the fewest knobs turned away from the
    # configured ones.
    chosen = min(close, key=lambda p: (p.candidate.simplicity, len(p.candidate.train_values())))
    others = [p for p in fitting if p.name != chosen.name]  # another layout, not the same with other knobs
    runner_up = others[0] if others else None
    why = "the fastest that fits" if chosen is fitting[0] else f"within {TIE_TOLERANCE:.0%} of the fastest and simpler"
    reason = (
        f"{_described(chosen)}: {why} ({chosen.heaviest.total / GIB:.2f} of {usable:.2f} GiB per rank, "
        f"{chosen.step_time_s:.3g} s/step predicted)"
    )
    if runner_up:
        reason += (
            f"; runner-up {_described(runner_up)} ({runner_up.heaviest.total / GIB:.2f} GiB, "
            f"{runner_up.step_time_s:.3g} s)"
        )
    if too_big:
        reason += f"; too big: {', '.join(too_big)}"
    if unsized:
        reason += f"; not sized by the planner: {', '.join(unsized)}"
    return Decision(chosen, runner_up, reason)


def _described(plan: LayoutCost) -> str:
    """The layout's name and the train.* knobs it turned, if any."""
    knobs = " ".join(f"train.{key}={value}" for key, value in plan.candidate.train_values().items())
    return f"{plan.name} with {knobs}" if knobs else plan.name
