"""Run by tests under torchrun on 4 ranks: one optimizer's checkpoints through a chain of layouts in one process
group, against the unsplit run rank 0 trains by itself first.

    torchrun --nproc_per_node=4 tests/workers/resume_worker.py OUT_DIR "<overrides for all>"

fsdp over 4 ranks trains steps 1-4 and saves after steps 2 and 4; fsdp resumes its step 2 (steps 3-4 again: they
must be bit-identical); tp 2 x dp 2 (ddp_tp) resumes it too and saves after step 3; then rank 0 alone (`single`)
resumes that and takes step 4. Rank 0 writes OUT_DIR/results.json: every run's losses by step, and where the
step-2 checkpoint is.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from omegaconf import OmegaConf

from llmtrain.process.runtime import Runtime, init_runtime
from llmtrain.run.build import build_training
from llmtrain.tools import compose_config
from llmtrain.train.loop import Trainer

STEPS = 4
RUN = [
    f"train.steps={STEPS}",
    "train.eval_every=0",
    "logging.wandb.mode=disabled",
    "train.device=cpu",
    "data.tokenizer.kind=byte",
    "train.save_model=false",
]


def train(overrides: list[str], runtime: Runtime, run_dir: str) -> dict[int, float]:
    """Losses by step of a run of `overrides` from where it starts (step 0, or its checkpoint) to train.steps."""
    return trained([*RUN, *overrides], runtime, run_dir, STEPS)


def trained(overrides: list[str], runtime: Runtime, run_dir: str, last_step: int) -> dict[int, float]:
    """Losses by step of a run of `overrides` from where it starts (step 0, or its checkpoint) to `last_step`."""
    parts = build_training(OmegaConf.to_object(compose_config(overrides)), runtime, run_dir)
    losses: dict[int, float] = {}
    try:
        trainer = Trainer(parts, lambda record: losses.update({record["step"]: record["loss"]}))
        parts.model.module.train()
        while trainer.state.step < last_step:
            trainer.advance()
        trainer.checkpoints.finish()
    finally:
        parts.data.close()
    return losses


def step(run_dir: str, number: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step-{number:08d}")


def main(out_dir: str, common: str) -> None:
    overrides, results = common.split(), {}
    alone = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
    if os.environ["RANK"] == "0":
        results["single"] = train([*overrides, "parallel=single", "checkpoint.resume=none"], alone, f"{out_dir}/single")
    runtime = init_runtime("cpu")
    fsdp, ddp_tp = f"{out_dir}/fsdp", f"{out_dir}/ddp_tp"
    results["fsdp"] = train(
        [*overrides, "parallel=fsdp", "checkpoint.every=2", "checkpoint.resume=none"], runtime, fsdp
    )
    resumed = [f"checkpoint.resume={step(fsdp, 2)}"]
    results["fsdp resumed"] = train([*overrides, "parallel=fsdp", *resumed], runtime, f"{out_dir}/fsdp-again")
    results["ddp_tp"] = train([*overrides, "parallel=ddp_tp", "checkpoint.every=1", *resumed], runtime, ddp_tp)
    runtime.shutdown(synchronize=True)
    if runtime.is_main:
        single = [*overrides, "parallel=single", f"checkpoint.resume={step(ddp_tp, 3)}"]
        results["single resumed"] = train(single, alone, f"{out_dir}/single-again")
        results["checkpoint"] = step(fsdp, 2)
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
