"""What the harness costs per step over a bare PyTorch loop with the same model, batches and optimizer.

    python -m llmtrain.bench.overhead [--steps 5] [--rounds 6] [overrides...]
    python -m llmtrain.bench.overhead model=gpt2 train.seq_len=64 train.batch_size=4 train.micro_batch_size=2

One process builds the job as `train.py` would with the same overrides (parallel=single; no validation, logging or
checkpoints, which cost what the config asks for) and, beside it, a bare loop: the same model (the same initial
weights, a separate copy), torch's AdamW over the same parameter groups, the same LR schedule, gradient
accumulation, clipping, and one `.item()` for the loss. The bare loop is fed batches the trainer's data pipeline
made beforehand, so the pipeline's own cost counts as overhead. The two then alternate, --steps steps each per
round, for --rounds rounds after one warm-up round each; the overhead is the median over rounds of the round's
trainer / bare time ratio, minus one, and the spread of those ratios says how far to trust it. Alternation exposes
both loops to the machine's drift (another process, thermal limits) alike.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import cast

import torch
from omegaconf import OmegaConf

from llmtrain.config import RootConfig
from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.job import build_training
from llmtrain.model import build_model, cross_entropy_loss
from llmtrain.optim import build_lr_schedule, build_optimizer
from llmtrain.runtime import Runtime, init_runtime
from llmtrain.tools import compose_config
from llmtrain.train.loop import Trainer


def bare_loop(cfg, vocab_size: int, batches: list[list[tuple[torch.Tensor, torch.Tensor]]], device: torch.device):
    """A step function that trains the model of `cfg` the plain PyTorch way, cycling through `batches`."""
    model = build_model(cfg.model, vocab_size, cfg.seed).to(device).train()
    optimizer = build_optimizer(model, cfg.optim)
    schedule = build_lr_schedule(optimizer, cfg.train.steps, cfg.optim)
    position = [0]

    def step() -> float:
        micro_batches = batches[position[0] % len(batches)]
        position[0] += 1
        total = torch.zeros((), device=device)
        for inputs, targets in micro_batches:
            loss = cross_entropy_loss(model(inputs.to(device)), targets.to(device)) / len(micro_batches)
            loss.backward()
            total += loss.detach()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        return total.item()

    return step


def seconds_per_step(step: Callable[[], object], steps: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / steps


def measure(overrides: list[str], steps: int, rounds: int, runtime: Runtime) -> dict:
    cfg = compose_config(
        [
            "parallel=single",
            "train.eval_every=0",
            "checkpoint.every=0",
            "logging.wandb.mode=disabled",
            "data.tokenizer.kind=byte",  # none to train: the loops' work is the model's
            f"train.steps={10**9}",  # the trainer never reaches its last step (which would save a checkpoint)
            *overrides,
        ]
    )
    with tempfile.TemporaryDirectory() as run_dir:
        training = build_training(cast(RootConfig, OmegaConf.to_object(cfg)), runtime, run_dir)
        trainer = Trainer(training, lambda record: None)
        data, train_slice = training.data.train, training.train_slice
        vocab_size = training.model_config.vocab_size
        batches = [train_slice.micro_batches(data.next()) for _ in range(max(steps, 4))]
        bare = bare_loop(cfg, vocab_size, batches, runtime.device)
        trainer.model.module.train()
        timings: dict[str, list[float]] = {"bare": [], "trainer": []}
        for round_index in range(rounds + 1):
            for name, step in (("bare", bare), ("trainer", trainer.advance)):
                seconds = seconds_per_step(step, steps, runtime.device)
                if round_index:  # the first round warms both up
                    timings[name].append(seconds)
    # Paired by round: each ratio compares two loops that ran back to back, under the same machine conditions.
    ratios = [trainer / bare - 1 for bare, trainer in zip(timings["bare"], timings["trainer"])]
    return {
        "overrides": overrides,
        "bare_s_per_step": statistics.median(timings["bare"]),
        "trainer_s_per_step": statistics.median(timings["trainer"]),
        "overhead": statistics.median(ratios),
        "overhead_range": (min(ratios), max(ratios)),
        "rounds": timings,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="steps of each loop per round")
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds (after one warm-up round)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (default: model=tiny)")
    args = parser.parse_args()
    runtime = init_runtime("auto")
    result = measure(args.overrides or ["model=tiny"], args.steps, args.rounds, runtime)
    print(
        f"{' '.join(result['overrides'])}: bare loop {result['bare_s_per_step'] * 1e3:.1f} ms/step, trainer "
        f"{result['trainer_s_per_step'] * 1e3:.1f} ms/step, overhead {result['overhead']:+.1%} "
        f"(median of {args.rounds} alternating rounds of {args.steps} steps on {runtime.device}; rounds ranged "
        f"{result['overhead_range'][0]:+.1%} to {result['overhead_range'][1]:+.1%})"
    )


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
