"""Run by tests under torchrun: several layouts of one model, each trained a few steps by the real trainer (the
components llmtrain/job.py builds for train.py) in one process group, on the same global batches as the unsplit
model, which rank 0 also trains by itself (`single`, in-process). The process group and the imports are paid for
once, however many layouts.

    torchrun --nproc_per_node=N tests/layout_worker.py OUT_DIR "<overrides for all>" "<layout 1>" "<layout 2>" ...

Each layout is a space-separated list of overrides ("parallel=tp parallel.sequence_parallel=true"). Rank 0 writes
OUT_DIR/results.json: per layout its per-step losses and gradient norms, and its largest weight difference to the
unsplit model after the last step; "single" holds the reference's losses and norms.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from omegaconf import OmegaConf

from llmtrain.job import build_training
from llmtrain.runtime import Runtime, init_runtime
from llmtrain.tools import compose_config
from llmtrain.tools.compare_runs import max_weight_difference
from llmtrain.train.loop import Trainer

# A few steps of the tiny model on the embedded corpus, byte tokens, no validation; each layout's run directory
# (its end-of-run checkpoint) under OUT_DIR.
RUN = ["train.steps=3", "train.eval_every=0", "logging.wandb.mode=disabled", "train.device=cpu"]


def train(overrides: list[str], runtime: Runtime, run_dir: str) -> tuple[list[float], list[float], dict | None]:
    """(losses, gradient norms, rank 0's full weights) of the trainer's run of `overrides`."""
    training = build_training(OmegaConf.to_object(compose_config([*RUN, *overrides])), runtime, run_dir)
    records: list[dict] = []
    try:
        Trainer(training, records.append, preemption=None).run()
        training.checkpoints.finish()
    finally:
        training.data.close()
    losses, norms = [r["loss"] for r in records], [r["grad_norm"] for r in records]
    return losses, norms, training.strategy.full_state_dict(training.model)


def main(out_dir: str, common: str, layouts: list[str]) -> None:
    runtime = init_runtime("cpu")
    overrides = common.split()
    results: dict[str, dict] = {}
    reference = None
    if runtime.is_main:
        local = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
        losses, norms, reference = train([*overrides, "parallel=single"], local, os.path.join(out_dir, "single"))
        results["single"] = {"losses": losses, "norms": norms}
    for index, layout in enumerate(layouts):
        losses, norms, weights = train([*overrides, *layout.split()], runtime, os.path.join(out_dir, f"{index}"))
        if runtime.is_main:
            assert weights is not None and reference is not None
            results[layout] = {
                "losses": losses,
                "norms": norms,
                "same_names": sorted(weights) == sorted(reference),
                "weight_difference": max_weight_difference(weights, reference),
            }
    if runtime.is_main:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
