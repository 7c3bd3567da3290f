"""A parallel layout decided before anything is built: which layout, over which degrees of the device mesh, checked
against the model, the batch and the world size. Torch-free, so train.py refuses a layout that cannot run in a
second, before torch loads, and the planner weighs its candidates with the same checks training makes.

`ParallelPlan.of(...)` resolves and checks in one go: a plan that exists is one that runs. What it does not know is
where each rank sits in the mesh; the ParallelModel built from it (llmtrain/parallel/) adds that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmtrain.catalog import AUTO, MESH_DIMS, OBJECTIVES, LayoutSpec, layout_spec, objective_of, schedule_spec
from llmtrain.config import ModelConfig, ParallelConfig, RootConfig, TrainConfig, mlp_width
from llmtrain.errors import ConfigError

# Overrides that change nothing the planner reads: left out of the command it suggests.
_NOT_PLANNED = ("parallel.nproc", "hydra", "logging", "checkpoint", "data.path", "data.val_path", "seed")


@dataclass(frozen=True)
class Degrees:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # borrowed from dp_shard x cp, not a mesh dimension of its own (parallel/mesh.py's expert mesh)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """The ranks FSDP shards over: data-parallel shards and context-parallel ranks hold the same weights."""
        return self.dp_shard * self.cp

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(getattr(self, dim) for dim in MESH_DIMS)

    @property
    def expert_shard(self) -> int:
        """The ranks each expert's weights are sharded over (FSDP): those of dp_shard x cp that ep leaves."""
        return self.dp_shard_cp // self.ep

    def describe(self) -> str:
        split = " x ".join(f"{dim} {getattr(self, dim)}" for dim in MESH_DIMS if getattr(self, dim) > 1) or "1 rank"
        return split + (f", experts over ep {self.ep}" if self.ep > 1 else "")


def _listing(values: dict[str, int]) -> str:
    return ", ".join(f"parallel.{dim}={value}" for dim, value in values.items())


def resolve_degrees(parallel: ParallelConfig, world_size: int) -> Degrees:
    """The five degrees with a -1 (at most one) replaced by the ranks that remain; their product must be the
    world size."""
    values = {dim: int(getattr(parallel, dim)) for dim in MESH_DIMS}
    free = [dim for dim, value in values.items() if value == -1]
    if len(free) > 1:
        raise ConfigError(
            f"-1 ('the remaining ranks') is set on {' and '.join('parallel.' + d for d in free)}: "
            f"set it on at most one degree ({_listing(values)})"
        )
    if any(value == 0 or value < -1 for value in values.values()):
        raise ConfigError(f"parallel degrees must be positive or -1 ({_listing(values)})")
    fixed = math.prod(value for value in values.values() if value != -1)
    if free:
        if world_size % fixed:
            raise ConfigError(
                f"the world size {world_size} is not divisible by the fixed degrees' product {fixed} "
                f"({_listing(values)}): change them so their product divides {world_size}"
            )
        values[free[0]] = world_size // fixed
    elif fixed != world_size:
        raise ConfigError(
            f"parallel degrees multiply to {fixed} but the world size is {world_size} "
            f"({_listing(values)}): make their product {world_size}, or use -1 on one of them"
        )
    ep = int(parallel.ep)
    if ep < 1:
        raise ConfigError(f"parallel.ep={ep}: set it to a positive number of ranks (1: experts are not split)")
    shard_cp = values["dp_shard"] * values["cp"]
    if shard_cp % ep:
        raise ConfigError(
            f"parallel.ep={ep} does not divide dp_shard x cp = {shard_cp}: expert parallelism takes its ranks from "
            f"the sharded data-parallel ones; set parallel.ep to a divisor of {shard_cp}"
        )
    return Degrees(**values, ep=ep)


def micro_batching(batch_size: int, micro_batch_size: int, dp: int, pipeline_m: int | None) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches per rank and step) of a global batch over `dp` data-parallel
    ranks: a pipeline's m when it sets one (`pipeline_m`), else gradient accumulation's count."""
    count = pipeline_m or batch_size // (micro_batch_size * dp)
    return batch_size // (dp * count), count


@dataclass(frozen=True)
class ParallelPlan:
    """A layout that runs: `parallel.layout` over `degrees` on `world_size` ranks, with the parallel.* and train.*
    settings it was checked with. Made by `of`, which refuses (ConfigError) what cannot run."""

    parallel: ParallelConfig
    train: TrainConfig
    degrees: Degrees
    world_size: int

    @classmethod
    def of(cls, parallel: ParallelConfig, train: TrainConfig, model: ModelConfig, world_size: int) -> ParallelPlan:
        """The plan of these settings on `world_size` ranks, or a one-line ConfigError naming the key to change."""
        spec = layout_spec(parallel.layout)
        if not spec.dims and world_size != 1:
            raise ConfigError(
                f"parallel={parallel.layout} runs one process but the world size is {world_size}: "
                f"launch without torchrun or pick a multi-process layout (parallel=ddp, fsdp, ...)"
            )
        plan = cls(parallel, train, resolve_degrees(parallel, world_size), world_size)
        plan._check(spec, model)
        return plan

    @property
    def name(self) -> str:
        return self.parallel.layout

    @property
    def spec(self) -> LayoutSpec:
        return layout_spec(self.name)

    @property
    def dims(self) -> tuple[str, ...]:
        """The mesh dimensions the layout splits over (none: one process, no mesh)."""
        return self.spec.dims

    @property
    def pipelined(self) -> bool:
        return self.spec.pipeline

    @property
    def dp_size(self) -> int:
        return self.degrees.dp

    @property
    def microbatches(self) -> int:
        """Micro-batches per rank and step: a pipeline's m, or gradient accumulation's count."""
        return self.micro_batching()[1]

    def micro_batching(self) -> tuple[int, int]:
        """(sequences per micro-batch, micro-batches per rank and step)."""
        t = self.train
        pipeline_m = self.parallel.microbatches if self.pipelined else None
        return micro_batching(t.batch_size, t.micro_batch_size, self.degrees.dp, pipeline_m)

    def describe(self) -> str:
        """The layout, what its mechanisms do at these degrees, and the degrees, in a few words."""
        d, p, spec = self.degrees, self.parallel, self.spec
        parts = []
        if self.pipelined:
            virtual = f", {p.pp_stages_per_rank} stages/rank" if p.pp_stages_per_rank > 1 else ""
            parts.append(f"{p.pp_schedule}{virtual}, {self.microbatches} micro-batches")
        if spec.mechanism.sharding == "parameters" and d.dp * d.cp > 1:
            if d.dp_replicate > 1:
                parts.append("HSDP" if d.dp_shard_cp > 1 else "replicated")
            elif self.pipelined:
                parts.append("FSDP")
            else:
                parts.append("ZeRO-3" if p.reshard_after_forward else "ZeRO-2")
            if p.cpu_offload:
                parts.append("CPU offload")
        if d.tp > 1:
            extras = (("SP", p.sequence_parallel), ("loss parallel", p.loss_parallel))
            parts.append("TP" + "".join(f" + {name}" for name, on in extras if on))
        if d.cp > 1:
            parts.append("ring attention")
        return f"{self.name}{' ' if parts else ''}{', '.join(parts)} ({d.describe()})"

    def summary(self) -> str:
        """The start-up summary's layout line: `describe()`, and on one process that nothing is split."""
        alone = " (one process: nothing is split)" if self.world_size == 1 and self.dims else ""
        return self.describe() + alone

    def _check(self, spec: LayoutSpec, model: ModelConfig) -> None:
        d, p, t = self.degrees, self.parallel, self.train
        for dim in MESH_DIMS:
            if getattr(d, dim) > 1 and dim not in spec.dims:
                uses = ", ".join(spec.dims) or "no dimension"
                raise ConfigError(
                    f"parallel.{dim}={getattr(d, dim)} but parallel={self.name} does not split over "
                    f"{dim} (it uses {uses}): set parallel.{dim}=1 or choose a layout that has it"
                )
        if d.tp > 1 and model.quantize_base != "none":
            raise ConfigError(
                f"model.quantize_base={model.quantize_base} with parallel.tp={d.tp}: tensor parallelism would split "
                f"NF4 weights by columns, which NF4's row blocks cannot; use a layout without tp (fsdp, hsdp, ddp, pp)"
            )
        if d.tp > 1:
            check_tensor_parallel(model, d.tp, t.seq_len, p.sequence_parallel)
        if d.cp > 1:
            check_context_parallel(d.cp, t.seq_len, model.attention_dropout, d.tp, p.sequence_parallel)
        check_expert_parallel(
            d.ep, model.moe.num_experts, "dp_shard" in spec.dims, self.name, t.activation_checkpointing
        )
        per_step = t.micro_batch_size * d.dp
        if t.batch_size % per_step:
            raise ConfigError(
                f"train.batch_size={t.batch_size} is not divisible by train.micro_batch_size x "
                f"data-parallel size = {t.micro_batch_size} x {d.dp}: set train.batch_size to a multiple of {per_step}"
            )
        if self.pipelined:
            m = self.microbatches
            if t.batch_size % (d.dp * m):
                raise ConfigError(
                    f"train.batch_size={t.batch_size} is not divisible by data-parallel size x "
                    f"parallel.microbatches = {d.dp} x {m}: set train.batch_size to a multiple of {d.dp * m}"
                )
            validate_schedule(p.pp_schedule, d.pp, p.pp_stages_per_rank, m, t.compile, t.activation_checkpointing)
            stage_layers(model.n_layer, d.pp * p.pp_stages_per_rank, p.pp_edge_blocks)


def check_tensor_parallel(model: ModelConfig, tp: int, seq_len: int, sequence_parallel: bool) -> None:
    """A one-line ConfigError when the model's shapes do not split over `tp` ranks."""
    m = model
    mlp_hidden = mlp_width(m.d_model, m.d_ff, m.mlp)
    expert_hidden = m.moe.d_ff or mlp_hidden
    if m.moe.num_experts and expert_hidden % tp:
        raise ConfigError(
            f"the experts' width (model.moe.d_ff or the MLP's) {expert_hidden} is not divisible by parallel.tp={tp}: "
            f"tensor parallelism splits every expert's hidden units; choose a tp that divides it"
        )
    if m.n_head % tp:
        raise ConfigError(
            f"model.n_head={m.n_head} is not divisible by parallel.tp={tp}: tensor parallelism splits "
            f"heads across ranks; choose a tp that divides {m.n_head}"
        )
    if m.n_kv_head and m.n_kv_head % tp:
        raise ConfigError(
            f"model.n_kv_head={m.n_kv_head} is not divisible by parallel.tp={tp}: tensor parallelism splits the "
            f"key/value heads across ranks with their query heads; choose a tp that divides {m.n_kv_head}"
        )
    if m.d_model % tp or mlp_hidden % tp:
        raise ConfigError(
            f"model.d_model={m.d_model} and the MLP width {mlp_hidden} (model.d_ff) must be divisible by "
            f"parallel.tp={tp}: tensor parallelism splits both; choose a tp that divides them"
        )
    if sequence_parallel and seq_len % tp:
        raise ConfigError(
            f"train.seq_len={seq_len} is not divisible by parallel.tp={tp}, which sequence "
            f"parallelism needs: set train.seq_len to a multiple of {tp} or "
            f"parallel.sequence_parallel=false"
        )
    if m.vocab_multiple % tp:
        raise ConfigError(
            f"model.vocab_multiple={m.vocab_multiple} is not divisible by parallel.tp={tp}: the padded "
            f"vocabulary is split across tp ranks; use a multiple of {tp} (e.g. {64 * tp})"
        )


def check_context_parallel(cp: int, seq_len: int, attention_dropout: float, tp: int, sequence_parallel: bool) -> None:
    """The shapes and settings context parallelism needs, as one-line errors naming the key."""
    if seq_len % (2 * cp):
        raise ConfigError(
            f"train.seq_len={seq_len} is not divisible by 2 x parallel.cp = {2 * cp} (each rank holds two equal "
            f"chunks): set train.seq_len to a multiple of {2 * cp}"
        )
    if attention_dropout > 0:
        raise ConfigError(
            f"model.attention_dropout={attention_dropout} needs the whole attention matrix, which parallel.cp="
            f"{cp} never builds: set model.attention_dropout=0 or parallel.cp=1"
        )
    if tp > 1 and sequence_parallel and (seq_len // cp) % tp:
        raise ConfigError(
            f"train.seq_len / parallel.cp = {seq_len // cp} tokens per rank is not divisible by parallel.tp={tp} "
            f"(sequence parallelism splits them again): set train.seq_len to a multiple of {cp * tp}"
        )


def check_expert_parallel(
    ep: int, num_experts: int, supports_ep: bool, layout: str, activation_checkpointing: str = "none"
) -> None:
    """Refuse what expert parallelism cannot do, before any process group exists."""
    if ep == 1:
        return
    if not num_experts:
        raise ConfigError(
            f"parallel.ep={ep} but the model has no experts (model.moe.num_experts=0): set parallel.ep=1, or use "
            f"a mixture-of-experts model (model=moe-tiny, mixtral-tiny, or set model.moe.num_experts)"
        )
    if num_experts % ep:
        raise ConfigError(
            f"model.moe.num_experts={num_experts} is not divisible by parallel.ep={ep}: every ep rank holds the "
            f"same number of experts; set parallel.ep to a divisor of {num_experts}"
        )
    if not supports_ep:
        raise ConfigError(
            f"parallel.ep={ep} but parallel={layout} does not shard parameters: expert parallelism "
            f"takes its ranks from FSDP's; use parallel=fsdp, hsdp, fsdp_tp or a pipeline with FSDP"
        )
    if activation_checkpointing == "selective":
        # The experts' own FSDP unit runs inside the checkpointed block, and its hooks replay a different sequence
        # of ops in the recompute than in forward, which selective checkpointing's op cache refuses.
        raise ConfigError(
            f"train.activation_checkpointing=selective with parallel.ep={ep}: the experts' FSDP unit inside each "
            f"block does not replay the same ops when recomputed; use train.activation_checkpointing=full or none"
        )


def validate_schedule(
    name: str, pp: int, stages_per_rank: int, microbatches: int, compiled: bool = False, recompute: str = "none"
) -> None:
    spec = schedule_spec(name)
    if compiled and spec.splits_backward:
        raise ConfigError(
            f"train.compile=true does not work with parallel.pp_schedule={name}, which computes input "
            f"and weight gradients in separate passes over the graph: set train.compile=false or "
            f"use 1f1b / interleaved_1f1b"
        )
    if recompute != "none" and spec.splits_backward:
        # Found by the dry run: selective checkpointing's cache of saved ops serves one backward pass only, and
        # under full recomputation each block's rerun keeps its activations for the deferred weight-gradient
        # pass, every micro-batch in flight: more than without recomputation (issue 76's grid)
        why = (
            "its cache of saved ops serves one backward pass, and this schedule runs two over each block (input, "
            "then weight gradients)"
            if recompute == "selective"
            else "the rerun's activations wait for the deferred weight-gradient pass: it holds more than no "
            "recomputation"
        )
        raise ConfigError(
            f"train.activation_checkpointing={recompute} does not pay with parallel.pp_schedule={name}: {why}; "
            f"set train.activation_checkpointing=none, or use 1f1b / interleaved_1f1b to recompute"
        )
    v = stages_per_rank
    if spec.stages_per_rank == "one" and v != 1:
        raise ConfigError(
            f"parallel.pp_schedule={name} runs one stage per rank but parallel.pp_stages_per_rank={v}: "
            f"set parallel.pp_stages_per_rank=1, or use interleaved_1f1b / zero_bubble"
        )
    if spec.stages_per_rank == "several" and v < 2:
        raise ConfigError(
            f"parallel.pp_schedule={name} interleaves virtual stages but parallel.pp_stages_per_rank"
            f"={v}: set parallel.pp_stages_per_rank=2 or more (model.n_layer must split into "
            f"pp x that many stages)"
        )
    if spec.stages_per_rank == "two" and v != 2:
        raise ConfigError(
            f"parallel.pp_schedule={name} places exactly two stages per rank in a V but "
            f"parallel.pp_stages_per_rank={v}: set parallel.pp_stages_per_rank=2"
        )
    least = {"1": 1, "pp": pp, "stages": pp * v}[spec.microbatches_at_least]
    if microbatches < least:
        raise ConfigError(
            f"parallel.microbatches={microbatches} is below {least}, which parallel.pp_schedule={name} "
            f"needs with parallel.pp={pp} (fewer micro-batches than stages leaves ranks idle): set "
            f"parallel.microbatches >= {least}"
        )
    if spec.microbatches_multiple_of_pp and microbatches % pp:
        raise ConfigError(
            f"parallel.microbatches={microbatches} is not a multiple of parallel.pp={pp}, which "
            f"parallel.pp_schedule={name} runs in rounds of: use a multiple of {pp}"
        )


def stage_layers(n_layer: int, n_stages: int, edge_blocks: int) -> list[range]:
    """The blocks of each stage: equal shares of the work, counting the embedding and the head as `edge_blocks`
    blocks each (so the first and last stage get that many fewer)."""
    units = n_layer + 2 * edge_blocks
    per_stage = units // n_stages
    if units % n_stages:
        raise ConfigError(
            f"model.n_layer={n_layer} (+ 2 x parallel.pp_edge_blocks={edge_blocks}) does not split evenly into "
            f"{n_stages} pipeline stages (parallel.pp x parallel.pp_stages_per_rank): choose model.n_layer + "
            f"2 x pp_edge_blocks divisible by {n_stages}"
        )
    sizes = [per_stage] * n_stages
    sizes[0] -= edge_blocks
    sizes[-1] -= edge_blocks
    if min(sizes) < 1:
        raise ConfigError(
            f"parallel.pp_edge_blocks={edge_blocks} leaves the first or last of {n_stages} stages "
            f"without a block (model.n_layer={n_layer}): lower parallel.pp_edge_blocks"
        )
    starts = [sum(sizes[:i]) for i in range(n_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def plan_command(overrides: list[str], world_size: int) -> str:
    """The planner's command line for the run these train.py overrides start on `world_size` ranks."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith(_NOT_PLANNED)]
    return " ".join(["python -m llmtrain.tools.plan", *kept, f"plan.world_size={world_size}", "plan.layouts=all"])


def check_layout(config: RootConfig, overrides: list[str], world_size: int) -> None:
    """Refuse the layout of a train.py run with these overrides on `world_size` ranks before anything is built
    (parallel=auto is decided later, once the tokenizer's vocabulary is known), and one that cannot sample where the
    objective samples."""
    if config.parallel.layout == AUTO:
        return
    try:
        plan = ParallelPlan.of(config.parallel, config.train, config.model, world_size)
        if OBJECTIVES[objective_of(config.train.objective, config.data.source)].samples:
            check_samples(plan)
    except ConfigError as error:
        raise with_layouts_that_run(error, overrides, world_size) from None


def check_samples(plan: ParallelPlan) -> None:
    """A ConfigError naming what to change where `plan`'s layout cannot sample."""
    if plan.pipelined:
        raise ConfigError(
            f"parallel={plan.name}: a pipeline cannot sample (each new token would pass through every stage in "
            f"turn); use a layout without pipeline stages (fsdp, tp, fsdp_tp, ddp)"
        )
    if plan.degrees.cp > 1:
        raise ConfigError(
            f"parallel.cp={plan.degrees.cp}: decoding one position at a time leaves no sequence to split over "
            f"context-parallel ranks; set parallel.cp=1"
        )
    if plan.degrees.tp > 1 and plan.parallel.sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel=true: a decoding step's one new position cannot be split over the "
            "tensor-parallel ranks; set parallel.sequence_parallel=false"
        )


def with_layouts_that_run(error: ConfigError, overrides: list[str], world_size: int) -> ConfigError:
    """A layout's error with the planner command that lists the layouts that do run (other errors as they are)."""
    if "parallel." not in str(error):
        return error
    return ConfigError(f"{error}; layouts that run: {plan_command(overrides, world_size)}")
