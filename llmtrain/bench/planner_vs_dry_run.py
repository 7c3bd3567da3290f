"""The planner's per-rank memory and traffic beside the dry run's, over a grid of layouts x families x
recomputation x world sizes (llmtrain/tools/dry_run.py: training's own build and steps on fake tensors).

    python -m llmtrain.bench.planner_vs_dry_run                  # the grid below, a table of measured / planned
    python -m llmtrain.bench.planner_vs_dry_run --quick out.json # the part tests/planner/test_planner.py holds the
    planner to

Each row is one dry run (rank 0 of the world size, and for pipelines also the last rank); the columns are the
planner's error per kind of memory at the step's peak (parameters, gradients, optimizer state, activations and
temporaries, the peak) and per collective's bytes, as planned / measured - 1.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass, replace
from typing import Any

from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.tools.dry_run import dry_run, dry_run_config

KINDS = ("parameters", "gradients", "optimizer state", "activations and temporaries")
# Models whose activations outweigh their states at these shapes: GPT-2's family (learned positions, LayerNorm,
# GELU, multi-head) and Llama's (rotary positions, RMSNorm, SwiGLU, grouped-query attention).
FAMILIES = {
    "gpt2": ["model=tiny", "model.d_model=256", "model.n_head=8"],
    "llama": ["model=llama-tiny", "model.d_model=256", "model.n_head=8", "model.n_kv_head=2", "model.d_ff=768"],
    "mixtral": ["model=mixtral-tiny", "model.d_model=256", "model.n_head=8", "model.n_kv_head=2", "model.d_ff=768"],
}
SHAPE_LAYERS = 4
SHAPE = [f"model.n_layer={SHAPE_LAYERS}", "model.vocab_size=256", "train.seq_len=256", "train.micro_batch_size=2"]
LAYOUTS = {
    "fsdp": ["parallel=fsdp"],
    "zero2": ["parallel=zero2"],
    "hsdp": ["parallel=hsdp", "parallel.dp_shard=2"],
    "fsdp_tp": ["parallel=fsdp_tp", "parallel.tp=2"],
    "fsdp_tp no sp": ["parallel=fsdp_tp", "parallel.tp=2", "parallel.sequence_parallel=false"],
    "pp gpipe": ["parallel=pp", "parallel.pp_schedule=gpipe"],
    "pp_fsdp": ["parallel=pp_fsdp", "parallel.pp=2"],
    "3d": ["parallel=3d", "parallel.pp=2", "parallel.tp=2"],
    "fsdp ep2": ["parallel=fsdp", "parallel.ep=2"],
}


@dataclass(frozen=True)
class Point:
    layout: str
    family: str
    recompute: str
    world_size: int
    rank: int = 0  # a pipeline's first stage holds the most micro-batches in flight, its last the logits

    def overrides(self) -> list[str]:
        batch = 2 * self.world_size  # one micro-batch of 2 rows per data-parallel rank, or more
        return [
            *LAYOUTS[self.layout],
            *FAMILIES[self.family],
            *SHAPE,
            f"train.batch_size={batch}",
            f"train.activation_checkpointing={self.recompute}",
            f"dry_run.world_size={self.world_size}",
        ]


def grid(quick: bool) -> list[Point]:
    if quick:  # GPT-2's family on fsdp; Llama's where tensor parallelism splits it (with and without sp), on hsdp,
        # and pipelined in 3-D at both ends of the pipeline; Mixtral's experts over 2 ranks
        layouts = ("hsdp", "fsdp_tp", "fsdp_tp no sp")
        return [
            Point("fsdp", "gpt2", "selective", 4),
            *(Point(layout, "llama", "selective", 4) for layout in layouts),
            *(Point("3d", "llama", "selective", 8, rank) for rank in (0, 7)),
            Point("fsdp ep2", "mixtral", "none", 4),
        ]
    recomputes, worlds = ("none", "selective", "full"), (4, 64)
    points = [Point(*p) for p in itertools.product(LAYOUTS, FAMILIES, recomputes, worlds) if _runs(Point(*p))]
    return points + [replace(p, rank=p.world_size - 1) for p in points if "pp" in p.layout or p.layout == "3d"]


def _runs(point: Point) -> bool:
    """What the harness accepts: a pipeline stage per rank at least; experts (only Mixtral's family has them)
    spread over ranks only without selective recomputation."""
    if point.layout == "pp gpipe":
        return point.world_size <= SHAPE_LAYERS
    if "ep" in point.layout:
        return point.family == "mixtral" and point.recompute != "selective"
    return True


def compare(point: Point) -> dict[str, Any]:
    result = dry_run(dry_run_config(point.overrides()), point.rank)
    planned = result["planned"]
    errors = {kind: _error(planned[kind], result["kinds"][kind]) for kind in KINDS}
    errors["peak"] = _error(planned["peak"], result["peak"])
    for op, nbytes in result["bytes"].items():
        errors[op] = _error(planned["bytes"].get(op, 0), nbytes)
    return {
        "point": point.__dict__,
        "errors": errors,
        "measured": result["kinds"],
        "measured_bytes": result["bytes"],
        "planned": planned,
    }


def _error(planned: float, measured: float) -> float:
    """planned / measured - 1; 0 when both are under a KiB."""
    if measured < 1024:
        return 0.0 if planned < 1024 else float("inf")
    return planned / measured - 1


def table(rows: list[dict[str, Any]]) -> str:
    columns = [*KINDS, "peak", "all_gather", "reduce_scatter", "all_reduce"]
    short = {"optimizer state": "optimizer", "activations and temporaries": "activations"}
    lines = [
        f"{'layout':14}{'family':8}{'recompute':11}{'ranks':>6}{'rank':>6}"
        + "".join(f"{short.get(c, c):>16}" for c in columns)
    ]
    for row in rows:
        p, e = row["point"], row["errors"]
        cells = "".join(f"{e[c]:+16.1%}" if c in e else f"{'':>16}" for c in columns)
        lines.append(f"{p['layout']:14}{p['family']:8}{p['recompute']:11}{p['world_size']:6d}{p['rank']:6d}{cells}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m llmtrain.bench.planner_vs_dry_run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the small grid the tests run")
    parser.add_argument("output", nargs="?", help="also write every row as JSON here")
    args = parser.parse_args()
    rows = [compare(point) for point in grid(args.quick)]
    print(table(rows))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
