"""How big a checkpoint is and how long a save stops training, sync against async, on this machine.

    python -m llmtrain.bench.checkpoint_benchmark model=gpt2 [--dir /fast/disk]

One process builds the model and a stepped AdamW (so the optimizer state exists), then saves the same state with
the run's CheckpointManager twice: synchronously, and in the background as checkpoint.async_save=true does (DCP
async_save). It prints the size on disk, the time training is blocked (the call), and for async the time until the
checkpoint is complete.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from llmtrain.checkpoint.manager import CheckpointManager, checkpoint_path
from llmtrain.checkpoint.state import checkpoint_state
from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.model import cross_entropy_loss
from llmtrain.process.runtime import init_runtime
from llmtrain.run.build import build_parallel_model
from llmtrain.tools import compose_config


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=gpt2")
    args = parser.parse_args()
    cfg = compose_config(["train.device=cpu", *args.overrides])
    runtime = init_runtime("cpu")
    vocab_size = cfg.model.vocab_size or 50257
    model = build_parallel_model(cfg, runtime, vocab_size)
    tokens = torch.randint(0, vocab_size, (1, 65))
    cross_entropy_loss(model.module(tokens[:, :-1]), tokens[:, 1:]).backward()
    model.optimizer.step()
    state = checkpoint_state(model).values
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        print(f"{cfg.model.name}: {sum(p.numel() for p in model.module.parameters()):,} parameters + AdamW state")
        for step, use_async in ((1, False), (2, True)):
            manager = CheckpointManager(directory, keep=2, use_async=use_async, runtime=runtime)
            started = time.perf_counter()
            manager.save(step, state, meta={"step": step}, data_position={})
            blocked = time.perf_counter() - started
            manager.wait()
            done = time.perf_counter() - started
            size = _size(checkpoint_path(directory, step))
            print(
                f"{'async' if use_async else 'sync':<6} {size / 2**20:9.1f} MiB   training blocked {blocked:6.2f} s"
                f"   complete after {done:6.2f} s"
            )


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
