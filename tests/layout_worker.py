"""Run by tests under torchrun: several layouts of one model trained a few steps each in one process group, on the
same global batches as the unsplit model, which rank 0 also trains by itself (`single`, in-process). The process
group and the imports are paid for once, however many layouts.

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

from llmtrain.runtime import Runtime, init_runtime
from llmtrain.tools import build_layout, compose_config
from llmtrain.tools.compare_runs import max_weight_difference

STEPS = 3
VOCAB = 257


def global_batches(cfg) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, VOCAB, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=generator)
        for _ in range(STEPS)
    ]


def train(cfg, runtime: Runtime) -> tuple[list[float], list[float], dict | None]:
    """The trainer's step (llmtrain/train/loop.py) on this rank's part of fixed global batches."""
    torch.manual_seed(cfg.seed)
    strategy, model = build_layout(cfg, runtime, VOCAB)
    optimizer = strategy.build_optimizer(model, cfg.optim)
    precision, _ = strategy.precision()
    size, _ = strategy.micro_batching()
    per_rank = cfg.train.batch_size // strategy.dp_size
    losses, norms = [], []
    for batch in global_batches(cfg):
        rows = batch[strategy.dp_rank * per_rank : (strategy.dp_rank + 1) * per_rank]
        micro_batches = [(chunk[:, :-1], chunk[:, 1:]) for chunk in rows.split(size)]
        losses.append(strategy.reduce_mean(strategy.forward_backward(model, micro_batches, precision)).item())
        norms.append(strategy.clip_grad_norm(model, cfg.optim.grad_clip).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, norms, strategy.full_state_dict(model)


def main(out_dir: str, common: str, layouts: list[str]) -> None:
    runtime = init_runtime("cpu")
    overrides = common.split()
    results: dict[str, dict] = {}
    reference = None
    if runtime.is_main:
        local = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
        losses, norms, reference = train(compose_config([*overrides, "parallel=single"]), local)
        results["single"] = {"losses": losses, "norms": norms}
    for layout in layouts:
        losses, norms, weights = train(compose_config([*overrides, *layout.split()]), runtime)
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
