"""Peak activation memory per rank of one forward + backward, measured with torch's MemTracker (CPU or GPU).

    torchrun --standalone --nproc_per_node=2 -m llmtrain.bench.activation_memory parallel=tp \
        parallel.sequence_parallel=true train.activation_checkpointing=selective

MemTracker follows every tensor allocation and files it under parameters, gradients, activations, temporaries
or optimizer state; the tool prints rank 0's peak of each (MiB) for one micro-batch of the configured shape, so
sequence parallelism (activations between the TP pairs shrink t times) and activation checkpointing
(activations recomputed instead of kept) can be compared on one machine.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.process.runtime import init_runtime
from llmtrain.run.build import build_parallel_model
from llmtrain.tools import compose_config


def main(argv: list[str]) -> None:
    cfg = compose_config(argv)
    runtime = init_runtime(cfg.train.device)
    # 256 tokens: a vocabulary needing no padding, whose frozen mask parameter MemTracker cannot hook.
    vocab_size = cfg.model.vocab_size or 256
    model = build_parallel_model(cfg, runtime, vocab_size)
    tokens = torch.randint(
        0,
        vocab_size,
        (cfg.train.micro_batch_size, cfg.train.seq_len + 1),
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    tracker = MemTracker()
    with tracker:
        model.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    mib = {str(kind).split(".")[-1].lower(): round(value / 2**20, 3) for kind, value in peak.items()}
    if runtime.is_main:
        print(
            json.dumps(
                {
                    "layout": model.plan.describe(),
                    "ac": cfg.train.activation_checkpointing,
                    "micro_batch": cfg.train.micro_batch_size,
                    "seq_len": cfg.train.seq_len,
                    **mib,
                }
            )
        )
    runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main(sys.argv[1:])
