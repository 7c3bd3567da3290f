"""What llmtrain can be asked for by name, one torch-free table each: the model families (model.family), the
parallel layouts (parallel=<layout>), the pipeline schedules (parallel.pp_schedule), the optimizers (optim.name),
the learning-rate schedules (optim.lr_schedule, optim.decay_shape), the data sources and tokenizers, and the
recomputation modes. The config's choices and --help, and the code that builds each one, read these tables; no
other file lists the names. A row names the code it runs by an import string, "module:Name", imported (`imported`)
only when a run asks for it, so this table stays torch-free and a new row needs no other edit to be built."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmtrain.errors import ConfigError


def imported(reference: str) -> Any:
    """What a row's import string "module:Name" names, its module imported now."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


def described(table: dict[str, Any]) -> str:
    """Each name of `table` with its row's one-line description, for the doc of the key that chooses among them."""
    return "; ".join(f"`{name}`: {row.description}" for name, row in table.items())


@dataclass(frozen=True)
class ModelFamilySpec:
    """A class of model `model.family` builds: GPT's constructor arguments (the model group's shape as a
    GPTConfig; for a pipeline rank's part, the blocks and ends it holds) make it whole, and it is a LayeredModel
    (llmtrain/model/base.py). The layouts find what they need of it (tensor-parallel plan, pipeline cut) by its
    class in llmtrain/parallel/family.py, where a subclass takes its base class's."""

    implementation: str  # "module:Class" of the model
    description: str  # one line: what sets it apart, for model.family's --help and docs/config.md


# model.family -> the model class. Llama, Mixtral and the other presets are the GPT class under other keys (norm,
# position, mlp, moe: conf/model/*.yaml); a family of its own is a model whose modules differ.
MODEL_FAMILIES: dict[str, ModelFamilySpec] = {
    "gpt": ModelFamilySpec(
        implementation="llmtrain.model.gpt:GPT",
        description="the decoder of every preset, GPT-2, Llama or Mixtral by the norm, position, mlp and moe keys",
    ),
}


def model_family(name: str) -> ModelFamilySpec:
    """The row of model.family=`name`: a config's is checked by its domain, a checkpoint's (written where another
    row was installed) here."""
    if name not in MODEL_FAMILIES:
        raise ConfigError(f"model.family={name!r} is not a model family here: use one of {', '.join(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[name]


# The device mesh's dimensions, outer to inner (llmtrain/parallel/mesh.py says why in this order).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


# The mesh dimensions the planner keeps inside a node: their collectives run every layer, so they get the fastest
# links.
WITHIN_NODE_DIMS = ("cp", "tp")
# A degree template's value for "the ranks of one node" (conf/parallel/*.yaml resolves it in llmtrain/launch_env.py).
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


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer `optim.name` builds (llmtrain/optim/__init__.py: build_optimizer), over the parameter groups of
    llmtrain/optim/groups.py; conf/optim/<name>.yaml sets its defaults."""

    description: str  # one line: what it updates, how; optim.name's --help and docs/config.md
    # "module:Name" of what builds it: (parameter groups, the optim config, llmtrain/optim/compute.py's Compute) ->
    # the torch.optim.Optimizer
    builder: str
    moments: int  # fp32 buffers it keeps per element of a parameter outside the blocks' weight matrices
    matrix_moments: int  # the same, per element of the blocks' weight matrices (the planner's memory counts both)
    # Its update of the blocks' hidden matrices needs each matrix whole (Muon's orthogonalisation): those form a
    # group of their own, and a layout that splits them gathers them in the optimizer step.
    whole_matrices: bool = False
    # "module:Class" of its form over ZeRO-1's flat slices (llmtrain/parallel/zero.py): (the model, the optim config,
    # the data-parallel mesh, Compute) -> the optimizer; None: parallel=zero1 refuses it (zero1_form).
    zero1: str | None = None


# optim.name -> what it updates, and how.
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(
        description="AdamW on every parameter",
        builder="llmtrain.optim:adamw",
        moments=2,
        matrix_moments=2,
        zero1="llmtrain.parallel.zero:ZeroOneAdamW",
    ),
    "muon": OptimizerSpec(
        description=(
            "Muon on the blocks' weight matrices (experts: each expert's), AdamW on embeddings, head, norms, biases"
        ),
        builder="llmtrain.optim.muon:Muon",
        moments=2,
        matrix_moments=1,
        whole_matrices=True,
        zero1="llmtrain.parallel.zero:ZeroOneMuon",
    ),
}


def zero1_form(optimizer: str) -> str:
    """The import string of `optimizer`'s form over ZeRO-1's flat slices; a ConfigError when it has none."""
    form = OPTIMIZERS[optimizer].zero1
    if form is None:
        sliced = ", ".join(name for name, spec in OPTIMIZERS.items() if spec.zero1)
        raise ConfigError(
            f"optim.name={optimizer} has no form over parallel=zero1's flat slices (its row's zero1 in "
            f"llmtrain/catalog.py): use parallel=zero2 or fsdp, which shard any optimizer's state, or an optimizer "
            f"zero1 slices: {sliced}"
        )
    return form


# The moments plan.optimizer_bytes counts per parameter (AdamW's): the planner takes the difference to an
# optimizer's own.
ADAMW_MOMENTS = 2
# optim.state_bits -> bytes per element of each AdamW moment: fp32, or torchao's 8-bit codes with one fp32 scale per
# block of 256 (llmtrain/optim/__init__.py).
MOMENT_BYTES: dict[int, float] = {32: 4.0, 8: 1.0 + 4 / 256}
# data.source: where the text comes from (llmtrain/data/sources.py), prepared token stores (data/prepared.py,
# data/mixture.py), conversations (data/sft.py) or preference pairs (data/preference.py).
DATA_SOURCES = ("stdlib", "local", "hf", "prepared", "mix", "sft", "preference")
# data.tokenizer.kind (llmtrain/data/tokenizers.py describes each).
TOKENIZER_KINDS = ("byte", "bpe", "hf")
# train.activation_checkpointing, from keeping the most to recomputing the most (llmtrain/model/recompute.py): the
# planner turns it up in this order when a layout does not fit.
RECOMPUTE_MODES = ("none", "selective", "full")
# train.attention (llmtrain/model/documents.py): over the whole packed window, or within each packed document.
ATTENTION_MODES = ("causal", "document")
# model.lora.targets: the projections low-rank adapters can sit beside (llmtrain/model/lora.py), by their attribute
# names, with the names Hugging Face's Llama and Qwen3 and PEFT give them (either names a target in a config).
LORA_TARGETS = {
    "q_proj": "q_proj",
    "k_proj": "k_proj",
    "v_proj": "v_proj",
    "out_proj": "o_proj",
    "fc_gate": "gate_proj",
    "fc_in": "up_proj",
    "fc_out": "down_proj",
}
# train.on_spike (llmtrain/train/loop.py): what a loss spike does beyond its warning and `spike: true` in its
# record: nothing more, its update dropped as a non-finite step's is, or the run rolled back to its last checkpoint
# with the spike's batch left out.
SPIKE_ACTIONS = ("log", "skip", "rollback")
# train.float8 (llmtrain/parallel/float8.py describes each recipe).
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")
# train.float8_layers: which of the blocks' eligible Linear layers float8 converts (llmtrain/parallel/float8.py).
FLOAT8_LAYERS = ("auto", "all")
# optim.lr_schedule (llmtrain/optim/lr_schedule.py describes each).
LR_SCHEDULES = ("cosine", "wsd", "constant")
# optim.decay_shape: progress p through a WSD decay, 0 to 1 -> the share of (peak - floor) still left.
DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1 - math.sqrt(p),
}
