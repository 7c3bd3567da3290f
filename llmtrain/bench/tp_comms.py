"""Collectives of one tensor-parallel training step, counted by torch's CommDebugMode, per transformer block.

    torchrun --standalone --nproc_per_node=2 -m llmtrain.bench.tp_comms [model=...]   # each setting below

For each setting of sequence parallelism and recomputation (train.activation_checkpointing): the collectives of one
forward + backward on one micro-batch. The embedding, final norm, LM head and the loss add a fixed number that does
not grow with depth; the tool measures a model of 2 and of 4 blocks and reports the difference per block, and what
lies outside the blocks. tests/parallel/test_tensor_parallel.py holds the counts per block to Megatron-LM's design.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch
from torch.distributed.tensor.debug import CommDebugMode

from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.process.runtime import Runtime, init_runtime
from llmtrain.run.build import build_parallel_model
from llmtrain.tools import compose_config

# (sequence parallelism, train.activation_checkpointing): the settings measured
SETTINGS = ((False, "none"), (False, "selective"), (True, "none"), (True, "selective"), (True, "full"))


def _short(op) -> str:
    name = str(op).split(".")[-1]
    return name.replace("_c10d_functional.", "").removesuffix("_")


def count_step(cfg, runtime: Runtime) -> Counter:
    """Collectives of one forward + backward on one micro-batch (the layout's own step)."""
    model = build_parallel_model(cfg, runtime, 257)
    tokens = torch.randint(0, 257, (cfg.train.micro_batch_size, cfg.train.seq_len + 1))
    with CommDebugMode() as comm:
        model.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
    return Counter({_short(op): n for op, n in comm.get_comm_counts().items()})


def measure(argv: list[str], runtime: Runtime, sequence_parallel: bool, recompute: str) -> dict:
    """Collective: the collectives per block (a model of 4 blocks less one of 2, halved) and outside the blocks."""
    counts = {}
    for n_layer in (2, 4):
        cfg = compose_config(
            ["parallel=tp", "train.seq_len=32", "train.micro_batch_size=2", *argv]
            + [f"parallel.sequence_parallel={str(sequence_parallel).lower()}", f"model.n_layer={n_layer}"]
            + [f"train.activation_checkpointing={recompute}"]
        )
        counts[n_layer] = count_step(cfg, runtime)
    per_block = {op: (counts[4][op] - counts[2][op]) / 2 for op in counts[4] | counts[2]}
    return {
        "sequence_parallel": sequence_parallel,
        "recompute": recompute,
        "per_block": per_block,
        "outside_blocks": {op: counts[2][op] - 2 * per_block[op] for op in per_block},
    }


def main(argv: list[str]) -> None:
    runtime = init_runtime("cpu")
    for sequence_parallel, recompute in SETTINGS:
        row = measure(argv, runtime, sequence_parallel, recompute)
        if runtime.is_main:
            print(json.dumps(row))
            print(
                f"tp {runtime.world_size}, sequence_parallel={sequence_parallel}, activation_checkpointing="
                f"{recompute}: collectives per block (forward + backward, one micro-batch)",
                file=sys.stderr,
            )
            for op in sorted(row["per_block"]):
                per_block, outside = row["per_block"][op], row["outside_blocks"][op]
                print(f"  {op:<28} per block {per_block:4.1f}   outside the blocks {outside:4.1f}", file=sys.stderr)
    runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main(sys.argv[1:])
