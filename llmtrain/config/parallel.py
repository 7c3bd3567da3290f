"""The `parallel` group's keys (conf/parallel/): the layout, the degrees of its device mesh and each mechanism's
settings. The layouts and schedules themselves are named in llmtrain/catalog/layouts.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from llmtrain import catalog
from llmtrain.domains import Flag, MeshDegree, OneOf, at_least, key

# What parallel.layout accepts: the catalog's layouts, and `auto` (the planner picks one of them).
LAYOUT_CHOICES = (*catalog.LAYOUTS, catalog.AUTO)
PIPELINE_SCHEDULES = tuple(catalog.SCHEDULES)


def _degree(what: str) -> str:
    """A mesh degree's doc: what it splits, then the rule all five share."""
    return (
        f"{what}. A mesh degree (outer to inner: pp, dp_replicate, dp_shard, cp, tp): their product is the world "
        f"size, -1 on one of them = the remaining ranks; each layout sets its own"
    )


@dataclass
class ParallelConfig:
    layout: str = key(
        "single",
        OneOf(LAYOUT_CHOICES),
        f"the layout `parallel=<layout>` picked (a row of `llmtrain/catalog/layouts.py`'s LAYOUTS, [parallelism.md]"
        f"(parallelism.md)), or `{catalog.AUTO}` (the planner chooses one for the world it runs in, "
        f"[planner.md](planner.md))",
    )
    # Degrees of the mesh (outer to inner); -1 on one of them means "the remaining ranks"; 0 is refused.
    pp: int = key(1, MeshDegree(), _degree("pipeline parallelism: the blocks cut into stages, one per rank group"))
    dp_replicate: int = key(
        1,
        MeshDegree(),
        _degree(
            "data-parallel replicas, each holding the whole (or its dp_shard group's) state: DDP's and ZeRO-1's "
            "ranks, HSDP's replica groups across nodes"
        ),
    )
    dp_shard: int = key(
        1,
        MeshDegree(),
        _degree("data-parallel ranks that shard parameters, gradients and optimizer state (FSDP, ZeRO-2)"),
    )
    cp: int = key(
        1,
        MeshDegree(),
        _degree(
            "context parallelism: every sequence split over this many ranks, attention around a ring "
            "([moe-cp.md](moe-cp.md)); the FSDP layouts (`fsdp`, `zero2`, `hsdp`, `fsdp_tp`, `ddp_tp`) and the "
            "pipeline ones take it"
        ),
    )
    tp: int = key(
        1,
        MeshDegree(),
        _degree("tensor parallelism: each block's matrices split over this many ranks (+ sequence parallelism)"),
    )
    ep: int = key(
        1,
        at_least(1),
        "expert parallelism for mixture-of-experts models: each mixture's experts split over `ep` of the dp_shard × "
        "cp ranks (not a sixth degree: it regroups FSDP's ranks); must divide dp_shard × cp and "
        "`model.moe.num_experts`; the FSDP and pipeline layouts take it ([moe-cp.md](moe-cp.md))",
    )
    nproc: int = key(
        1,
        at_least(1),
        "workers `train.py` starts itself when not launched by torchrun or srun (ignored under them)",
    )
    max_restarts: int = key(
        0,
        at_least(0),
        "times `train.py` starts its workers again (all of them, resuming from the last complete checkpoint into the "
        "same run directory) after one crashed, was killed, hung or lost a peer; a stop signal, bad input or a "
        "diverged run ends the job at once. With `parallel.nproc=1` too: one worker. Under torchrun: "
        "`--max-restarts` ([slurm.md](slurm.md))",
    )
    reshard_after_forward: bool = key(
        True,
        Flag(),
        "FSDP: free gathered parameters after each block's forward (ZeRO-3) or keep them for backward (ZeRO-2, what "
        "`zero2` sets)",
    )
    cpu_offload: bool = key(
        False,
        Flag(),
        "FSDP: keep sharded parameters, gradients and optimizer state in host memory",
    )
    reduce_once_per_step: Optional[bool] = key(
        None,
        Flag(),
        "FSDP with several micro-batches per step: accumulate each micro-batch's gradients unsharded (in fp32) and "
        "reduce-scatter once per step, a 1/micro-batches share of the gradient traffic for a full fp32 gradient of "
        "memory per rank (for slow links: PCIe without peer-to-peer); false: reduce-scatter every micro-batch; null: "
        "true where FSDP splits over one shard (one GPU, or HSDP replicas of one), whose gradient is whole anyway, "
        "false otherwise. DDP, ZeRO-1 and pipelines already reduce once",
    )
    sequence_parallel: bool = key(
        False,
        Flag(),
        "tensor parallel: keep LayerNorm, residual and dropout activations sharded along the sequence "
        "(`train.seq_len` divisible by tp); `fsdp_tp`, `ddp_tp`, `pp_tp` and `3d` set true",
    )
    loss_parallel: bool = key(
        True,
        Flag(),
        "tensor parallel: cross-entropy on vocabulary shards; no rank holds full-vocabulary logits",
    )
    pp_schedule: str = key(
        "1f1b",
        OneOf(PIPELINE_SCHEDULES),
        "pipeline: `gpipe`, `1f1b`, `1f1b_reference` (written here), `interleaved_1f1b`, `zero_bubble`, `zbv`, "
        "`dualpipev`",
    )
    pp_stages_per_rank: int = key(
        1,
        at_least(1),
        "pipeline: virtual stages per rank; ≥ 2 for `interleaved_1f1b` / `zero_bubble`, exactly 2 for `zbv` / "
        "`dualpipev` (`model.n_layer` must split into pp × this many stages)",
    )
    microbatches: Optional[int] = key(
        None,
        at_least(1),
        "pipeline: micro-batches m per step; null = batch_size / (data-parallel × micro_batch_size). 1F1B-family "
        "schedules need m ≥ pp, V schedules m ≥ 2·pp, interleaved ones m a multiple of pp",
    )
    pp_edge_blocks: int = key(
        0,
        at_least(0),
        "pipeline: the first and last stage each get this many fewer blocks (the embedding and the head cost about a "
        "block each)",
    )
