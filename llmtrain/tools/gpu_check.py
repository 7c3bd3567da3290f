"""The GPU path, end to end, in one command: precision, one-rank FSDP over NCCL, the step's device syncs, ring
attention's kernels, compile x activation checkpointing, dropout, float8, 8-bit and offloaded optimizers, async
checkpoints and resume, speed and memory; with two or more GPUs every layout and pipeline schedule.

    python -m llmtrain.tools.gpu_check [--out gpu_check.json] [--only NAME,...] [--timeout 240] [--budget 480]

Each check is a real `train.py` run (torchrun for the FSDP and multi-GPU ones) of `model=gpt2` on the embedded
corpus with byte tokens and GPT-2's padded vocabulary of 50,304, so the model has GPT-2's shape and no tokenizer is
trained. A run that outlives --timeout is stopped and reported as a HANG: a deadlock is a result, not a stuck tool.

The whole check fits one lent GPU's session (--budget, 8 minutes) because most of a row's time is starting up
(imports, building, compiling), not its steps. The correctness rows (losses against their reference, no skipped
step, a resume, a kernel check) run side by side, --parallel at a time; then the speed rows (those whose tokens/s
is a result), started side by side too, take their steps after the first one row at a time (the table's GPU
column: "alone"; a correctness row says how many rows ran beside it). Every row compiles into one cache, so a
graph compiled once is loaded by the next row that needs it. A row that resumes another's checkpoint runs after
it; rows that would start past the budget are named with the --only that runs them later.

Rows, in order (tolerances are on the per-step training loss, max relative difference over the run):
  bf16                   eager, no activation checkpointing: the reference of most rows
  host syncs             bf16 with CUDA's sync debug mode: per step the host reads the device once (loss, norm
                         and stop flag together) and waits for it no more often than that
  ring kernels           ring attention's blocks on the flash (bf16) and memory-efficient (fp32) kernels, merged
                         by log-sum-exp, and their backward, against SDPA (llmtrain.tools.ring_kernel_check); the
                         same under document masks, and FlexAttention's document kernel, against masked SDPA
  fsdp 1 rank            torchrun with one rank, parallel=fsdp: FSDP2's bf16 mixed precision, DTensor, DCP and
                         NCCL on one GPU, within 3% of bf16; likewise fsdp muon (of muon), fsdp moe (of moe eager),
                         fsdp float8 8-bit (of float8 tensorwise), fsdp offload and fsdp cpu offload (FSDP's own,
                         GPUs only; both of adamw offload)
  compiled none          bf16 compiled: its MFU is gpt2's on this GPU; within 3% of bf16
  bare                   the plain PyTorch loop (compiled whole, fused AdamW) on the same model and batches, and
                         beside it in one process llmtrain's step (llmtrain.bench.overhead): the speed section
                         holds compiled none to 0.97x of its tokens/s; its note, each loop's ratio to it
  document, document compiled
                         train.attention=document on FlexAttention, eager and compiled blocks: within 3% of bf16
                         and of compiled none (few of the corpus's windows cross a document boundary); tokens/s
                         against theirs is the mask's cost
  windows compiled       model.sliding_window=[128,128,128,0] on FlexAttention: trains, no skipped step
  muon, moe eager        Muon's Newton-Schulz in bf16; 8 experts in every second block, one grouped GEMM each
  fsdp float8 save/resume  float8 FSDP checkpoints every 5 steps, a new run resumes from step 5: steps 6-10 within
                         1e-3 of the first run's (the float8 scales recomputed from the loaded weights)
  bf16 long, float8 tensorwise|rowwise, adamw offload (rowwise on every eligible layer: at GPT-2's shape it pays
                         on none)
                         50 steps each: train.float8 (FP8 tensor cores, sm_89+) within 3% of bf16 long,
                         optim.offload=true within 1%; tokens/s against bf16 long's is what each buys or costs
  float8 rowwise compiled full  compiled rowwise float8 under activation checkpointing (inductor rounds its casts
                         as eager): within 3% of eager rowwise
  fp32                   TF32 matmuls, within 3% of bf16
  eager|compiled x full|selective
                         activation checkpointing changes nothing but memory and time: within 1% of the same
                         compile mode without it
  dropout eager|compiled model.dropout=0.1 and attention_dropout=0.1: trains, no skipped steps; its tokens/s
                         against the run without dropout is what dropout costs
  moe compiled, profile  compiled experts; profile.steps=[5,6] and profile.memory=true within 1% of bf16
  llama3.2-1b            the whole model in bf16, compiled, at sequence 2,048: its MFU, held to MFU_TARGETS
  float8 compiled, adamw 8-bit, llama bf16|float8
                         50 steps each: compiled tensorwise of eager, optim.state_bits=8 of bf16 long within 3%;
                         llama3.2-1b's blocks (2 layers) compiled, the same way
  async save / resume    checkpoint.async_save every 5 steps, then a new run resumed from step 5: steps 6-10
                         within 1e-3 of the first run's (GPU kernels are not bit-deterministic)
  2+ GPUs                ddp, fsdp, tp, fsdp with cp 2 (ring attention on the flash kernels) and pp with every
                         schedule on 2 GPUs, each within 3% of one GPU; fsdp muon within 3% of muon; fsdp
                         float8 8-bit (float8 all-gathers) within 3% of float8 tensorwise; fsdp offload within 3%
                         of adamw offload
No row has any skipped (non-finite) step. Speed columns: tokens/s and MFU (steps after the first), peak allocated /
reserved GiB over the run. The speed section after the table: each feature's tokens/s against its reference's
(SPEED_TARGETS), met or MISSED where it has a target; a miss is reported, not a failure of the check.

`--device cpu --model tiny --seq-len 32 --budget 0` runs the same checks on CPU (the test suite rehearses one of
each kind): the harness is proven there, the numbers only on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtrain.catalog import SCHEDULES
from llmtrain.differences import max_relative_difference, within
from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.parallel.float8 import FP8_CAPABILITY
from llmtrain.tools.compare_runs import read_metrics

REPO = Path(__file__).resolve().parents[2]
MIN_ROW_SECONDS = 20  # a row started with less of the budget left would be cut before it shows anything


@dataclass
class Check:
    name: str
    overrides: list[str]
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


@dataclass
class Row:
    name: str
    status: str = "ok"
    seconds: float = 0.0
    first_loss: float | None = None
    final_loss: float | None = None
    difference: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    reserved_gib: float | None = None
    gpu: str = ""  # how it shared the GPU: "alone" (its measured steps), or the rows that ran beside it
    notes: list[str] = field(default_factory=list)
    span: tuple[float, float] = (0.0, 0.0)  # when its process ran (monotonic seconds)


ROWWISE_EVERYWHERE = ("train.float8=rowwise", "train.float8_layers=all")


def single_gpu_checks(llama: list[str], whole_llama: list[str]) -> list[Check]:
    """In the order they run: first what only a GPU shows and the run's own layouts had never run on one (one-rank
    FSDP over NCCL with each optimizer, mixture and float8, a float8 FSDP resume, the step's device syncs, ring
    attention's kernels, compiled bf16's MFU, QLoRA's NF4 base), each after its reference; then the rest. bf16
    eager without activation checkpointing is the reference of most. A budget (--budget) cuts the tail. `llama`:
    the overrides of the Llama rows' model; `whole_llama`: those of the row whose MFU is held to MFU_TARGETS."""
    experts = ["model.moe.num_experts=8", "model.moe.every=2"]
    adapters, nf4 = ["model.lora.rank=16"], ["model.quantize_base=nf4"]
    n = LOW_PRECISION_STEPS
    fsdp = "parallel=fsdp"
    float8_saved = Check("fsdp float8 save", [fsdp, "train.float8=tensorwise", "checkpoint.every=5"], nproc=1)
    first = [
        Check("bf16", ["train.precision=bf16"], speed=True),
        Check("host syncs", [], counts_syncs=True),
        Check("ring kernels", [], module="llmtrain.tools.ring_kernel_check"),
        Check("fsdp 1 rank", [fsdp], reference="bf16", tolerance=0.03, nproc=1, speed=True),
        # gpt2 in bf16 compiled: its MFU column is the speed a user's run starts from
        Check("compiled none", ["train.compile=true"], reference="bf16", tolerance=0.03, speed=True),
        # the plain PyTorch loop on the same model and batches, compiled whole, beside llmtrain's step in one
        # process (bench/overhead.py): compiled none's reference in the speed section
        Check(
            "bare",
            ["train.compile=true", "train.precision=bf16"],
            module="llmtrain.bench.overhead",
            options=("--steps", "4", "--rounds", "3"),
            benchmark=True,
            speed=True,
        ),
        # packed documents on FlexAttention (compiled kernel; from eager and inside compiled blocks): the embedded
        # corpus's documents are long, so few windows cross a boundary and the loss stays near causal's; tokens/s
        # against the reference's is what the block mask costs
        Check("document", ["train.attention=document"], reference="bf16", tolerance=0.03, speed=True),
        Check(
            "document compiled",
            ["train.attention=document", "train.compile=true"],
            reference="compiled none",
            tolerance=0.03,
            speed=True,
        ),
        # sliding windows in three blocks of four (FlexAttention's windowed block mask): trains, no skipped step
        Check("windows compiled", ["model.sliding_window=[128,128,128,0]", "train.compile=true"]),
        # Muon with its Newton-Schulz iterations in bf16: trains, no skipped step; tokens/s against bf16's is what
        # its update costs on this GPU
        Check("muon", ["optim=muon"], speed=True),
        Check("fsdp muon 1 rank", [fsdp, "optim=muon"], reference="muon", tolerance=0.03, nproc=1),
        # experts as one grouped GEMM in bf16 (the CUDA kernel): trains, no skipped step; tokens/s against bf16's
        # is what routing costs on this GPU
        Check("moe eager", experts, speed=True),
        Check("fsdp moe 1 rank", [*experts, fsdp], reference="moe eager", tolerance=0.03, nproc=1, speed=True),
        Check("bf16 long", ["train.precision=bf16"], steps=n, speed=True),
        Check("float8 tensorwise", ["train.float8=tensorwise"], "bf16 long", 0.03, steps=n, speed=True),
        Check(
            "fsdp float8 8-bit 1 rank",
            [fsdp, "train.float8=tensorwise", "optim.state_bits=8"],
            reference="float8 tensorwise",
            steps=n,
            tolerance=0.03,
            nproc=1,
        ),
        float8_saved,
        Check(
            "fsdp float8 resume",
            float8_saved.overrides,
            reference=float8_saved.name,
            tolerance=1e-3,
            nproc=1,
            resume_from=float8_saved.name,
        ),
        Check("adamw offload", ["optim.offload=true"], "bf16 long", 0.01, steps=n, speed=True),
        Check("fsdp offload 1 rank", [fsdp, "optim.offload=true"], "adamw offload", 0.03, 1, steps=n, speed=True),
        # FSDP's own CPU offload (shards, gradients and AdamW on the host; GPUs only)
        Check("fsdp cpu offload 1 rank", [fsdp, "parallel.cpu_offload=true"], "adamw offload", 0.03, nproc=1, steps=n),
        # rowwise on every eligible layer: at GPT-2's shape it pays on none (train.float8_layers=auto converts
        # nothing), and these rows hold its kernels and its compiled casts
        Check("float8 rowwise", [*ROWWISE_EVERYWHERE], "bf16 long", 0.03, steps=n, speed=True),
        # compiled rowwise float8 recomputed under activation checkpointing: inductor must round its casts as eager
        Check(
            "float8 rowwise compiled full",
            [*ROWWISE_EVERYWHERE, "train.compile=true", "train.activation_checkpointing=full"],
            reference="float8 rowwise",
            tolerance=0.03,
            steps=n,  # the reference's learning-rate schedule
            speed=True,
        ),
        # QLoRA: adapters over torchao's NF4 base (each matmul dequantises its weight on the GPU) against the same
        # adapters over a bf16 base, then under one-rank FSDP, whose all-gather moves the NF4 codes and scales
        Check("lora", [*adapters, "train.precision=bf16"], speed=True),
        Check("qlora", [*adapters, *nf4, "train.precision=bf16"], reference="lora", tolerance=0.03, speed=True),
        Check("fsdp qlora 1 rank", [fsdp, *adapters, *nf4], reference="qlora", tolerance=0.03, nproc=1),
    ]
    rest = [Check("fp32", ["train.precision=fp32"], reference="bf16", tolerance=0.03)]
    for compiled in (False, True):
        mode = "compiled" if compiled else "eager"
        flag = f"train.compile={str(compiled).lower()}"
        for ac in ("full", "selective"):
            reference = "compiled none" if compiled else "bf16"
            overrides = [flag, f"train.activation_checkpointing={ac}"]
            rest.append(Check(f"{mode} {ac}", overrides, reference, 0.01, speed=ac == "selective"))
        rest.append(Check(f"dropout {mode}", [flag, "model.dropout=0.1", "model.attention_dropout=0.1"], speed=True))
    rest.append(Check("moe compiled", [*experts, "train.compile=true"]))
    rest.append(Check("profile", ["profile.steps=[5,6]", "profile.memory=true"], reference="bf16", tolerance=1e-2))
    rest.append(Check("llama3.2-1b", [*whole_llama, "train.precision=bf16", "train.compile=true"], speed=True))
    rest += low_precision_checks(llama)
    resumed = Check("resume", [], reference="async save", tolerance=1e-3, resume_from="async save")
    return [*first, *rest, Check("async save", ["checkpoint.async_save=true", "checkpoint.every=5"]), resumed]


# Low precision is judged over a longer run than the other rows: float8 rounding and 8-bit moments drift, if at all,
# over many updates.
LOW_PRECISION_STEPS = 50


def low_precision_checks(llama: list[str]) -> list[Check]:
    """Float8 on the FP8 tensor cores (sm_89+: skipped below), 8-bit AdamW and optimizer offload, each against a
    bf16 run of the same LOW_PRECISION_STEPS within 3% (a stated bound: float8 rounds inputs, weights and output
    gradients to 3 mantissa bits, the 8-bit moments to 256 levels per block; offload, the same fp32 update on the
    host, within 1%); tokens/s against bf16's is what each buys or costs. Compiled float8 against eager float8:
    torchao's float8 speed-up comes with torch.compile fusing the casts. Then llama3.2-1b's blocks (two of them:
    GQA and SwiGLU's widths) the same way. (bf16 long, tensorwise and rowwise float8 and offload run earlier, among
    the first rows.)"""
    n = LOW_PRECISION_STEPS
    compiled = ["train.float8=tensorwise", "train.compile=true"]
    checks = [Check("float8 compiled", compiled, "float8 tensorwise", 0.03, steps=n, speed=True)]
    checks.append(Check("adamw 8-bit", ["optim.state_bits=8"], "bf16 long", 0.03, steps=n, speed=True))
    compiled_llama = [*llama, "train.compile=true"]
    checks.append(Check("llama bf16", compiled_llama, steps=n, speed=True))
    float8_llama = [*compiled_llama, "train.float8=tensorwise"]
    checks.append(Check("llama float8", float8_llama, "llama bf16", 0.03, steps=n, speed=True))
    return checks


# The speed section: (row, its reference, the least ratio of their tokens/s the row is held to; None: reported).
# Each feature exists to make a run fit or go faster: below its ratio it costs more than a user would guess.
SPEED_TARGETS: list[tuple[str, str, float | None]] = [
    ("compiled none", "bare", 0.97),  # llmtrain's step against the tutorial loop, compiled whole
    ("fsdp 1 rank", "bf16", 0.9),
    ("fsdp moe 1 rank", "moe eager", 0.85),
    ("compiled selective", "compiled none", 0.9),  # the policy saves the matmuls: recomputes only cheap ops
    ("llama float8", "llama bf16", 1.0),  # float8 where it converts layers large enough to pay
    ("float8 compiled", "compiled none", None),  # GPT-2's layers: float8 converts one in six (the start summary)
    ("adamw 8-bit", "bf16 long", 0.9),
    ("adamw offload", "bf16 long", 0.8),
    ("document compiled", "compiled none", None),
    ("muon", "bf16", None),
    ("moe eager", "bf16", None),
    ("dropout compiled", "compiled none", None),
    ("qlora", "lora", None),  # what dequantising the base each matmul costs against a bf16 base
]
# Model FLOPs utilisation a row is held to: llama3.2-1b whole, bf16 compiled at sequence 2,048.
MFU_TARGETS = {"llama3.2-1b": 0.45}


def speed_section(rows: list[Row]) -> str:
    """Each feature's tokens/s against its reference's from the same call, and the MFU targets, as lines; a row
    missing (not run, failed) is named so."""
    by_name = {row.name: row for row in rows}
    lines = ["speed: tokens/s against the reference's, in this call"]
    for name, reference, target in SPEED_TARGETS:
        row, ref = by_name.get(name), by_name.get(reference)
        if row is None or ref is None:
            continue
        if not (row.tokens_per_s and ref.tokens_per_s):
            lines.append(f"  {name} / {reference}: not measured ({row.status}; {ref.status})")
            continue
        ratio = row.tokens_per_s / ref.tokens_per_s
        verdict = "" if target is None else f"  target {target:.2f}x: {'met' if ratio >= target else 'MISSED'}"
        lines.append(
            f"  {name} / {reference}: {ratio:.3f}x ({row.tokens_per_s:,.0f} / {ref.tokens_per_s:,.0f}){verdict}"
        )
    for name, target in MFU_TARGETS.items():
        row = by_name.get(name)
        if row is not None and row.mfu is not None:
            lines.append(f"  {name} MFU {row.mfu:.1%}  target {target:.0%}: {'met' if row.mfu >= target else 'MISSED'}")
    return "\n".join(lines)


def multi_gpu_checks() -> list[Check]:
    # fsdp cp: ring attention on the CUDA flash kernels over NCCL
    layouts: list[tuple[str, list[str]]] = [("ddp", []), ("fsdp", []), ("tp", []), ("fsdp cp", ["parallel.cp=2"])]
    for schedule in SCHEDULES:
        pipeline = [
            f"parallel.pp_schedule={schedule}",
            f"parallel.pp_stages_per_rank={SCHEDULES[schedule].fewest_stages_per_rank}",
        ]
        layouts.append((f"pp {schedule}", [*pipeline, "parallel.microbatches=4"]))
    checks = [
        Check(name, [f"parallel={name.split()[0]}", *extra], reference="bf16", tolerance=0.03, nproc=2)
        for name, extra in layouts
    ]
    # Muon's matrices spread over the ranks by NCCL all-to-alls, bf16 Newton-Schulz: within 3% of one GPU's Muon.
    checks.append(Check("fsdp muon", ["parallel=fsdp", "optim=muon"], reference="muon", tolerance=0.03, nproc=2))
    # FSDP's float8 all-gathers over NCCL with the per-step scale precompute, 8-bit moments on DTensor shards.
    float8 = ["parallel=fsdp", "train.float8=tensorwise", "optim.state_bits=8"]
    n = LOW_PRECISION_STEPS
    checks.append(Check("fsdp float8 8-bit", float8, "float8 tensorwise", tolerance=0.03, nproc=2, steps=n))
    offload = ["parallel=fsdp", "optim.offload=true"]  # DTensor shards' state on the host, over NCCL
    return [*checks, Check("fsdp offload", offload, "adamw offload", tolerance=0.03, nproc=2, steps=n)]


class Schedule:
    """Runs the rows within the budget: the correctness rows side by side (--parallel at a time: a row holds 8-17 GB
    of an H200's 141), then the speed rows, started side by side too but taking their measured steps in turn; a
    row that resumes another's checkpoint after that row. A row that would start with less than MIN_ROW_SECONDS of
    the budget left is not run; one the budget stops is cut."""

    def __init__(self, base: list[str], workdir: Path, args: argparse.Namespace):
        self.base, self.workdir, self.args = base, workdir, args
        self.deadline = time.monotonic() + (args.budget or float("inf"))

    def run(self, checks: list[Check]) -> list[Row]:
        """Every check's row, in the checks' order, with the GPU column filled."""
        finished: dict[str, Future[Row]] = {}
        for speed in (False, True):
            with ThreadPoolExecutor(self.args.parallel) as pool:
                for check in checks:
                    if check.speed == speed:
                        source = finished.get(check.resume_from) if check.resume_from else None
                        finished[check.name] = pool.submit(self._row, check, source)
        rows = [finished[check.name].result() for check in checks]
        for check, row in zip(checks, rows):
            beside = sum(other is not row and _overlap(row.span, other.span) for other in rows)
            row.gpu = "" if not row.span[1] else "alone" if check.speed else f"with {beside}"
        return rows

    def _row(self, check: Check, source: Future[Row] | None) -> Row:
        if source is not None and source.result().status != "ok":
            return Row(check.name, status="not run (the row it resumes failed)")
        left = self.deadline - time.monotonic()
        if left < MIN_ROW_SECONDS:
            return Row(check.name, status="not run (--budget)")
        row = run_check(check, self.base, self.workdir, min(self.args.timeout, left), self.args.device)
        if row.status.startswith("HANG") and left < self.args.timeout:
            row.status = "cut (--budget)"
        print(f"{row.name}: {row.status} ({row.seconds:.0f}s)", file=sys.stderr, flush=True)
        return row


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[1] > 0 and b[1] > 0 and a[0] < b[1] and b[0] < a[1]


def run_check(check: Check, base: list[str], workdir: Path, timeout: float, device: str) -> Row:
    """One check in a process of its own, stopped after `timeout` seconds. Every run compiles into one cache
    (workdir/inductor: a graph compiled by one row is loaded by the next); a speed row takes its steps after the
    first in turn with the other speed rows (the gpu_turn point of llmtrain/faults.py)."""
    run_dir = workdir / check.name.replace(" ", "_")
    counts = {name: run_dir.with_name(f"{run_dir.name}.{name}") for name in ("host_reads", "device_syncs")}
    points = dict(counts) if check.counts_syncs else {}
    if check.speed:
        points["gpu_turn"] = workdir / "gpu.turn"
    env = {
        "LLMTRAIN_FAULTS": " ".join(f"{name}={path}" for name, path in points.items()),
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }
    if check.module is not None:
        return _run_module(check, device, timeout, env, [*base, *check.overrides], run_dir.with_suffix(".json"))
    overrides = [*base, *check.overrides, f"hydra.run.dir={run_dir}"]
    if check.steps is not None:
        overrides.append(f"train.steps={check.steps}")
    if check.resume_from:
        source = workdir / check.resume_from.replace(" ", "_") / "checkpoints" / "step-00000005"
        overrides.append(f"checkpoint.resume={source}")
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={check.nproc}"]
        if check.nproc
        else [sys.executable]
    )
    row, _ = _run(check.name, [*launcher, str(REPO / "train.py"), *overrides], timeout, env)
    if row.status != "ok":
        return row
    fill_row(row, read_metrics(str(run_dir)))
    if check.counts_syncs:
        count_syncs(row, *(_per_step(path) for path in counts.values()))
    return row


def _run(name: str, command: list[str], timeout: float, env: dict[str, str]) -> tuple[Row, str]:
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the whole group can be stopped on a hang
        env={**os.environ, "WANDB_MODE": "disabled", **{key: value for key, value in env.items() if value}},
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        ended = time.monotonic()
        return Row(name, status=f"HANG (>{timeout:.0f}s)", seconds=ended - started, span=(started, ended)), ""
    ended = time.monotonic()
    row = Row(name, seconds=ended - started, span=(started, ended))
    if process.returncode != 0:
        row.status = f"FAIL (exit {process.returncode})"
        lines = output.strip().splitlines() or ["no output"]
        # the run's own one-line error where there is one (torchrun ends its output with a box of its own)
        row.notes.append(next((line for line in reversed(lines) if line.startswith("error:")), lines[-1]))
    return row, output


def _run_module(
    check: Check, device: str, timeout: float, env: dict[str, str], overrides: list[str], result: Path
) -> Row:
    """A check that is a tool of its own: its exit status is the result, its output lines the notes. A benchmark
    times the run of `overrides` and writes its JSON to `result`: its tokens/s are its bare loop's
    (bench/overhead.py), its note each loop's time against it."""
    assert check.module is not None
    command = [sys.executable, "-m", check.module, "--device", device, *check.options]
    if check.benchmark:
        command += ["--out", str(result), *overrides]
    row, output = _run(check.name, command, timeout, env)
    if row.status.startswith("FAIL") or row.status == "ok":
        row.notes = [line for line in output.strip().splitlines() if line and "Warning" not in line][-8:]
    if check.benchmark and row.status == "ok":
        ladder = json.loads(result.read_text())
        row.tokens_per_s = ladder["tokens_per_step"] / ladder["s_per_step"]["bare"]
        row.notes = [
            ", ".join(f"{name} {ladder['ratio'][name]:.3f}x" for name in ladder["ratio"] if name != "bare")
            + f" of the bare loop's {ladder['s_per_step']['bare'] * 1e3:.1f} ms/step"
        ]
    return row


def _per_step(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def count_syncs(row: Row, reads: list[int], syncs: list[int]) -> None:
    """The steady steps' (after the second: the first compiles, warms up and infers shapes) host reads and device
    syncs: a sync beyond the planned reads fails the row."""
    steady_reads, steady_syncs = reads[2:], syncs[2:]
    row.notes.append(
        f"per step after the 2nd: host reads {sorted(set(steady_reads))}, device syncs {sorted(set(steady_syncs))}"
    )
    if not steady_reads or any(sync > read for sync, read in zip(steady_syncs, steady_reads)):
        row.status = "FAIL"
        row.notes.append("a step waited for the device more often than it read from it")


def fill_row(row: Row, records: list[dict[str, Any]]) -> None:
    """Loss, speed and memory columns from a run's metrics, and a failure when a step was skipped. Speed is over
    the steps after the second: the first compiles and warms up, the second may wait for its turn on the GPU."""
    row.first_loss, row.final_loss = records[0]["loss"], records[-1]["loss"]
    steady = records[2:] or records
    row.tokens_per_s = sum(r["tokens_per_s"] for r in steady) / len(steady)
    if steady[-1].get("mfu") is not None:
        row.mfu = sum(r["mfu"] for r in steady) / len(steady)
    if "peak_memory_gib" in records[-1]:
        row.peak_gib = max(r["peak_memory_gib"] for r in records)
        row.reserved_gib = max(r["peak_reserved_gib"] for r in records)
        if records[-1]["alloc_retries"]:
            row.notes.append(f"{records[-1]['alloc_retries']} allocation retries")
    skipped = [r["step"] for r in records if r.get("skipped")]
    if skipped:
        row.status = "FAIL"
        row.notes.append(f"non-finite steps {skipped}")


def compare_losses(row: Row, check: Check, losses: dict[str, list[dict[str, Any]]]) -> None:
    """Fail the row when its losses stray from its reference's by more than the check's tolerance."""
    if check.reference is None or row.status != "ok" or check.reference not in losses:
        return
    ours = {r["step"]: r["loss"] for r in losses[check.name]}
    theirs = {r["step"]: r["loss"] for r in losses[check.reference]}
    steps = sorted(set(ours) & set(theirs))
    if check.resume_from:
        steps = [s for s in steps if s > 5]
    row.difference = max_relative_difference([ours[s] for s in steps], [theirs[s] for s in steps])
    if not within(row.difference, check.tolerance):
        row.status = "FAIL"
        row.notes.append(f"loss differs from {check.reference} by {row.difference:.2%} > {check.tolerance:.2%}")


def format_table(rows: list[Row]) -> str:
    header = [
        "check",
        "status",
        "s",
        "GPU",
        "loss first->final",
        "vs ref",
        "tokens/s",
        "MFU",
        "peak/reserved GiB",
        "notes",
    ]
    lines = []
    for r in rows:
        loss = f"{r.first_loss:.3f}->{r.final_loss:.3f}" if r.first_loss is not None else ""
        memory = f"{r.peak_gib:.1f}/{r.reserved_gib:.1f}" if r.peak_gib is not None else ""
        lines.append(
            [
                r.name,
                r.status,
                f"{r.seconds:.0f}",
                r.gpu,
                loss,
                f"{r.difference:.2%}" if r.difference is not None else "",
                f"{r.tokens_per_s:,.0f}" if r.tokens_per_s is not None else "",
                f"{r.mfu:.1%}" if r.mfu is not None else "",
                memory,
                "; ".join(r.notes),
            ]
        )
    widths = [max(len(str(x)) for x in column) for column in zip(header, *lines)]
    return "\n".join(" | ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [header, *lines])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="where the table goes as JSON")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all that apply)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds before a run counts as a hang")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to prove the harness on a CPU")
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--parallel",
        type=int,
        default=None,
        help="rows run side by side (default: one per 20 GiB of the GPU, at most 4; 2 on a CPU)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=480,
        help="seconds for all the checks (0: no limit): rows run in order, the last ones cut when time runs out",
    )
    args = parser.parse_args()

    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        sys.exit("gpu_check: no CUDA GPU is visible; nothing was checked (--device cpu proves the harness on CPU)")
    if args.parallel is None:
        memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpus else 40
        args.parallel = max(1, min(4, int(memory_gib // 20)))
    # llama3.2-1b's blocks (2 layers) for the low-precision rows and the whole model at sequence 2,048 (its own
    # vocabulary) for its MFU, or on a CPU rehearsal of the tiny model its Llama twin
    llama, whole_llama = ["model=llama3.2-1b", "model.n_layer=2"], ["model=llama3.2-1b", "model.vocab_size=128256"]
    if args.model == "tiny":
        llama = whole_llama = ["model=llama-tiny"]
    else:
        whole_llama.append("train.seq_len=2048")
    checks = single_gpu_checks(llama, whole_llama) + (multi_gpu_checks() if gpus >= 2 else [])
    if args.device != "cuda":  # FSDP's CPU offload moves shards off an accelerator
        checks = [c for c in checks if "parallel.cpu_offload=true" not in c.overrides]
    if args.device == "cuda" and torch.cuda.get_device_capability(0) < FP8_CAPABILITY:  # refused there: skip
        checks = [c for c in checks if not any(o.startswith("train.float8=") for o in c.overrides)]
    if args.only:
        wanted = set(args.only.split(","))
        checks = [c for c in checks if c.name in wanted]
    base = [
        f"model={args.model}",
        f"train.device={args.device}",
        "data.tokenizer.kind=byte",
        "model.vocab_size=50304" if args.model.startswith("gpt") else "model.vocab_size=null",
        f"train.seq_len={args.seq_len}",
        "train.batch_size=16",
        "train.micro_batch_size=8",
        f"train.steps={args.steps}",
        "train.eval_every=0",
        "train.save_model=false",
        "logging.wandb.mode=disabled",
        "optim.warmup_steps=2",
    ]
    if args.model == "tiny":  # its layers are all below the sizes where float8 converts one
        base.append("train.float8_layers=all")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as workdir:
        rows = Schedule(base, Path(workdir), args).run(checks)
        losses = {
            check.name: read_metrics(str(Path(workdir) / check.name.replace(" ", "_")))
            for check, row in zip(checks, rows)
            if row.status == "ok" and check.module is None
        }
    for check, row in zip(checks, rows):
        compare_losses(row, check, losses)
    wall = time.monotonic() - started
    device = torch.cuda.get_device_name(0) if gpus else "cpu"
    print(f"\ngpu_check on {device} x {max(gpus, 1)}, {args.model} at seq {args.seq_len}, {args.steps} steps\n")
    print(format_table(rows))
    print(f"\n{speed_section(rows)}")
    print(
        f"\n{len(rows)} rows in {wall:.0f} s of wall clock ({sum(r.seconds for r in rows):.0f} s of row time), up to "
        f"{args.parallel} side by side; GPU: 'alone' rows took their steps after the first with no other row's on "
        f"the GPU, 'with n' rows ran beside n others"
    )
    result = {"device": device, "gpus": gpus, "wall_s": wall, "args": vars(args), "rows": [r.__dict__ for r in rows]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwritten to {args.out}")
    cut = [r.name for r in rows if "--budget" in r.status]
    if cut:
        print(f"{len(cut)} checks left for a later run (--budget {args.budget:.0f}): --only {','.join(cut)}")
    sys.exit(0 if all(r.status == "ok" or "--budget" in r.status for r in rows) else 1)


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
