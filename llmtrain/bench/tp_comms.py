"""Collectives of one tensor-parallel training step, counted by torch's CommDebugMode, against the design.

    torchrun --standalone --nproc_per_node=2 -m llmtrain.bench.tp_comms [model=...]   # each setting below

Megatron's pairing costs, per transformer block and micro-batch:
- without sequence parallelism: 2 all-reduces in forward (after attention's and the MLP's row-parallel matmul,
  `g`) and 2 in backward (before their column-parallel matmuls, `f`);
- with sequence parallelism: each all-reduce becomes a reduce-scatter leaving the pair and an all-gather entering
  it, so 2 all-gathers + 2 reduce-scatters in forward and the same in backward;
- recomputed in full (train.activation_checkpointing=full), backward replays the block's forward up to the last
  tensor it needs (torch's checkpoint stops there, before the MLP's closing reduction): 2 all-gathers and 1
  reduce-scatter more (1 all-reduce without sequence parallelism);
- recomputed selectively, the policy keeps the all-reduces' and reduce-scatters' outputs
  (llmtrain/model/recompute.py): backward replays only the 2 all-gathers, whose outputs the column-parallel
  matmuls' weight gradients need (over PCIe a reduction done twice is the step's most expensive waste; without
  the all-reduce in the policy, a selective block replayed 1 all-reduce: 5 per block).
The embedding, final norm, LM head and the loss add a fixed number that does not grow with depth; the tool
measures a model of L and of 2L blocks and reports the difference per block, which must equal the design.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch
from torch.distributed.tensor.debug import CommDebugMode

from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.job import build_layout
from llmtrain.runtime import Runtime, init_runtime
from llmtrain.tools import compose_config

# (sequence parallelism, train.activation_checkpointing): the settings measured
SETTINGS = ((False, "none"), (False, "selective"), (True, "none"), (True, "selective"), (True, "full"))


def expected_per_block(sequence_parallel: bool, recompute: str) -> dict[str, int]:
    if not sequence_parallel:
        return {"all_reduce": 5 if recompute == "full" else 4}
    replayed = {"none": (0, 0), "selective": (2, 0), "full": (2, 1)}[recompute]
    return {"all_gather_into_tensor": 4 + replayed[0], "reduce_scatter_tensor": 4 + replayed[1]}


def _short(op) -> str:
    name = str(op).split(".")[-1]
    return name.replace("_c10d_functional.", "").removesuffix("_")


def count_step(cfg, runtime: Runtime) -> Counter:
    """Collectives of one forward + backward on one micro-batch (the layout's own step)."""
    model = build_layout(cfg, runtime, 257)
    tokens = torch.randint(0, 257, (cfg.train.micro_batch_size, cfg.train.seq_len + 1))
    with CommDebugMode() as comm:
        model.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
    return Counter({_short(op): n for op, n in comm.get_comm_counts().items()})


def measure(argv: list[str], runtime: Runtime, sequence_parallel: bool, recompute: str) -> dict:
    """Collective: the collectives per block with and without the blocks outside, against the design."""
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
        "expected_per_block": expected_per_block(sequence_parallel, recompute),
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
                expected = row["expected_per_block"].get(op, 0)
                print(f"  {op:<28} measured {row['per_block'][op]:4.1f}   expected {expected}", file=sys.stderr)
    runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main(sys.argv[1:])
