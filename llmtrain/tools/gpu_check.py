"""The GPU path end to end in one command: every row of llmtrain/tools/gpu_check_table.py as a real `train.py` run
(torchrun for the FSDP and multi-GPU rows) of `model=gpt2`, each under a timeout so that a hang shows as a HANG,
all within --budget seconds; then one table, the speed section, and the table as JSON.

    python -m llmtrain.tools.gpu_check [--out gpu_check.json] [--only NAME,...] [--timeout 240] [--budget 480]

--help lists the rows and what each shows; docs/gpu.md says how they share the GPU and what the columns mean.
`--device cpu --model tiny --seq-len 32 --budget 0` runs the same checks on CPU (the test suite rehearses one of
each kind): the harness is proven there, the numbers only on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.parallel.float8 import FP8_CAPABILITY
from llmtrain.tools.compare_runs import read_metrics
from llmtrain.tools.gpu_check_report import compare_losses, format_table, speed_section
from llmtrain.tools.gpu_check_runs import Row, Schedule, run_dir
from llmtrain.tools.gpu_check_table import Check, multi_gpu_checks, single_gpu_checks


def main() -> None:
    args = parser().parse_args()
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        sys.exit("gpu_check: no CUDA GPU is visible; nothing was checked (--device cpu proves the harness on CPU)")
    if args.parallel is None:
        memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpus else 40
        args.parallel = max(1, min(4, int(memory_gib // 20)))
    float8_supported = args.device != "cuda" or torch.cuda.get_device_capability(0) >= FP8_CAPABILITY
    checks = select_checks(args, gpus, float8_supported)
    started = time.monotonic()
    rows = run_checks(checks, base_overrides(args), args)
    wall = time.monotonic() - started
    device = torch.cuda.get_device_name(0) if gpus else "cpu"
    report(rows, args, device, gpus, wall)
    sys.exit(0 if all(r.status == "ok" or "--budget" in r.status for r in rows) else 1)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog=rows_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog's rows one a line
    )
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
    return parser


def rows_help() -> str:
    """The rows in the order they run, each with what it shows: the names --only takes."""
    checks = single_gpu_checks(*llama_overrides("gpt2")) + multi_gpu_checks()
    width = max(len(check.name) for check in checks)
    lines = [f"  {check.name:<{width}}  {check.purpose}" for check in checks]
    return "\n".join(["rows, in order (the last ones only with 2+ GPUs; --only takes their names):", *lines])


def llama_overrides(model: str) -> tuple[list[str], list[str]]:
    """The Llama rows' models: llama3.2-1b's blocks (2 layers) for the low-precision rows and the whole model at
    sequence 2,048 (its own vocabulary) for its MFU, or on a CPU rehearsal of the tiny model its Llama twin."""
    if model == "tiny":
        return ["model=llama-tiny"], ["model=llama-tiny"]
    blocks = ["model=llama3.2-1b", "model.n_layer=2"]
    whole = ["model=llama3.2-1b", "model.vocab_size=128256", "train.seq_len=2048"]
    return blocks, whole


def select_checks(args: argparse.Namespace, gpus: int, float8_supported: bool) -> list[Check]:
    """The rows this machine can run (the multi-GPU ones with 2+ GPUs, float8 where the GPU has FP8 tensor cores),
    narrowed to --only's."""
    checks = single_gpu_checks(*llama_overrides(args.model)) + (multi_gpu_checks() if gpus >= 2 else [])
    if args.device != "cuda":  # FSDP's CPU offload moves shards off an accelerator
        checks = [c for c in checks if "parallel.cpu_offload=true" not in c.overrides]
    if not float8_supported:  # train.float8 is refused there
        checks = [c for c in checks if not any(o.startswith("train.float8=") for o in c.overrides)]
    if args.only:
        wanted = set(args.only.split(","))
        checks = [c for c in checks if c.name in wanted]
    return checks


def base_overrides(args: argparse.Namespace) -> list[str]:
    """Every run's overrides before its check's: the model on the embedded corpus with byte tokens and, for GPT-2,
    its padded vocabulary of 50,304, so the model has GPT-2's shape and no tokenizer is trained."""
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
    return base


def run_checks(checks: list[Check], base: list[str], args: argparse.Namespace) -> list[Row]:
    """Every check's row, its losses held to its reference's; the runs' files go with a temporary folder."""
    with tempfile.TemporaryDirectory() as temporary:
        workdir = Path(temporary)
        schedule = Schedule(
            base, workdir, parallel=args.parallel, timeout=args.timeout, budget=args.budget, device=args.device
        )
        rows = schedule.run(checks)
        losses = {
            check.name: read_metrics(str(run_dir(workdir, check.name)))
            for check, row in zip(checks, rows)
            if row.status == "ok" and check.module is None
        }
    for check, row in zip(checks, rows):
        compare_losses(row, check, losses)
    return rows


def report(rows: list[Row], args: argparse.Namespace, device: str, gpus: int, wall: float) -> None:
    """The table, the speed section and a summary on stdout; the table as JSON to --out."""
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


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
