"""Bytes one rank communicates per optimizer step, by collective, as llmtrain's layouts issue them.

Sizes follow nccl-tests (the whole buffer: an all-gather's output, a reduce-scatter's input), with Ψ the
parameters of the rank's part (after tensor and pipeline parallelism), k micro-batches per step and b·s·h one
micro-batch's residual stream:
- ddp: one all-reduce of the gradients, Ψ (no_sync skips all but the last micro-batch);
- zero1: reduce-scatter Ψ of gradients, all-gather Ψ of updated parameters;
- zero2: per micro-batch all-gather Ψ (kept to backward), reduce-scatter Ψ;
- fsdp: per micro-batch all-gather Ψ in forward and Ψ − root again in backward (the root unit stays gathered),
  reduce-scatter Ψ: about 3Ψ;
- hsdp: fsdp's over dp_shard, plus an all-reduce of the Ψ/dp_shard gradient shard over dp_replicate;
- FSDP inside pipeline stages: gathered once and reduced once per step (the schedule defers both);
- tp: per micro-batch and block 4 all-reduces of b·s·h (Megatron's f and g, forward and backward), or with
  sequence parallelism 4 all-gathers + 4 reduce-scatters (a mixture block's MLP instead all-reduces top_k·b·s·h
  forward and backward, see tensor_parallel_traffic); the vocabulary-parallel embedding adds one forward
  and the head one backward (an all-gather and a reduce-scatter with sequence parallelism), and sequence
  parallelism all-reduces the replicated position embedding's gradient (max_seq_len·h) each micro-batch;
- pp: b·s·h sent per micro-batch across each stage boundary that leaves the rank, forward (activations) and
  backward (their gradients); the tied embedding and head, on the first and last stage, all-reduce their
  gradient (V·h/t) once per step.
- cp: a rank's s is s/cp (tp and pp traffic shrink with it), FSDP shards over dp_shard x cp, and per block and
  micro-batch the ring passes a rank's keys and values (2·b·(s/cp)·h_kv/t, h_kv the key/value width) cp-1 times
  in forward and again in backward, plus their fp32 gradient cp times in backward.
- ep: FSDP gathers and reduces 1/ep of each mixture's experts (over the dp_shard x cp / ep ranks left), and per
  mixture block and micro-batch two all-to-alls carry the routed slots (top_k·b·(s/cp)·h, every tp rank its own
  copy) to their experts and back in forward, two carry their gradients in backward, and one the per-expert
  counts (E integers) before each.
- muon (optim=muon): the whole matrices Newton-Schulz needs, as fp32 updates of Ψm, the blocks' weight matrices:
  zero1 all-gathers Ψm (its slices cut across matrices); FSDP over N = dp_shard x cp ranks sends each rank's
  shard of them in two all-to-alls (optim.whole_matrices=spread: each matrix whole on one rank and back; N
  matrices per exchange), or all-gathers Ψm (gather, and always with tp > 1); tensor parallelism all-gathers
  the whole matrices, Ψm·tp, over tp. Experts split by expert parallelism are whole where they are.
Scalars (losses, gradient norms) are left out.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from llmtrain.catalog import MOMENT_BYTES, schedule_spec
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.parallel.pipeline.split import rank_stages, stage_rank
from llmtrain.planner.candidates import Candidate
from llmtrain.planner.memory import StepShape, residual_bytes
from llmtrain.planner.shapes import Holding

# The ops a plan names, as comm_bench and the counter name them.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send", "recv")
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb


@dataclass
class Traffic:
    """Bytes and calls per op of one rank's step (calls give the message size the link's speed depends on)."""

    bytes: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)

    def add(self, op: str, nbytes: float, calls: int) -> None:
        if nbytes > 0:
            self.bytes[op] += round(nbytes)
            self.calls[op] += calls

    def merge(self, other: Traffic) -> Traffic:
        return Traffic(self.bytes + other.bytes, self.calls + other.calls)

    def message_bytes(self, op: str) -> float:
        return self.bytes[op] / max(self.calls[op], 1)


def data_parallel_traffic(candidate: Candidate, held: Holding, step: StepShape) -> Traffic:
    """Gradient and parameter traffic over the data-parallel ranks, per step."""
    d, traffic, k, sizes = candidate.degrees, Traffic(), step.microbatches, step.sizes
    params, grads = held.total, held.trainable
    units = held.blocks + 1  # FSDP units: each block and the root
    if d.dp == 1 and d.cp == 1:
        return traffic
    sharding = candidate.spec.mechanism.sharding
    if sharding == "nothing":
        traffic.add("all_reduce", grads * sizes.grad, math.ceil(grads * sizes.grad / DDP_BUCKET_BYTES))
    elif sharding == "optimizer":
        traffic.add("reduce_scatter", grads * sizes.grad, 2)  # one flat buffer per weight-decay group
        traffic.add("all_gather", grads * sizes.param, 2)
    else:
        times = 1 if candidate.spec.pipeline else k
        if d.dp_shard_cp == 1:  # FSDP over replicas only (ddp_tp): nothing to shard, gradients all-reduced once
            traffic.add("all_reduce", grads * sizes.grad, units)  # per step (parallel.reduce_once_per_step's default)
            return traffic
        # Under expert parallelism FSDP gathers and reduces only this rank's 1/ep of the experts, and none where
        # ep takes every sharded rank (the experts' FSDP then spans one rank).
        experts_sharded = held.experts // d.ep if d.dp_shard_cp > d.ep else 0
        not_here = held.experts - experts_sharded
        gathers = 2 if candidate.gathers_twice else 1
        gathered = (params - not_here) * gathers
        calls = units * gathers
        if gathers == 2:  # backward starts with the root and the last block, kept gathered since forward
            last_experts = held.last_block_experts
            kept = held.root + held.last_block - last_experts + (last_experts // d.ep if d.dp_shard_cp > d.ep else 0)
            gathered -= kept
            calls -= 1 + int(held.blocks > 0)
        traffic.add("all_gather", gathered * sizes.gathered(held) * times, calls * times)
        traffic.add("reduce_scatter", (grads - not_here) * sizes.grad * times, units * times)
        if d.dp_replicate > 1:
            traffic.add("all_reduce", grads / d.dp_shard_cp * sizes.grad * times, units * times)
    return traffic


def muon_traffic(candidate: Candidate, cfg: GPTConfig, held: Holding, whole_matrices: str) -> tuple[Traffic, Traffic]:
    """(data-parallel, tensor-parallel) traffic of Muon's whole matrices, per step."""
    d, data, tensor = candidate.degrees, Traffic(), Traffic()
    count = held.blocks * (4 + cfg.mlp_kind.matrices)  # matrices held (a mixture's are fewer, bigger)
    split = (held.matrices - (held.experts if d.ep > 1 else 0)) * MOMENT_BYTES[32]
    if candidate.sharding == "optimizer" and d.dp > 1:
        data.add("all_gather", held.matrices * MOMENT_BYTES[32], 1)
    elif candidate.sharding != "none" and d.dp_shard_cp > 1:
        if whole_matrices == "spread" and d.tp == 1:
            data.add("all_to_all", 2 * split / d.dp_shard_cp, 2 * math.ceil(count / d.dp_shard_cp))
        else:
            data.add("all_gather", split, count)
    if d.tp > 1:
        tensor.add("all_gather", held.matrices * d.tp * MOMENT_BYTES[32], count)
    return data, tensor


def tensor_parallel_traffic(candidate: Candidate, held: Holding, step: StepShape) -> Traffic:
    """Tensor parallelism's collectives of the residual stream per step, those recomputation repeats, and (with
    sequence parallelism) the replicated weights' gradients."""
    d, traffic, cfg, k, sizes = candidate.degrees, Traffic(), step.gpt, step.microbatches, step.sizes
    if d.tp == 1:
        return traffic
    h, max_seq_len, bias = cfg.d_model, cfg.max_seq_len, cfg.bias
    # bf16 where FSDP casts the weights; under autocast the residual stream and the norms' outputs, which these
    # collectives carry into and out of the blocks, are fp32 (the projections' partial sums reduced with
    # sequence parallelism are bf16)
    stream = residual_bytes(candidate, sizes)
    activation = step.rows * step.seq_len // d.cp * h * sizes.compute
    exchanges = (4 * held.blocks + int(held.first) + int(held.last)) * k
    # A mixture's MLP all-reduces its routed slots (top_k per token) forward and their gradient backward, and
    # shared experts their dense pair; under sequence parallelism it gathers in and keeps its chunk out (no
    # reduce-scatter), so its two reduce-scatters (or, without, its two all-reduces) are not made.
    mixture_reduces = held.mixtures * k * (2 * cfg.moe.top_k + 2 * int(cfg.moe.shared_experts > 0))
    traffic.add("all_reduce", mixture_reduces * activation, mixture_reduces)
    # What backward's recomputation communicates again (model/recompute.py): `full` reruns each block's forward,
    # its two gathers in and two reductions out; `selective` keeps the reductions' outputs but not the gathered
    # inputs, which the matmuls' backward needs, so each block gathers its two inputs again.
    regathers = 2 * held.blocks * k if step.recompute != "none" else 0
    rereduces = 2 * held.blocks * k if step.recompute == "full" else 0
    if candidate.sequence_parallel:
        gathered = (exchanges + regathers) * activation * stream / sizes.compute
        traffic.add("all_gather", gathered, exchanges + regathers)
        exchanges -= 2 * held.mixtures * k
        traffic.add("reduce_scatter", (exchanges + rereduces) * activation, exchanges + rereduces)
        # replicated weights used on sequence shards: their partial gradients are summed once per step
        norms = 2 * held.blocks + int(held.last)
        norm_tensors = 1 + int(bias and cfg.norm == "layernorm")
        positions = int(held.first and cfg.position == "learned")
        replicated = norms * h * norm_tensors + positions * max_seq_len * h
        traffic.add("all_reduce", replicated * sizes.grad, norms * norm_tensors + positions)
    else:
        exchanges -= 2 * held.mixtures * k
        reduced = (exchanges + rereduces) * activation * stream / sizes.compute
        traffic.add("all_reduce", reduced, exchanges + rereduces)
    if held.last and candidate.loss_parallel:  # the loss on vocabulary shards: max, sum of exponentials, target
        traffic.add("all_reduce", 3 * step.rows * step.seq_len // d.cp * 4 * k, 3 * k)
    return traffic


def pipeline_traffic(candidate: Candidate, pp_rank: int, step: StepShape) -> Traffic:
    """Pipeline rank `pp_rank`'s sends and receives across its stage boundaries per step, and the tied embedding's
    gradient all-reduce."""
    d, traffic, cfg, m = candidate.degrees, Traffic(), step.gpt, step.microbatches
    if d.pp == 1:
        return traffic
    style = schedule_spec(candidate.pp_schedule).style
    n_stages = d.pp * candidate.pp_stages_per_rank
    h = cfg.d_model
    stream = residual_bytes(candidate, step.sizes)
    activation = step.rows * step.seq_len // d.cp * h // (d.tp if candidate.sequence_parallel else 1) * stream
    stages = rank_stages(pp_rank, d.pp, candidate.pp_stages_per_rank, style)
    for stage in stages:
        if stage + 1 < n_stages and stage_rank(stage + 1, d.pp, style) != pp_rank:
            traffic.add("send", activation * m, m)
            traffic.add("recv", activation * m, m)  # the gradient coming back
        if stage > 0 and stage_rank(stage - 1, d.pp, style) != pp_rank:
            traffic.add("recv", activation * m, m)
            traffic.add("send", activation * m, m)
    tied_across = (0 in stages) != (n_stages - 1 in stages)  # one copy of the tied matrix here, one elsewhere
    if cfg.tie_embeddings and tied_across:
        # (a shard of it under FSDP)
        traffic.add("all_reduce", cfg.padded_vocab_size * h // (d.tp * d.dp_shard_cp) * step.sizes.grad, 1)
    return traffic


def context_parallel_traffic(candidate: Candidate, held: Holding, step: StepShape) -> Traffic:
    """The ring's sends (and as many receives) per step: each block's keys and values, and in backward their
    gradient (fp32)."""
    d, traffic, cfg = candidate.degrees, Traffic(), step.gpt
    if d.cp == 1:
        return traffic
    kv = 2 * step.rows * (step.seq_len // d.cp) * cfg.kv_heads * cfg.head_size // d.tp
    hops = held.blocks * step.microbatches
    sent = hops * ((d.cp - 1) * 2 * kv * step.sizes.compute + d.cp * kv * 4)
    for op in ("send", "recv"):
        traffic.add(op, sent, hops * (3 * d.cp - 2))
    return traffic


def expert_parallel_traffic(candidate: Candidate, held: Holding, step: StepShape) -> Traffic:
    """The all-to-alls of expert parallelism per step: the send buffers (the bytes a rank's slots occupy, of which
    (ep-1)/ep leave it when routing is even). Per mixture and micro-batch, forward exchanges the counts, then the
    slots there and back, and backward the slots' gradients both ways; full recomputation runs forward's again."""
    d, traffic, m = candidate.degrees, Traffic(), step.gpt.moe
    if d.ep == 1 or not held.mixtures:
        return traffic
    slots = m.top_k * step.rows * (step.seq_len // d.cp) * step.gpt.d_model * step.sizes.compute
    exchanges = held.mixtures * step.microbatches
    forwards = 2 if step.recompute == "full" else 1
    calls, sent = 3 * forwards + 2, 2 * forwards + 2
    traffic.add("all_to_all", exchanges * (sent * slots + forwards * m.num_experts * 8), exchanges * calls)  # int64
    return traffic
