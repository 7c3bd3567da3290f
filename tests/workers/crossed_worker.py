"""Run by tests under torchrun on 2 ranks: the rows of the crossed-options matrix (tests/harness/crossed.py), each
trained by the real trainer for two steps, saving after each, then built again from its first checkpoint and trained
to step 2 once more. Rows of one process (`parallel=single`) run on rank 0 before the group forms.

    torchrun --nproc_per_node=2 tests/workers/crossed_worker.py OUT_DIR ROWS_JSON

ROWS_JSON holds [{"name": ..., "overrides": [...], "ranks": 1 or 2}, ...]. Rank 0 writes OUT_DIR/results.json: per
row its losses by step, those of the resumed run, and the seconds both took.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time

import torch
from resume_worker import trained

from llmtrain.process.runtime import Runtime, init_runtime
from llmtrain.train.report import compiled_graphs

STEPS = 2  # of train.steps=3: no end-of-run checkpoint, the checkpoint.every=1 ones alone
# A row takes under a minute on 2 cores; one still running after this is stuck: every thread's stack is printed and
# the rank exits, so a hang fails its chunk with where each rank waited, within the test's timeout.
ROW_DEADLINE_S = 240


def run_row(row: dict, runtime: Runtime, out_dir: str) -> dict:
    """The row trained, then resumed from its first checkpoint; the graphs torch.compile made of both, dynamo's
    caches emptied first (a row then compiles its own graphs, whatever rows ran before it)."""
    torch._dynamo.reset()
    faulthandler.dump_traceback_later(ROW_DEADLINE_S, exit=True)
    began, graphs = time.perf_counter(), compiled_graphs()
    first, again = (os.path.join(out_dir, row["name"], run) for run in ("first", "again"))
    losses = trained([*row["overrides"], "checkpoint.resume=none"], runtime, first, STEPS)
    resume = f"checkpoint.resume={os.path.join(first, 'checkpoints', 'step-00000001')}"
    resumed = trained([*row["overrides"], resume], runtime, again, STEPS)
    faulthandler.cancel_dump_traceback_later()
    return {
        "losses": losses,
        "resumed": resumed,
        "compiled_graphs": compiled_graphs() - graphs,
        "seconds": time.perf_counter() - began,
    }


def main(out_dir: str, rows_file: str) -> None:
    with open(rows_file) as f:
        rows = json.load(f)
    results = {}
    if os.environ["RANK"] == "0":
        alone = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
        for row in rows:
            if row["ranks"] == 1:
                print(f"row {row['name']}", flush=True)
                results[row["name"]] = run_row(row, alone, out_dir)
    runtime = init_runtime("cpu")
    for row in rows:
        if row["ranks"] > 1:
            if runtime.is_main:
                print(f"row {row['name']}", flush=True)
            results[row["name"]] = run_row(row, runtime, out_dir)
    runtime.shutdown(synchronize=True)
    if runtime.is_main:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
