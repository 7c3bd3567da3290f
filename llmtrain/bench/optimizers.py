"""What each optimizer and schedule learns in a fixed budget, and what Muon costs per step.

    python -m llmtrain.bench.optimizers [--steps 200] [overrides...]      # one process: the quality table
    torchrun --standalone --nproc_per_node=4 -m llmtrain.bench.optimizers --overhead [overrides...]

The quality table trains each model (`model=tiny`, and a 20M-parameter one: tiny widened to 512 and deepened to 6
blocks) with AdamW + cosine, AdamW + WSD and Muon + WSD from the same seed, on the same batches (equal steps are
equal tokens), in one process as `train.py` would (the embedded corpus, its BPE tokenizer), and prints the final
validation loss and the median wall time of a training step, each against AdamW + cosine of the same model.

--overhead builds fsdp over the ranks it is started on and times the optimizer step alone (after the gradients of
one real forward/backward) for AdamW, the 8-bit AdamW (and torchao's AdamW8bit, which steps tensor by tensor, on the
same parameters), the offloaded AdamW, Muon with its matrices spread over the ranks and Muon gathering them: median
seconds per step over --steps steps (after two that compile), and the ratio to AdamW's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import cast

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from llmtrain.config import RootConfig
from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.optim import adamw_options, param_groups
from llmtrain.optional import import_torchao
from llmtrain.process.runtime import Runtime, init_runtime
from llmtrain.run.build import build_parallel_model, build_training
from llmtrain.tools import compose_config
from llmtrain.train.loop import Trainer

MODELS = {
    "tiny": ["model=tiny"],
    "tiny-20M": ["model=tiny", "model.n_layer=6", "model.d_model=512", "model.n_head=8"],
}
SETTINGS = {
    "adamw cosine": ["optim=adamw", "optim.lr_schedule=cosine"],
    "adamw wsd": ["optim=adamw", "optim.lr_schedule=wsd"],
    "muon wsd": ["optim=muon", "optim.lr_schedule=wsd"],
}
QUIET = ["logging.wandb.mode=disabled", "checkpoint.resume=none", "train.save_model=false", "logging.progress=lines"]


def train(overrides: list[str], steps: int, runtime: Runtime) -> tuple[float, float]:
    """(final validation loss, median seconds of a training step) of a run of `overrides`."""
    config = compose_config([*QUIET, f"train.steps={steps}", f"train.eval_every={steps}", *overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        parts = build_training(cast(RootConfig, OmegaConf.to_object(config)), runtime, run_dir)
        records: list[dict] = []
        seconds: list[float] = []
        try:
            trainer = Trainer(parts, records.append)
            parts.model.module.train()
            for _ in range(steps):
                started = time.perf_counter()
                trainer.advance()
                seconds.append(time.perf_counter() - started)
        finally:
            parts.data.close()
    return records[-1]["val_loss"], statistics.median(seconds[1:-1])  # the first compiles, the last validates


def quality(steps: int, overrides: list[str]) -> None:
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
    print(f"{steps} steps each, one process; ratios against AdamW + cosine of the same model")
    print(f"{'model':<10} {'setting':<14} {'val loss':>9} {'s/step':>8} {'loss ratio':>11} {'time ratio':>11}")
    for model, model_overrides in MODELS.items():
        baseline: tuple[float, float] | None = None
        for setting, setting_overrides in SETTINGS.items():
            loss, seconds = train([*model_overrides, *setting_overrides, *overrides], steps, runtime)
            baseline = baseline or (loss, seconds)
            print(
                f"{model:<10} {setting:<14} {loss:>9.4f} {seconds:>8.3f} {loss / baseline[0]:>11.3f} "
                f"{seconds / baseline[1]:>11.2f}",
                flush=True,
            )


def step_seconds(overrides: list[str], steps: int, runtime: Runtime, torchao: bool = False) -> float:
    """Median seconds of the optimizer step of `overrides` under fsdp, over `steps` steps; `torchao`: torchao's
    AdamW8bit over the same parameter groups in place of the configured optimizer."""
    cfg = cast(RootConfig, OmegaConf.to_object(compose_config(["parallel=fsdp", *overrides])))
    model = build_parallel_model(cfg, runtime, 257)
    optimizer = model.optimizer
    if torchao:
        optimizer = import_torchao("torchao.optim").AdamW8bit(
            param_groups(model.module, cfg.optim), **adamw_options(cfg.optim)
        )
    tokens = torch.randint(0, 257, (cfg.train.micro_batch_size, cfg.train.seq_len + 1))
    model.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
    model.clip_grad_norm(0)
    seconds = []
    for _ in range(steps + 2):
        dist.barrier()
        started = time.perf_counter()
        optimizer.step()
        dist.barrier()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[2:])


def overhead(steps: int, overrides: list[str]) -> None:
    runtime = init_runtime("cpu")
    settings = {
        "adamw": ["optim=adamw"],
        "adamw 8-bit": ["optim=adamw", "optim.state_bits=8"],
        "adamw offload": ["optim=adamw", "optim.offload=true"],
        "muon spread": ["optim=muon", "optim.whole_matrices=spread"],
        "muon gather": ["optim=muon", "optim.whole_matrices=gather"],
    }
    times = {name: step_seconds([*setting, *overrides], steps, runtime) for name, setting in settings.items()}
    times["torchao 8-bit"] = step_seconds([*settings["adamw 8-bit"], *overrides], steps, runtime, torchao=True)
    if runtime.is_main:
        print(f"optimizer step under fsdp x {runtime.world_size}, median of {steps}; ratios against AdamW's")
        for name, seconds in times.items():
            print(f"{name:<14} {seconds * 1000:>9.1f} ms {seconds / times['adamw']:>6.2f}x")
    runtime.shutdown(synchronize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (--overhead: timed steps)")
    parser.add_argument("--overhead", action="store_true", help="time the optimizer step under fsdp instead")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    (overhead if args.overhead else quality)(args.steps, args.overrides)


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
