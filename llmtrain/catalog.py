"""What llmtrain can be asked for by name, one torch-free table each: the parallel layouts (parallel.strategy), the
pipeline schedules (parallel.pp_schedule), the optimizers (optim.name), the learning-rate schedules
(optim.schedule, optim.decay_shape), the data sources and tokenizers, and the recomputation modes. The config's
choices and --help, and the code that builds each one, read these tables; no other file lists the names."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from llmtrain.errors import ConfigError

# The device mesh's dimensions, outer to inner (llmtrain/parallel/mesh.py says why in this order).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class LayoutSpec:
    implementation: str  # "module:Class" of the ParallelModel that lays it out (imported when a run asks for it)
    dims: tuple[str, ...]  # the mesh dimensions it splits over: a degree above 1 on any other is refused


# parallel.strategy -> its layout.
STRATEGIES: dict[str, LayoutSpec] = {
    "single": LayoutSpec("llmtrain.parallel.parallel_model:ParallelModel", ()),
    "ddp": LayoutSpec("llmtrain.parallel.data_parallel:DDP", ("dp_replicate",)),
    "zero1": LayoutSpec("llmtrain.parallel.data_parallel:ZeroOne", ("dp_replicate",)),
    "fsdp": LayoutSpec("llmtrain.parallel.data_parallel:FSDP", ("dp_replicate", "dp_shard", "cp", "tp")),
    "tp": LayoutSpec("llmtrain.parallel.parallel_model:ParallelModel", ("tp",)),
    "pp": LayoutSpec("llmtrain.parallel.pipeline.parallel_model:PipelineParallel", MESH_DIMS),
}
# parallel.strategy=auto: the planner picks one of STRATEGIES for the world it runs in.
AUTO = "auto"


def layout_spec(name: str) -> LayoutSpec:
    if name not in STRATEGIES:
        raise ConfigError(f"parallel.strategy={name!r} is not a layout: use one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


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
    "gpipe": ScheduleSpec("ScheduleGPipe", "one", "loop", "1"),
    "1f1b": ScheduleSpec("Schedule1F1B", "one", "loop", "pp"),
    "1f1b_reference": ScheduleSpec(None, "one", "loop", "pp"),
    "interleaved_1f1b": ScheduleSpec("ScheduleInterleaved1F1B", "several", "loop", "pp", True),
    "zero_bubble": ScheduleSpec("ScheduleInterleavedZeroBubble", "several", "loop", "pp", True, splits_backward=True),
    "zbv": ScheduleSpec("ScheduleZBVZeroBubble", "two", "v", "stages", splits_backward=True),
    "dualpipev": ScheduleSpec("ScheduleDualPipeV", "two", "v", "stages", splits_backward=True),
}


def schedule_spec(name: str) -> ScheduleSpec:
    if name not in SCHEDULES:
        raise ConfigError(
            f"parallel.pp_schedule={name!r} is not a pipeline schedule: use one of {', '.join(SCHEDULES)}"
        )
    return SCHEDULES[name]


@dataclass(frozen=True)
class OptimizerSpec:
    description: str
    matrix_moments: int  # fp32 buffers it keeps per element of the blocks' weight matrices (AdamW: 2 elsewhere)


# optim.name -> what it updates, and how (llmtrain/optim/ builds each; conf/optim/<name>.yaml sets its defaults).
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("AdamW on every parameter", 2),
    "muon": OptimizerSpec(
        "Muon on the blocks' weight matrices (experts: each expert's), AdamW on embeddings, head, norms, biases", 1
    ),
}
ADAMW_MOMENTS = 2
# optim.state_bits -> bytes per element of each AdamW moment: fp32, or torchao's 8-bit codes with one fp32 scale per
# block of 256 (llmtrain/optim/__init__.py).
MOMENT_BYTES: dict[int, float] = {32: 4.0, 8: 1.0 + 4 / 256}
# data.source: where the text comes from (llmtrain/data/sources.py), or prepared token stores (data/prepared.py,
# data/mixture.py).
DATA_SOURCES = ("stdlib", "local", "hf", "prepared", "mix")
# data.tokenizer.kind (llmtrain/data/tokenizers.py describes each).
TOKENIZER_KINDS = ("byte", "bpe", "hf")
# train.activation_checkpointing, from keeping the most to recomputing the most (llmtrain/model/recompute.py): the
# planner turns it up in this order when a layout does not fit.
RECOMPUTE_MODES = ("none", "selective", "full")
# train.float8 (llmtrain/parallel/float8.py describes each recipe).
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")
# optim.schedule (llmtrain/optim/schedule.py describes each).
LR_SCHEDULES = ("cosine", "wsd", "constant")
# optim.decay_shape: progress p through a WSD decay, 0 to 1 -> the share of (peak - floor) still left.
DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1 - math.sqrt(p),
}
