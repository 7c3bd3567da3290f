"""What llmtrain can be asked for by name, one torch-free table each: the parallel layouts (parallel.strategy) and
the pipeline schedules (parallel.pp_schedule). The config's choices and --help, and the code that builds each one,
read these tables; no other file lists the names."""

from __future__ import annotations

from dataclasses import dataclass

# parallel.strategy -> the class that lays the model out, as "module:Class" (imported when a run asks for it).
STRATEGIES: dict[str, str] = {
    "single": "llmtrain.parallel.layouts:Single",
    "ddp": "llmtrain.parallel.layouts:DDP",
    "zero1": "llmtrain.parallel.layouts:ZeroOne",
    "fsdp": "llmtrain.parallel.layouts:FSDP",
    "tp": "llmtrain.parallel.layouts:TensorParallel",
    "pp": "llmtrain.parallel.pipeline.strategy:PipelineParallel",
}
# parallel.strategy=auto: the planner picks one of STRATEGIES for the world it runs in.
AUTO = "auto"


@dataclass(frozen=True)
class ScheduleSpec:
    torch_class: str | None  # the class in torch.distributed.pipelining; None: the reference written here
    stages_per_rank: str  # "one", "several" (>= 2) or "two"
    style: str  # how stages are dealt to ranks (parallel/pipeline/split.py)
    microbatches_at_least: str  # "1", "pp" or "stages" (= 2 pp for V schedules)
    microbatches_multiple_of_pp: bool = False
    splits_backward: bool = False  # input- and weight-gradient halves run separately


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
