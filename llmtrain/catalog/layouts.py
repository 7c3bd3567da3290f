"""The parallel layouts (parallel=<layout>), the data-parallel mechanisms they are made of, the device mesh's
dimensions and the pipeline schedules (parallel.pp_schedule)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.errors import ConfigError

# The device mesh's dimensions, outer to inner (llmtrain/parallel/mesh.py says why in this order).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


# The mesh dimensions the planner keeps inside a node: their collectives run every layer, so they get the fastest
# links.
WITHIN_NODE_DIMS = ("cp", "tp")
# A degree template's value for "the ranks of one node" (conf/parallel/*.yaml resolves it in
# llmtrain/process/launch_env.py).
RANKS_PER_NODE = "${llmtrain_ranks_per_node:}"


@dataclass(frozen=True)
class DataParallelSpec:
    """How the data-parallel ranks share the model's state."""

    implementation: str  # "module:Class" of the mechanism a ParallelModel holds (imported when a run asks for it)
    dims: tuple[str, ...]  # the mesh dimensions it can split over
    sharding: str  # what it shards over its ranks: nothing, the optimizer state, or (FSDP) parameters
    flat_optimizer: bool = False  # its optimizer updates flat fp32 slices: no 8-bit moments, no host-side state


# parallel layouts' data_parallel field -> the mechanism.
DATA_PARALLEL: dict[str, DataParallelSpec] = {
    "none": DataParallelSpec(
        implementation="llmtrain.parallel.data_parallel:DataParallel", dims=(), sharding="nothing"
    ),
    "ddp": DataParallelSpec(
        implementation="llmtrain.parallel.data_parallel:DDP", dims=("dp_replicate",), sharding="nothing"
    ),
    "zero1": DataParallelSpec(
        implementation="llmtrain.parallel.data_parallel:ZeroOne",
        dims=("dp_replicate",),
        sharding="optimizer",
        flat_optimizer=True,
    ),
    "fsdp": DataParallelSpec(
        implementation="llmtrain.parallel.data_parallel:FSDP",
        dims=("dp_replicate", "dp_shard", "cp", "tp"),
        sharding="parameters",
    ),
}


@dataclass(frozen=True)
class LayoutSpec:
    """One layout a user picks with `parallel=<name>`: conf/parallel/<name>.yaml, the layout tables of README.md and
    docs/parallelism.md (llmtrain/tools/layout_doc.py) and the planner's candidates are made from it."""

    description: str  # the yaml's opening comment: its first sentence is the option's line in --help and the docs
    degrees: dict[str, int | str]  # the mesh degrees its yaml sets (-1: the remaining ranks; RANKS_PER_NODE)
    data_parallel: str  # a key of DATA_PARALLEL
    splits: str  # what it splits (the README's table)
    state: tuple[str, str, str]  # per rank: parameters, gradients, AdamW state (Ψ parameters, N, T, P, S degrees)
    communication: str  # per optimizer step
    built_from: str
    pipeline: bool = False
    settings: dict[str, bool] = field(default_factory=dict)  # other parallel.* keys its yaml sets
    overlaps: bool = False  # its data-parallel traffic runs behind backward (buckets, prefetch), not after it
    planner_extras: tuple[str, ...] = ()  # degrees the planner also tries above 1: "cp" (within a node), "ep"
    examples: tuple[str, ...] = ()

    @property
    def mechanism(self) -> DataParallelSpec:
        return DATA_PARALLEL[self.data_parallel]

    def fsdp_shards(self, data_parallel_ranks: int) -> bool:
        """Whether FSDP lays the model out over `data_parallel_ranks` (dp x cp) ranks: where the mechanism shards
        parameters, inside a pipeline only over more than one rank (FSDP over one rank gathers nothing). Its bf16
        compute then comes from FSDP's gathered copies; elsewhere from autocast, whose residual adds stay fp32."""
        return self.mechanism.sharding == "parameters" and (not self.pipeline or data_parallel_ranks > 1)

    @property
    def dims(self) -> tuple[str, ...]:
        """The mesh dimensions it may split over: a degree above 1 on any other is refused. A pipeline carries any
        layout inside its stages."""
        if self.pipeline:
            return MESH_DIMS
        return tuple(d for d in MESH_DIMS if d in self.mechanism.dims or d in self.degrees)


_SP = {"sequence_parallel": True}
# parallel=<name> -> its layout, simplest first: the planner breaks a tie (predicted step times within 3%) toward
# the earlier row, which has fewer moving parts to debug.
LAYOUTS: dict[str, LayoutSpec] = {
    "single": LayoutSpec(
        description="One process, no wrapper: the reference every other layout must reproduce.",
        degrees={},
        data_parallel="none",
        splits="nothing",
        state=("Ψ", "Ψ", "2Ψ"),
        communication="none",
        built_from="the model as it is",
    ),
    "ddp": LayoutSpec(
        description="DistributedDataParallel: every rank a full replica, gradients averaged by all-reduce.",
        degrees={"dp_replicate": -1},
        data_parallel="ddp",
        splits="the batch; every rank holds everything",
        state=("Ψ", "Ψ", "2Ψ"),
        communication="all-reduce of the gradients: 2Ψ, bucketed and overlapped with backward, once per optimizer step",
        built_from="`DistributedDataParallel`, `no_sync` while accumulating",
        overlaps=True,
        examples=(
            "torchrun --standalone --nproc_per_node=4 train.py parallel=ddp",
            "python train.py parallel=ddp parallel.nproc=4            # the same, workers started by train.py",
        ),
    ),
    "zero1": LayoutSpec(
        description="ZeRO stage 1: replicas, but each rank keeps the optimizer state of only 1/N of the weights.",
        degrees={"dp_replicate": -1},
        data_parallel="zero1",
        splits="the batch; optimizer state sharded",
        state=("Ψ", "Ψ", "2Ψ/N"),
        communication="reduce-scatter of Ψ gradients + all-gather of Ψ updated parameters = 2Ψ, as DDP, after backward",
        built_from="written here (`llmtrain/parallel/zero.py`)",
    ),
    "zero2": LayoutSpec(
        description=(
            "ZeRO stage 2 with FSDP2: gradients and optimizer state sharded, parameters kept gathered from forward to "
            "backward."
        ),
        degrees={"dp_shard": -1},
        data_parallel="fsdp",
        splits="the batch; gradients and optimizer state sharded",
        state=("Ψ/N (Ψ during the step)", "Ψ/N", "2Ψ/N"),
        communication="all-gather of Ψ parameters (forward) + reduce-scatter of Ψ gradients = 2Ψ",
        built_from="FSDP2, `reshard_after_forward=False`",
        settings={"reshard_after_forward": False},
        overlaps=True,
    ),
    "fsdp": LayoutSpec(
        description="FSDP2 fully_shard per transformer block and on the root: ZeRO stage 3.",
        degrees={"dp_shard": -1},
        data_parallel="fsdp",
        splits="the batch; parameters, gradients and optimizer state sharded (ZeRO-3)",
        state=("Ψ/N", "Ψ/N", "2Ψ/N"),
        communication=(
            "all-gather of Ψ (forward) + all-gather of Ψ (backward) + reduce-scatter of Ψ gradients = 3Ψ; on GPU in "
            "bf16 the parameters are gathered in bf16 and gradients reduced in fp32"
        ),
        built_from="FSDP2 `fully_shard` per block + root",
        overlaps=True,
        planner_extras=("cp", "ep"),
        examples=("torchrun --standalone --nproc_per_node=4 train.py parallel=fsdp",),
    ),
    "hsdp": LayoutSpec(
        description="Hybrid sharding: FSDP inside a node (dp_shard, fast links), replicas across nodes (dp_replicate).",
        degrees={"dp_replicate": -1, "dp_shard": RANKS_PER_NODE},
        data_parallel="fsdp",
        splits="FSDP inside a node, replicas across nodes",
        state=("Ψ/S", "Ψ/S", "2Ψ/S"),
        communication=(
            "3Ψ over the S ranks of a node, as fsdp + all-reduce of the Ψ/S gradient shard across nodes: the slow "
            "links carry 2Ψ/S instead of 3Ψ"
        ),
        built_from="FSDP2 on a 2-D mesh",
        overlaps=True,
        examples=(
            "sbatch --nodes=2 launch/slurm.sbatch parallel=hsdp",
            "torchrun --standalone --nproc_per_node=4 train.py parallel=hsdp parallel.dp_shard=2   # 2 x 2 on one "
            "machine",
        ),
    ),
    "tp": LayoutSpec(
        description="Tensor parallelism: every layer split across all ranks, Megatron-style.",
        degrees={"tp": -1},
        data_parallel="none",
        splits="each layer's matrices (+ sequence parallelism)",
        state=("Ψ/T", "Ψ/T", "2Ψ/T"),
        communication=(
            "4 all-reduces of the b·s·h activations per layer (2 forward, 2 backward); with sequence parallelism each "
            "becomes an all-gather + a reduce-scatter of the same volume"
        ),
        built_from="DTensor `parallelize_module` (`llmtrain/parallel/tp.py`)",
        examples=("torchrun --standalone --nproc_per_node=4 train.py parallel=tp parallel.sequence_parallel=true",),
    ),
    "ddp_tp": LayoutSpec(
        description=(
            "Tensor parallel inside (tp), plain replicas across (dp_replicate): DDP semantics over TP-sharded weights, "
            "on FSDP2 with a replicate-only mesh (DistributedDataParallel does not take DTensor parameters)."
        ),
        degrees={"dp_replicate": -1, "tp": 2},
        data_parallel="fsdp",
        splits="each layer's matrices inside, the batch across replicas",
        state=("Ψ/T", "Ψ/T", "2Ψ/T"),
        communication="TP's per layer + all-reduce of the 2Ψ/T gradients across replicas",
        built_from="TP, then FSDP2 with a replicate-only mesh",
        settings=_SP,
        overlaps=True,
    ),
    "fsdp_tp": LayoutSpec(
        description="2-D parallelism: tensor parallel inside (tp, the fastest links), FSDP across (dp_shard).",
        degrees={"dp_shard": -1, "tp": 2},
        data_parallel="fsdp",
        splits="each layer's matrices inside, FSDP across",
        state=("Ψ/(N·T)", "Ψ/(N·T)", "2Ψ/(N·T)"),
        communication="TP's per layer over the T ranks + FSDP's 3Ψ/T over the N ranks",
        built_from="TP, then `fully_shard` on the TP-sharded parameters",
        settings=_SP,
        overlaps=True,
        examples=("torchrun --standalone --nproc_per_node=4 train.py parallel=fsdp_tp        # 2 x 2",),
    ),
    "pp": LayoutSpec(
        description="Pipeline parallelism: the model cut by depth into stages, one per rank (or pp_stages_per_rank), "
        "micro-batches flowing through a schedule.",
        degrees={"pp": -1},
        data_parallel="fsdp",
        splits="the layers into stages; 7 schedules (GPipe to DualPipeV)",
        state=("Ψ/P", "Ψ/P", "2Ψ/P"),
        communication=(
            "one activation forward and its gradient backward per micro-batch, point-to-point between neighbours; idle "
            "time (the bubble) (P − 1)/m of compute for gpipe and 1f1b, drawn each run into pipeline.png"
        ),
        built_from="torch `PipelineStage` + schedules; stage split written here",
        pipeline=True,
        overlaps=True,
        examples=(
            "torchrun --standalone --nproc_per_node=4 train.py parallel=pp parallel.pp_schedule=gpipe",
            "torchrun --standalone --nproc_per_node=4 train.py parallel=pp parallel.pp_schedule=interleaved_1f1b "
            "parallel.pp_stages_per_rank=2 model.n_layer=8",
        ),
    ),
    "pp_fsdp": LayoutSpec(
        description=(
            "Pipeline across (pp) x FSDP within each stage (dp_shard), its gathered parameters kept for the step."
        ),
        degrees={"pp": 2, "dp_shard": -1},
        data_parallel="fsdp",
        splits="the layers into stages, each stage FSDP-sharded",
        state=("Ψ/(P·N)", "Ψ/(P·N)", "2Ψ/(P·N)"),
        communication="pipeline point-to-point across + FSDP's within each stage, gathered once per step",
        built_from="stages, then `fully_shard`",
        pipeline=True,
        overlaps=True,
        examples=("torchrun --standalone --nproc_per_node=4 train.py parallel=pp_fsdp          # pp 2 x dp_shard 2",),
    ),
    "pp_tp": LayoutSpec(
        description="Pipeline across (pp) x tensor parallel within each stage (tp, the fastest links).",
        degrees={"pp": 2, "tp": -1},
        data_parallel="fsdp",
        splits="the layers into stages, each layer's matrices within a stage",
        state=("Ψ/(P·T)", "Ψ/(P·T)", "2Ψ/(P·T)"),
        communication="TP's per layer within each stage + pipeline point-to-point across",
        built_from="stages, then TP",
        pipeline=True,
        settings=_SP,
        overlaps=True,
        examples=("torchrun --standalone --nproc_per_node=4 train.py parallel=pp_tp            # pp 2 x tp 2",),
    ),
    "3d": LayoutSpec(
        description="3-D parallelism as big runs map it onto hardware: tensor parallel inside a node, FSDP over the "
        "data-parallel ranks, pipeline across nodes (point-to-point only, it tolerates slow links).",
        degrees={"pp": 2, "dp_shard": -1, "tp": 2},
        data_parallel="fsdp",
        splits="TP inside a node, FSDP over data ranks, pipeline across nodes",
        state=("Ψ/(P·N·T)", "Ψ/(P·N·T)", "2Ψ/(P·N·T)"),
        communication="TP's per layer over the T ranks, FSDP's over the N, pipeline point-to-point over the P",
        built_from="stages, TP, `fully_shard`",
        pipeline=True,
        settings=_SP,
        overlaps=True,
        examples=(
            "torchrun --standalone --nproc_per_node=8 train.py parallel=3d               # pp 2 x dp_shard 2 x tp 2",
            "sbatch --nodes=2 launch/slurm.sbatch parallel=3d   # pp across the 2 nodes, dp_shard x tp inside each",
        ),
    ),
}
# parallel=auto: the planner picks one of LAYOUTS for the world it runs in (llmtrain/planner/).
AUTO = "auto"
AUTO_DESCRIPTION = (
    "Let the planner choose: at start-up it weighs every layout and degree split that runs on this world size for "
    "the model and batch, with the memory and links of hardware= (or the bus bandwidths of "
    "plan.measured=comm_bench.csv), and trains with the fastest that fits device memory. The start summary prints "
    "the decision, the reason and the runner-up; the run's config records the chosen layout."
)
AUTO_EXAMPLES = (
    "python -m llmtrain.tools.plan model=gpt2-xl hardware=rtx4080x4 plan.layouts=all",
    "torchrun --standalone --nproc_per_node=4 train.py parallel=auto hardware=rtx4080x4",
)


def layout_spec(name: str) -> LayoutSpec:
    if name not in LAYOUTS:
        raise ConfigError(f"parallel.layout={name!r} is not a layout: use one of {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


@dataclass(frozen=True)
class ScheduleSpec:
    torch_class: str | None  # the class in torch.distributed.pipelining; None: the reference written here
    stages_per_rank: str  # "one", "several" (>= 2) or "two"
    style: str  # how stages are dealt to ranks (parallel/pipeline/split.py)
    microbatches_at_least: str  # "1", "pp" or "stages" (= 2 pp for V schedules)
    microbatches_multiple_of_pp: bool = False
    splits_backward: bool = False  # input- and weight-gradient halves run separately

    @property
    def fewest_stages_per_rank(self) -> int:
        """The smallest parallel.pp_stages_per_rank the schedule runs with."""
        return 1 if self.stages_per_rank == "one" else 2


# parallel.pp_schedule -> how the micro-batches flow (llmtrain/parallel/pipeline/schedules.py describes each).
SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(torch_class="ScheduleGPipe", stages_per_rank="one", style="loop", microbatches_at_least="1"),
    "1f1b": ScheduleSpec(torch_class="Schedule1F1B", stages_per_rank="one", style="loop", microbatches_at_least="pp"),
    "1f1b_reference": ScheduleSpec(torch_class=None, stages_per_rank="one", style="loop", microbatches_at_least="pp"),
    "interleaved_1f1b": ScheduleSpec(
        torch_class="ScheduleInterleaved1F1B",
        stages_per_rank="several",
        style="loop",
        microbatches_at_least="pp",
        microbatches_multiple_of_pp=True,
    ),
    "zero_bubble": ScheduleSpec(
        torch_class="ScheduleInterleavedZeroBubble",
        stages_per_rank="several",
        style="loop",
        microbatches_at_least="pp",
        microbatches_multiple_of_pp=True,
        splits_backward=True,
    ),
    "zbv": ScheduleSpec(
        torch_class="ScheduleZBVZeroBubble",
        stages_per_rank="two",
        style="v",
        microbatches_at_least="stages",
        splits_backward=True,
    ),
    "dualpipev": ScheduleSpec(
        torch_class="ScheduleDualPipeV",
        stages_per_rank="two",
        style="v",
        microbatches_at_least="stages",
        splits_backward=True,
    ),
}


def schedule_spec(name: str) -> ScheduleSpec:
    if name not in SCHEDULES:
        raise ConfigError(
            f"parallel.pp_schedule={name!r} is not a pipeline schedule: use one of {', '.join(SCHEDULES)}"
        )
    return SCHEDULES[name]
