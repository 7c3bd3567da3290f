"""The keys of a run around its model, data, layout and optimizer: the loop (`train.*`), logging and W&B
(`logging.*`), downstream tasks (`eval.*`), profiling (`profile.*`) and checkpoints (`checkpoint.*`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from llmtrain import catalog
from llmtrain.domains import (
    CheckpointSource,
    ExistingPath,
    Flag,
    ListOf,
    Number,
    OneOf,
    StepSpan,
    Text,
    WritableDirectory,
    at_least,
    key,
)


@dataclass
class WandbConfig:
    mode: str = key(
        "auto",
        OneOf(("auto", "online", "offline", "disabled")),
        "`auto`: online when a W&B key is configured (`WANDB_API_KEY` or `wandb login`), offline otherwise; `online`; "
        "`offline`; `disabled`",
    )
    project: str = key("llmtrain", Text(), "W&B project")
    entity: Optional[str] = key(None, Text(), "W&B user or team; null = the key's default")
    name: Optional[str] = key(
        None,
        Text(),
        "run name; null = the run directory (a sweep job: sweep directory + its overrides)",
    )
    group: Optional[str] = key(None, Text(), "run group; null = the sweep directory for `-m` sweeps, none otherwise")


@dataclass
class LoggingConfig:
    log_every: int = key(10, at_least(1), "steps between console lines when there is no progress bar")
    progress: str = key(
        "auto",
        OneOf(("auto", "bar", "lines")),
        "`auto`: a progress bar on a terminal, log lines otherwise; `bar`; `lines`",
    )
    straggler_threshold: float = key(
        0.2,
        Number(low=0),
        "on logging steps (every `log_every`) the ranks compare their busy time (the step less the waits in "
        "collectives): `slowest_rank` and `straggler_lag` in the metrics, and a warning for a rank its peers waited "
        "for longer than this fraction of a step 3 times in a row; 0 = no check",
    )
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TrainConfig:
    steps: int = key(300, at_least(1), "optimizer steps")
    batch_size: int = key(32, at_least(1), "global batch: sequences per optimizer step, over all data-parallel ranks")
    micro_batch_size: int = key(
        8,
        at_least(1),
        "sequences per rank per forward/backward; gradient accumulation = batch_size / (micro_batch_size × "
        "data-parallel ranks)",
    )
    seq_len: int = key(128, at_least(1), "tokens per sequence, at most `model.max_seq_len`")
    attention: str = key(
        "causal",
        OneOf(catalog.ATTENTION_MODES),
        "`causal`: every token attends to all before it in its packed window, across documents; `document`: only "
        "to those of its own document (a document ends at the tokenizer's end-of-text token), with positions "
        "restarting at each document: FlexAttention on CUDA, SDPA with a mask on CPU, the ring under context "
        "parallelism (`model/documents.py`)",
    )
    score_after_eos: bool = key(
        True,
        Flag(),
        "score the prediction made at each end-of-text token (the next packed document's first token); `false`: "
        "leave it out of the loss, whose mean is then over the scored targets of the whole global batch. Under "
        "`train.attention=document` nothing that position sees is of the document it would predict",
    )
    eval_every: int = key(50, at_least(0), "validate every N steps and at the last step; 0 disables")
    eval_batches: int = key(
        2,
        at_least(1),
        "global batches of held-out windows in one validation: the same windows every time and for every layout",
    )
    precision: str = key(
        "auto",
        OneOf(("auto", "bf16", "fp32")),
        "`auto`: bf16 on CUDA, fp32 on CPU; `bf16`; `fp32`. bf16 is one policy (`parallel/precision.py`, "
        "torchtitan's): where FSDP applies, its mixed precision alone (bf16 copies of the fp32 weights for compute, "
        "gradients reduced in fp32), elsewhere autocast over fp32 weights; losses in fp32. Layouts agree to 1e-5 in "
        "fp32 (CPU tests); in bf16 `gpu_check` holds each layout to 3% of one GPU's per-step loss (a stated bound, "
        "not yet measured on a GPU); fp32 matmuls use TF32 on GPUs",
    )
    device: str = key("auto", OneOf(("auto", "cpu", "cuda")), "`auto`: CUDA when visible, else CPU; `cpu`; `cuda`")
    save_model: bool = key(
        True,
        Flag(),
        "write the final weights as one full state dict, `model.pt`, in the run directory",
    )
    activation_checkpointing: str = key(
        "none",
        OneOf(catalog.RECOMPUTE_MODES),
        "`full`: recompute each block in backward (keeps only block inputs); `selective`: keep matmul, attention "
        "and communication outputs, recompute the cheap ops between them",
    )
    compile: bool = key(
        False,
        Flag(),
        "`torch.compile`: the whole model as one graph where nothing splits it within a rank (single, ddp, zero1 "
        "with dense blocks and causal attention), each transformer block otherwise; the loss a graph of its own (on "
        "GPU; compiling on CPU is slow to start); the start summary says which, the end summary and `summary.json` "
        "(`compiled_graphs`) count the graphs compiled",
    )
    compile_backend: str = key(
        "inductor",
        OneOf(catalog.COMPILE_BACKENDS),
        "the backend `train.compile` compiles with: `inductor` generates fused kernels (what makes it fast); "
        "`aot_eager` traces the same graphs, forward and backward, and runs them with eager kernels, `eager` "
        "runs dynamo's graphs alone: a failure under `aot_eager` is the graph's, one under `inductor` alone its "
        "kernels' (a short first compile besides)",
    )
    float8: str = key(
        "none",
        OneOf(catalog.FLOAT8_RECIPES),
        "`tensorwise` or `rowwise`: the blocks' Linear layers compute in float8 (torchao, the `fp8` extra; FP8 "
        "tensor cores: sm_89+, emulated on CPU). `tensorwise` also all-gathers FSDP weights and tensor-parallel "
        "activations in float8 (`parallel/float8.py`); `none`: the compute dtype",
    )
    float8_layers: str = key(
        "auto",
        OneOf(catalog.FLOAT8_LAYERS),
        "with `train.float8`: `auto` converts the eligible Linear layers large enough for the FP8 matmul to beat "
        "bf16's (torchao's thresholds per recipe, measured on an H100); `all` every eligible one (both dimensions "
        "multiples of 16); the start summary names those kept in the compute dtype, and why",
    )
    objective: str = key(
        catalog.AUTO_OBJECTIVE,
        OneOf((catalog.AUTO_OBJECTIVE, *catalog.OBJECTIVES)),
        "what a step optimizes (llmtrain/catalog/objectives.py OBJECTIVES): `auto` is `dpo` on data=preference's "
        "pairs and `next_token` on any other data; " + catalog.described(catalog.OBJECTIVES),
    )
    max_bad_steps: int = key(
        3,
        at_least(1),
        "consecutive skipped steps (a non-finite loss or gradient norm, or a spike under `train.on_spike=skip`) "
        "before the run stops",
    )
    spike_factor: float = key(
        5.0,
        Number(low=0),
        "a step whose loss is over this many times the median loss of the last `train.spike_window` steps that "
        "updated the weights is a spike: a warning naming the step and its batch, and `spike: true` in its record; "
        "checked once the window is full (a resumed run refills it from the metrics logged); 0 = off",
    )
    spike_window: int = key(100, at_least(1), "steps whose median loss a spike is measured against")
    on_spike: str = key(
        "log",
        OneOf(catalog.SPIKE_ACTIONS),
        "`log`: the spike is reported and trained on; `skip`: its update is dropped as a non-finite step's is (the "
        "weights and optimizer state left unchanged, `skipped: true`) and it counts towards `train.max_bad_steps`; "
        "`rollback`: the run ends with exit 78, and its restart or requeue resumes from the last checkpoint with "
        "the spike's batch left out (`<run dir>/left-out-batches.json`)",
    )
    hang_timeout: Optional[float] = key(
        None,
        Number(low=0),
        "seconds a rank may make no progress before every rank writes its stacks and collectives to "
        "`<run dir>/hang/` and the job exits 76 (requeued by launch/slurm.sbatch); validation, `eval.tasks` and "
        "checkpoints get 10x, an attempt's start up to the end of its first step 20x; 0 = off; null = on GPUs 20x "
        "the median of the first steps (at least 300 s, watched from the sixth step), off on CPUs",
    )


@dataclass
class EvalConfig:
    """Downstream tasks scored in the training loop (llmtrain/data/tasks.py, llmtrain/train/downstream.py)."""

    tasks: Optional[list[str]] = key(
        None,
        ListOf(ExistingPath("file")),
        "multiple-choice task files (jsonl: context, choices, label; HellaSwag's ctx, endings, label too), each scored "
        "every `eval.every` steps and at the end: `eval/<task>/acc` (the choice of greatest log-likelihood) and "
        "`eval/<task>/acc_norm` (greatest log-likelihood per character of the choice), as lm-eval defines them; the "
        "examples split over the data-parallel ranks",
    )
    every: Optional[int] = key(None, at_least(1), "steps between task evaluations; null = `train.eval_every`")
    limit: Optional[int] = key(None, at_least(1), "examples scored per task (the file's first); null = all")


@dataclass
class ProfileConfig:
    steps: Optional[list[int]] = key(
        None,
        StepSpan(),
        "`[first, last]`: record those training steps with torch.profiler: a Chrome trace per rank in `<run "
        "dir>/profile/` (open in chrome://tracing or ui.perfetto.dev; a W&B artifact when logging online) and the "
        "busiest operators in the end summary; null: no profiling",
    )
    memory: bool = key(
        False,
        Flag(),
        "record the CUDA allocator's history and write `<run dir>/profile/memory-rank<r>.pickle` (drag into "
        "pytorch.org/memory_viz) on an out-of-memory error or at the end; nothing on CPU",
    )


@dataclass
class CheckpointConfig:
    every: int = key(0, at_least(0), "also save every N steps (0: only at the end and on preemption)")
    every_minutes: float = key(
        15,
        Number(low=0),
        "also save when this many minutes have passed since the last save (rank 0's clock, agreed at the step's "
        "read), so a crash loses at most that much; only the newest of these is kept beside `every`'s; 0 = off. "
        "15: a save blocks training for seconds (docs/benchmarks.md, checkpoints), under 1% of 15 minutes",
    )
    dir: Optional[str] = key(
        None,
        WritableDirectory(),
        "null = `<run dir>/checkpoints`; a run given a directory with checkpoints resumes from it",
    )
    keep: int = key(2, at_least(1), "complete checkpoints kept, newest first")
    async_save: bool = key(False, Flag(), "DCP async save: training continues while shards are written")
    resume: str = key(
        "auto",
        CheckpointSource(),
        "`auto`: the latest complete checkpoint in `checkpoint.dir`, if any; `none`; or a checkpoint path",
    )
