"""llmtrain's step against the bare loop: the plain PyTorch loop every tutorial writes, on the same model, batches
and optimizer settings, and what costs the difference.

    python -m llmtrain.bench.overhead [--steps 5] [--rounds 6] [--out overhead.json] [overrides...]
    python -m llmtrain.bench.overhead model=gpt2 train.seq_len=64 train.batch_size=4 train.micro_batch_size=2

One process builds the job as `train.py` would with the same overrides (parallel=single; no validation, logging or
checkpoints, which cost what the config asks for) and beside it the loops of the ladder below, each on its own copy
of the same initial weights, fed the batches the trainer's data pipeline made beforehand:

  bare       the tutorial loop: fused AdamW (decay on matrices), the same LR schedule, gradient accumulation,
             clipping, bf16 autocast where train.precision asks for it, one `.item()` a step; with train.compile the
             model and its loss compiled whole, as one graph
  as blocks  (train.compile only) the bare loop compiled as llmtrain compiles a layout that splits the model (FSDP,
             pipelines, tensor, context or expert parallelism): each block a graph of its own (one graph reused
             by every block) and the loss another, the embeddings and head between them eager; what this costs
             against one graph. (Where nothing splits the model, parallel=single here, llmtrain compiles it whole.)
  llmtrain   the trainer's step (Trainer.advance): its read of the step's loss, norm and stop flag, its host work
             between steps (metrics, observers), and the data pipeline's cost (the bare loops read ready batches)

The loops alternate, --steps steps each per round, for --rounds rounds after one warm-up round each; each rung's
cost is the median over rounds of its time / the bare loop's time in the same round (alternation exposes every loop
to the machine's drift alike), and the spread of those ratios says how far to trust it. The data pipeline's own
time per step is measured apart and named in the result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import cast

import torch
from omegaconf import OmegaConf

from llmtrain.config import RootConfig
from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.model import build_model, cross_entropy_loss
from llmtrain.optim import build_lr_schedule
from llmtrain.parallel.layout import apply_compile
from llmtrain.parallel.precision import uses_bf16
from llmtrain.process.runtime import Runtime, init_runtime
from llmtrain.run.build import build_training
from llmtrain.tools import compose_config
from llmtrain.train.loop import Trainer
from llmtrain.train.objectives import token_rows

Batches = list[list[tuple[torch.Tensor, torch.Tensor]]]


def bare_loop(cfg: RootConfig, vocab_size: int, batches: Batches, device: torch.device, compiled_as: str):
    """A step function that trains the model of `cfg` the plain PyTorch way, cycling through `batches`.
    `compiled_as`: `none`, `whole` (the model and its loss one graph) or `blocks` (llmtrain's granularity)."""
    model = build_model(cfg.model, vocab_size, cfg.seed).to(device).train()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": o.weight_decay}, {"params": others, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        fused=True,
    )
    schedule = build_lr_schedule(optimizer, cfg.train.steps, o)

    def forward_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(model(inputs), targets)

    if compiled_as == "whole":
        forward_loss = torch.compile(forward_loss)
    elif compiled_as == "blocks":
        apply_compile(model, "blocks")
        loss = torch.compile(cross_entropy_loss)

        def forward_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return loss(model(inputs), targets)

    autocast = torch.autocast(device.type, torch.bfloat16, enabled=uses_bf16(cfg.train.precision, device))
    position = [0]

    def step() -> float:
        micro_batches = batches[position[0] % len(batches)]
        position[0] += 1
        total = torch.zeros((), device=device)
        for inputs, targets in micro_batches:
            with autocast:
                loss = forward_loss(inputs.to(device), targets.to(device)) / len(micro_batches)
            loss.backward()
            total += loss.detach()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
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
    """The ladder's seconds per step (medians over rounds), each rung's median ratio to the bare loop with its
    range, and the data pipeline's seconds per step."""
    cfg = compose_config(
        [
            "parallel=single",
            "train.eval_every=0",
            "checkpoint.every=0",
            "logging.wandb.mode=disabled",
            "data.tokenizer.kind=byte",  # none to train: the loops' work is the model's
            *overrides,
            f"train.steps={10**9}",  # the trainer never reaches its last step (which would save a checkpoint)
        ]
    )
    config = cast(RootConfig, OmegaConf.to_object(cfg))
    with tempfile.TemporaryDirectory() as run_dir:
        training = build_training(config, runtime, run_dir)
        trainer = Trainer(training, lambda record: None)
        data, train_slice = training.data.train, training.train_slice
        vocab_size = training.facts.shape.vocab_size
        batches = [train_slice.micro_batches(token_rows(data.next())) for _ in range(max(steps, 4))]
        started = time.perf_counter()  # the pipeline's own cost, once it has started (its first reads open files)
        for _ in range(steps):
            train_slice.micro_batches(token_rows(data.next()))
        data_s = (time.perf_counter() - started) / steps
        device, compiled = runtime.device, config.train.compile
        ladder = {"bare": bare_loop(config, vocab_size, batches, device, "whole" if compiled else "none")}
        if compiled:
            ladder["as blocks"] = bare_loop(config, vocab_size, batches, device, "blocks")
        ladder["llmtrain"] = trainer.advance
        trainer.model.module.train()
        timings: dict[str, list[float]] = {name: [] for name in ladder}
        for round_index in range(rounds + 1):
            for name, step in ladder.items():
                seconds = seconds_per_step(step, steps, runtime.device)
                if round_index:  # the first round warms every loop up (and compiles)
                    timings[name].append(seconds)
    # Paired by round: each ratio compares loops that ran back to back, under the same machine conditions.
    ratios = {name: [t / bare for t, bare in zip(times, timings["bare"])] for name, times in timings.items()}
    return {
        "overrides": overrides,
        "device": str(runtime.device),
        "s_per_step": {name: statistics.median(times) for name, times in timings.items()},
        "ratio": {name: statistics.median(r) for name, r in ratios.items()},
        "ratio_range": {name: (min(r), max(r)) for name, r in ratios.items()},
        "data_s_per_step": data_s,
        "tokens_per_step": config.train.batch_size * config.train.seq_len,
        "rounds": timings,
    }


def report(result: dict, steps: int, rounds: int) -> str:
    """The ladder as a table, each rung against the bare loop, and what each step up the ladder costs."""
    run = f"{' '.join(result['overrides'])} on {result['device']}"
    lines = [f"{run}: median of {rounds} alternating rounds of {steps} steps"]
    lines.append(f"{'loop':<10} {'ms/step':>8} {'vs bare':>8}  rounds")
    for name, seconds in result["s_per_step"].items():
        low, high = result["ratio_range"][name]
        lines.append(f"{name:<10} {seconds * 1e3:>8.2f} {result['ratio'][name]:>7.3f}x  {low:.3f}-{high:.3f}")
    names = list(result["s_per_step"])
    costs = {
        "as blocks": "compiling block by block (and the loss apart) instead of whole",
        "llmtrain": "the harness: the step's read, host work between steps, the data pipeline "
        f"({result['data_s_per_step'] * 1e3:.2f} ms/step of its own)",
    }
    for lower, upper in zip(names, names[1:]):
        step_up = result["s_per_step"][upper] - result["s_per_step"][lower]
        lines.append(f"{lower} -> {upper}: {step_up * 1e3:+.2f} ms/step, {costs[upper]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="steps of each loop per round")
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds (after one warm-up round)")
    parser.add_argument("--out", default=None, help="also write the result here as JSON")
    parser.add_argument("--device", default="auto", help="auto (a GPU where there is one), cuda or cpu")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (default: model=tiny)")
    args = parser.parse_args()
    runtime = init_runtime(args.device)
    result = measure(args.overrides or ["model=tiny"], args.steps, args.rounds, runtime)
    print(report(result, args.steps, args.rounds))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
