"""Tokens/s of several layouts on this machine, each run through the real entry point, in one table.

    python -m llmtrain.bench.layout_benchmark --nproc 4 --layouts ddp,zero1,zero2,fsdp,hsdp -- model=tiny

Every layout trains the same model on the same global batches for the same steps (`single` runs in one process,
the others with --nproc workers); the table gives steady-state tokens/s (first step excluded), the ratio to the
first layout listed, and the final loss, which should agree across layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from llmtrain.errors import closed_pipe_is_quiet

TRAIN_PY = os.path.join(os.path.dirname(__file__), "..", "..", "train.py")
DEFAULTS = ["train.steps=20", "train.eval_every=0", "logging.wandb.mode=disabled", "train.save_model=false"]


def run_layout(layout: str, nproc: int, overrides: list[str], workdir: str) -> dict:
    run_dir = os.path.join(workdir, "".join(c if c.isalnum() else "_" for c in layout))
    layout_args = layout.split()
    args = [
        sys.executable,
        os.path.abspath(TRAIN_PY),
        f"parallel={layout_args[0]}",
        *layout_args[1:],
        f"hydra.run.dir={run_dir}",
        *DEFAULTS,
        *overrides,
    ]
    if layout_args[0] != "single":
        args.append(f"parallel.nproc={nproc}")
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{layout} failed:\n{done.stderr[-2000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="workers for every layout but single")
    parser.add_argument(
        "--layouts",
        default="ddp,zero1,zero2,fsdp,hsdp parallel.dp_shard=2",
        help="comma-separated parallel= options, each optionally followed by overrides",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    layouts = [layout.strip() for layout in args.layouts.split(",")]
    with tempfile.TemporaryDirectory() as workdir:
        results = {layout: run_layout(layout, args.nproc, args.overrides, workdir) for layout in layouts}
    baseline = results[layouts[0]]["tokens_per_s"]
    print(f"{'layout':<32} {'ranks':>5} {'tokens/s':>10} {'vs ' + layouts[0].split()[0]:>10} {'final loss':>11}")
    for layout, summary in results.items():
        print(
            f"{layout:<32} {summary['world_size']:>5} {summary['tokens_per_s']:>10,.0f} "
            f"{summary['tokens_per_s'] / baseline:>9.2f}x {summary['final_loss']:>11.4f}"
        )


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
