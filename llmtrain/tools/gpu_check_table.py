"""gpu_check's table: every check it runs, in the order it runs them, each a `Check` whose `purpose` says what the
row shows. A tolerance is on the per-step training loss: the max relative difference from the reference's over the
run. A budget (gpu_check's --budget) cuts the tail of the table, so what only a GPU shows comes first."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

from llmtrain.catalog import SCHEDULES


@dataclass
class Check:
    name: str
    overrides: list[str]
    purpose: str  # one line: what the row shows (gpu_check --help lists them)
    _: KW_ONLY
    reference: str | None = None  # the check whose losses this one's must match ...
    tolerance: float = 0.0  # ... within this max relative difference per step
    nproc: int = 0  # > 0: torchrun with this many ranks
    resume_from: str | None = None  # resume from step 5 of this check's checkpoints
    steps: int | None = None  # None: the tool's --steps
    counts_syncs: bool = False  # counts each step's host reads and device syncs (llmtrain/faults.py)
    module: str | None = None  # not a training run: `python -m module --device <device>`, its exit status the result
    # with `module`: its options after --device; a benchmark also takes the run's overrides (the base ones, then
    # the check's), times them, and writes its result as JSON to the --out it is given (bench/overhead.py)
    options: tuple[str, ...] = ()
    benchmark: bool = False
    speed: bool = False  # its tokens/s is a result: its steps after the first run with no other row's on the GPU
    prompts: bool = False  # data=rl on an arithmetic prompt set written beside its run (tools/arithmetic_set.py)


# Low precision is judged over a longer run than the other rows: float8 rounding and 8-bit moments drift, if at all,
# over many updates.
LOW_PRECISION_STEPS = 50
FSDP = "parallel=fsdp"
EXPERTS = ("model.moe.num_experts=8", "model.moe.every=2")
ROWWISE_EVERYWHERE = ("train.float8=rowwise", "train.float8_layers=all")


def single_gpu_checks(llama: list[str], whole_llama: list[str]) -> list[Check]:
    """In the order they run: first what only a GPU shows and the run's own layouts had never run on one (one-rank
    FSDP over NCCL with each optimizer, mixture and float8, a float8 FSDP resume, the step's device syncs, ring
    attention's kernels, compiled bf16's MFU, QLoRA's NF4 base), each after its reference; then the rest. bf16
    eager without activation checkpointing is the reference of most. `llama`: the overrides of the Llama rows'
    model; `whole_llama`: those of the row whose MFU is held to MFU_TARGETS (gpu_check_report.py)."""
    first = [
        *reference_checks(),
        *compiled_speed_checks(),
        *attention_mask_checks(),
        *optimizer_and_expert_checks(),
        *float8_checks(),
        *offload_checks(),
        *rowwise_float8_checks(),
        *qlora_checks(),
        *sampling_checks(),
    ]
    rest = [
        *precision_and_recompute_checks(),
        *feature_checks(whole_llama),
        *low_precision_checks(llama),
        *async_checkpoint_checks(),
    ]
    return [*first, *rest]


def reference_checks() -> list[Check]:
    """bf16, the reference of most rows, and what no CPU test can show: the step's device syncs, ring attention's
    CUDA kernels, FSDP over NCCL."""
    return [
        Check(
            "bf16",
            ["train.precision=bf16"],
            "eager bf16 without activation checkpointing: the reference of most rows",
            speed=True,
        ),
        Check(
            "host syncs",
            [],
            "CUDA's sync debug mode: one host read a step (loss, norm, stop flag) and no other wait",
            counts_syncs=True,
        ),
        Check(
            "ring kernels",
            [],
            "ring attention's flash and memory-efficient kernels (masked too) and FlexAttention's, against SDPA",
            module="llmtrain.tools.ring_kernel_check",
        ),
        Check(
            "fsdp 1 rank",
            [FSDP],
            "torchrun with one rank: FSDP2's bf16 mixed precision, DTensor, DCP and NCCL on one GPU",
            reference="bf16",
            tolerance=0.03,
            nproc=1,
            speed=True,
        ),
    ]


def compiled_speed_checks() -> list[Check]:
    """Compiled bf16 and the plain PyTorch loop it is held to (the speed section)."""
    return [
        Check(
            "compiled none",
            ["train.compile=true"],
            "gpt2 compiled in bf16: its MFU is the speed a user's run starts from",
            reference="bf16",
            tolerance=0.03,
            speed=True,
        ),
        Check(
            "bare",
            ["train.compile=true", "train.precision=bf16"],
            "the plain PyTorch loop, compiled whole, beside llmtrain's step: the speed compiled none is held to",
            module="llmtrain.bench.overhead",
            options=("--steps", "4", "--rounds", "3"),
            benchmark=True,
            speed=True,
        ),
    ]


def attention_mask_checks() -> list[Check]:
    """FlexAttention's block masks. The embedded corpus's documents are long, so few windows cross a boundary and
    the document rows' losses stay near causal's."""
    return [
        Check(
            "document",
            ["train.attention=document"],
            "packed documents on FlexAttention, eager: tokens/s against bf16's is the mask's cost",
            reference="bf16",
            tolerance=0.03,
            speed=True,
        ),
        Check(
            "document compiled",
            ["train.attention=document", "train.compile=true"],
            "packed documents inside compiled blocks: tokens/s against compiled none's is the mask's cost",
            reference="compiled none",
            tolerance=0.03,
            speed=True,
        ),
        Check(
            "windows compiled",
            ["model.sliding_window=[128,128,128,0]", "train.compile=true"],
            "sliding windows in three blocks of four (FlexAttention's windowed mask), compiled: trains",
        ),
    ]


def optimizer_and_expert_checks() -> list[Check]:
    """Muon and mixture-of-experts blocks, each alone and under one-rank FSDP."""
    return [
        Check("muon", ["optim=muon"], "Muon's Newton-Schulz in bf16: tokens/s against bf16's is its cost", speed=True),
        Check(
            "fsdp muon 1 rank",
            [FSDP, "optim=muon"],
            "Muon on FSDP2's DTensor shards, one rank",
            reference="muon",
            tolerance=0.03,
            nproc=1,
        ),
        Check(
            "moe eager",
            [*EXPERTS],
            "8 experts in every second block, one grouped GEMM each: tokens/s against bf16's is routing's cost",
            speed=True,
        ),
        Check(
            "fsdp moe 1 rank",
            [*EXPERTS, FSDP],
            "the experts under FSDP2, one rank",
            reference="moe eager",
            tolerance=0.03,
            nproc=1,
            speed=True,
        ),
    ]


def float8_checks() -> list[Check]:
    """Tensorwise float8 against bf16 over LOW_PRECISION_STEPS, then under one-rank FSDP, saved and resumed."""
    n = LOW_PRECISION_STEPS
    saved = Check(
        "fsdp float8 save",
        [FSDP, "train.float8=tensorwise", "checkpoint.every=5"],
        "a float8 FSDP run checkpointing every 5 steps: the checkpoints fsdp float8 resume starts from",
        nproc=1,
    )
    return [
        Check(
            "bf16 long",
            ["train.precision=bf16"],
            f"bf16 over {n} steps: the low-precision rows' reference",
            steps=n,
            speed=True,
        ),
        Check(
            "float8 tensorwise",
            ["train.float8=tensorwise"],
            "float8 on the FP8 tensor cores (sm_89+), tensorwise on the layers `auto` picks",
            reference="bf16 long",
            tolerance=0.03,
            steps=n,
            speed=True,
        ),
        Check(
            "fsdp float8 8-bit 1 rank",
            [FSDP, "train.float8=tensorwise", "optim.state_bits=8"],
            "float8 all-gathers and 8-bit moments on FSDP2's shards, one rank",
            reference="float8 tensorwise",
            steps=n,
            tolerance=0.03,
            nproc=1,
        ),
        saved,
        Check(
            "fsdp float8 resume",
            saved.overrides,
            "resumed at step 5: steps 6-10 as the first run's, float8 scales recomputed from the loaded weights",
            reference=saved.name,
            tolerance=1e-3,
            nproc=1,
            resume_from=saved.name,
        ),
    ]


def offload_checks() -> list[Check]:
    """The optimizer's update on the host: llmtrain's offloaded AdamW (the same fp32 update, so within 1%), and
    FSDP's own CPU offload."""
    n = LOW_PRECISION_STEPS
    return [
        Check(
            "adamw offload",
            ["optim.offload=true"],
            "AdamW's state and fp32 update on the host, its copies on side streams",
            reference="bf16 long",
            tolerance=0.01,
            steps=n,
            speed=True,
        ),
        Check(
            "fsdp offload 1 rank",
            [FSDP, "optim.offload=true"],
            "the offloaded AdamW on FSDP2's shards, one rank",
            reference="adamw offload",
            tolerance=0.03,
            nproc=1,
            steps=n,
            speed=True,
        ),
        Check(
            "fsdp cpu offload 1 rank",
            [FSDP, "parallel.cpu_offload=true"],
            "FSDP's own CPU offload: shards, gradients and AdamW on the host (GPUs only)",
            reference="adamw offload",
            tolerance=0.03,
            nproc=1,
            steps=n,
        ),
    ]


def rowwise_float8_checks() -> list[Check]:
    """Rowwise float8 on every eligible layer: at GPT-2's shape it pays on none (train.float8_layers=auto converts
    nothing), and these rows hold its kernels and its compiled casts."""
    n = LOW_PRECISION_STEPS
    return [
        Check(
            "float8 rowwise",
            [*ROWWISE_EVERYWHERE],
            "rowwise float8 on every eligible layer: its kernels",
            reference="bf16 long",
            tolerance=0.03,
            steps=n,
            speed=True,
        ),
        Check(
            "float8 rowwise compiled full",
            [*ROWWISE_EVERYWHERE, "train.compile=true", "train.activation_checkpointing=full"],
            "compiled rowwise float8 under activation checkpointing: inductor rounds its casts as eager does",
            reference="float8 rowwise",
            tolerance=0.03,
            steps=n,  # the reference's learning-rate schedule
            speed=True,
        ),
    ]


def qlora_checks() -> list[Check]:
    """QLoRA: adapters over torchao's NF4 base against the same adapters over a bf16 base, then under one-rank
    FSDP."""
    adapters, nf4 = ["model.lora.rank=16"], ["model.quantize_base=nf4"]
    return [
        Check("lora", [*adapters, "train.precision=bf16"], "rank-16 adapters over a bf16 base", speed=True),
        Check(
            "qlora",
            [*adapters, *nf4, "train.precision=bf16"],
            "the adapters over an NF4 base, each matmul dequantising its weight on the GPU",
            reference="lora",
            tolerance=0.03,
            speed=True,
        ),
        Check(
            "fsdp qlora 1 rank",
            [FSDP, *adapters, *nf4],
            "QLoRA under FSDP2, one rank: the all-gather moves the NF4 codes and scales",
            reference="qlora",
            tolerance=0.03,
            nproc=1,
        ),
    ]


# GRPO's rows (train.objective=grpo): text prompts of byte tokens, rewarded by their final number and the `####`
# that precedes it, 8 completions of 2 prompts a step.
GRPO = ("data=rl", "data.reward=[exact_number,regex]", "data.reward_pattern='####'", "data.reward_weights=[1,0.1]",
        "rl.group_size=8", "rl.max_new_tokens=64", "rl.beta=0.04", "model.lora.rank=16")  # fmt: skip


def sampling_checks() -> list[Check]:
    """The KV-cached sampler on the GPU against transformers' generate, the chat served over HTTP against the
    sampler alone, then GRPO steps: rollouts decoded in bf16
    (the ratio of a rollout's first step is then not exactly 1), alone and under one-rank FSDP gathering the whole
    model once over NCCL."""
    return [
        Check(
            "sampler vs generate",
            [],
            "the KV-cached sampler's tokens/s against transformers' generate with its cache, greedy, same tokens",
            module="llmtrain.bench.sampling",
            options=("model=qwen3-0.6b", "--rounds", "3"),
        ),
        Check(
            "chat served vs sampler",
            [],
            "the chat's answers over HTTP (OpenAI's API, streamed and whole) against the sampler alone, same tokens",
            module="llmtrain.bench.chat_serving",
            options=("model=qwen3-0.6b", "--rounds", "3"),
        ),
        Check("grpo", [*GRPO], "GRPO steps: bf16 rollouts, rewards, the reference's KL, LoRA", prompts=True, steps=6),
        Check(
            "fsdp grpo 1 rank",
            [FSDP, *GRPO],
            "GRPO under FSDP2, one rank: the rollout gathers the whole model once, then FSDP's step",
            prompts=True,
            steps=6,
            nproc=1,
        ),
    ]


def precision_and_recompute_checks() -> list[Check]:
    """fp32, then eager and compiled each under both activation checkpointing policies, which change nothing but
    memory and time (within 1% of the same compile mode without them), and with dropout."""
    checks = [Check("fp32", ["train.precision=fp32"], "fp32 with TF32 matmuls", reference="bf16", tolerance=0.03)]
    for compiled in (False, True):
        mode = "compiled" if compiled else "eager"
        flag = f"train.compile={str(compiled).lower()}"
        for ac in ("full", "selective"):
            checks.append(
                Check(
                    f"{mode} {ac}",
                    [flag, f"train.activation_checkpointing={ac}"],
                    f"{ac} activation checkpointing, {mode}: changes nothing but memory and time",
                    reference="compiled none" if compiled else "bf16",
                    tolerance=0.01,
                    speed=ac == "selective",
                )
            )
        checks.append(
            Check(
                f"dropout {mode}",
                [flag, "model.dropout=0.1", "model.attention_dropout=0.1"],
                f"model and attention dropout 0.1, {mode}: trains; tokens/s against the run without is its cost",
                speed=True,
            )
        )
    return checks


def feature_checks(whole_llama: list[str]) -> list[Check]:
    """Compiled experts, profiling, and the whole Llama model's MFU."""
    return [
        Check("moe compiled", [*EXPERTS, "train.compile=true"], "the experts compiled: trains"),
        Check(
            "profile",
            ["profile.steps=[5,6]", "profile.memory=true"],
            "a trace of steps 5-6 and the allocator's history: the losses unchanged",
            reference="bf16",
            tolerance=1e-2,
        ),
        Check(
            "llama3.2-1b",
            [*whole_llama, "train.precision=bf16", "train.compile=true"],
            "the whole model in bf16, compiled, at sequence 2,048: its MFU, held to MFU_TARGETS",
            speed=True,
        ),
    ]


def low_precision_checks(llama: list[str]) -> list[Check]:
    """Float8 on the FP8 tensor cores (sm_89+: skipped below), 8-bit AdamW and optimizer offload, each against a
    bf16 run of the same LOW_PRECISION_STEPS within 3% (a stated bound: float8 rounds inputs, weights and output
    gradients to 3 mantissa bits, the 8-bit moments to 256 levels per block; offload, the same fp32 update on the
    host, within 1%); tokens/s against bf16's is what each buys or costs. Compiled float8 against eager float8:
    torchao's float8 speed-up comes with torch.compile fusing the casts. Then llama3.2-1b's blocks (two of them:
    GQA and SwiGLU's widths) the same way. (bf16 long, tensorwise and rowwise float8 and offload run earlier, among
    the first rows.)"""
    n = LOW_PRECISION_STEPS
    compiled_llama = [*llama, "train.compile=true"]
    return [
        Check(
            "float8 compiled",
            ["train.float8=tensorwise", "train.compile=true"],
            "compiled tensorwise float8: torchao's speed-up comes with compile fusing the casts",
            reference="float8 tensorwise",
            tolerance=0.03,
            steps=n,
            speed=True,
        ),
        Check(
            "adamw 8-bit",
            ["optim.state_bits=8"],
            "AdamW's moments in 8 bits, 256 levels per block",
            reference="bf16 long",
            tolerance=0.03,
            steps=n,
            speed=True,
        ),
        Check("llama bf16", compiled_llama, "llama3.2-1b's blocks (2 layers) compiled in bf16", steps=n, speed=True),
        Check(
            "llama float8",
            [*compiled_llama, "train.float8=tensorwise"],
            "the same blocks in tensorwise float8: layers large enough for float8 to pay",
            reference="llama bf16",
            tolerance=0.03,
            steps=n,
            speed=True,
        ),
    ]


def async_checkpoint_checks() -> list[Check]:
    """An async checkpoint and a run resumed from it (within 1e-3: GPU kernels are not bit-deterministic)."""
    return [
        Check(
            "async save",
            ["checkpoint.async_save=true", "checkpoint.every=5"],
            "async checkpoints every 5 steps: the checkpoints resume starts from",
        ),
        Check(
            "resume",
            [],
            "resumed from async save's step 5: steps 6-10 as the first run's",
            reference="async save",
            tolerance=1e-3,
            resume_from="async save",
        ),
    ]


def multi_gpu_checks() -> list[Check]:
    """Every layout and pipeline schedule on 2 GPUs within 3% of one GPU's bf16, and the FSDP rows of the one-rank
    table over NCCL between GPUs against their one-process references."""
    return [*layout_checks(), *distributed_optimizer_checks()]


def layout_checks() -> list[Check]:
    layouts: list[tuple[str, list[str], str]] = [
        ("ddp", [], "DDP's gradient all-reduce over NCCL"),
        ("fsdp", [], "FSDP2 sharded over the GPUs"),
        ("tp", [], "tensor parallelism's collectives over NCCL"),
        ("fsdp cp", ["parallel.cp=2"], "ring attention on the CUDA flash kernels over NCCL"),
    ]
    for schedule in SCHEDULES:
        pipeline = [
            f"parallel.pp_schedule={schedule}",
            f"parallel.pp_stages_per_rank={SCHEDULES[schedule].fewest_stages_per_rank}",
            "parallel.microbatches=4",
        ]
        layouts.append((f"pp {schedule}", pipeline, f"the {schedule} pipeline schedule at its fewest stages per rank"))
    return [
        Check(name, [f"parallel={name.split()[0]}", *extra], purpose, reference="bf16", tolerance=0.03, nproc=2)
        for name, extra, purpose in layouts
    ]


def distributed_optimizer_checks() -> list[Check]:
    n = LOW_PRECISION_STEPS
    return [
        Check(
            "fsdp muon",
            [FSDP, "optim=muon"],
            "Muon's matrices spread over the ranks by NCCL all-to-alls, bf16 Newton-Schulz",
            reference="muon",
            tolerance=0.03,
            nproc=2,
        ),
        Check(
            "fsdp float8 8-bit",
            [FSDP, "train.float8=tensorwise", "optim.state_bits=8"],
            "FSDP's float8 all-gathers with the per-step scale precompute, 8-bit moments on DTensor shards",
            reference="float8 tensorwise",
            tolerance=0.03,
            nproc=2,
            steps=n,
        ),
        Check(
            "fsdp offload",
            [FSDP, "optim.offload=true"],
            "the offloaded AdamW's state of DTensor shards on the host, over NCCL",
            reference="adamw offload",
            tolerance=0.03,
            nproc=2,
            steps=n,
        ),
    ]
