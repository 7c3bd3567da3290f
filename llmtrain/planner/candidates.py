"""The layouts the planner weighs: each a row of llmtrain/catalog/layouts.py's LAYOUTS over the degrees its template
leaves free, checked against the model and batch by the plan training makes (llmtrain/parallel_plan.py: a layout that
cannot run is not a candidate). What a candidate costs comes from the row's fields, never from its name."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

from llmtrain.catalog import (
    LAYOUTS,
    MESH_DIMS,
    OPTIMIZERS,
    RANKS_PER_NODE,
    RECOMPUTE_MODES,
    WITHIN_NODE_DIMS,
    LayoutSpec,
    schedule_spec,
)
from llmtrain.config import ParallelConfig
from llmtrain.errors import ConfigError
from llmtrain.parallel_plan import Degrees, ParallelPlan, micro_batching, resolve_degrees


@dataclass(frozen=True)
class Candidate:
    """One layout: the row `layout` over `degrees`, with the parallel.* keys that shape its memory and traffic."""

    layout: str
    degrees: Degrees
    reshard_after_forward: bool = True
    sequence_parallel: bool = False
    loss_parallel: bool = True
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1
    microbatches: int | None = None
    pp_edge_blocks: int = 0
    # The train.* knobs an expert turns beside the degrees when a layout does not fit; None: as configured.
    micro_batch_size: int | None = None
    recompute: str | None = None

    @property
    def spec(self) -> LayoutSpec:
        return LAYOUTS[self.layout]

    @property
    def name(self) -> str:
        """The layout, and each degree above 1 its row does not set (`fsdp cp2`: fsdp with context parallelism)."""
        d = self.degrees
        extra = [f" {dim}{getattr(d, dim)}" for dim in (*MESH_DIMS, "ep") if getattr(d, dim) > 1
                 and dim not in self.spec.degrees]  # fmt: skip
        return self.layout + "".join(extra)

    @property
    def simplicity(self) -> int:
        """The row's place in LAYOUTS (a tie goes to the earlier one), after every plain row when the candidate
        adds a degree its row does not set."""
        return list(LAYOUTS).index(self.layout) + (len(LAYOUTS) if self.name != self.layout else 0)

    def train_values(self) -> dict[str, Any]:
        """The train.* keys this candidate sets (none when it runs with the configured ones)."""
        values: dict[str, Any] = {}
        if self.micro_batch_size is not None:
            values["micro_batch_size"] = self.micro_batch_size
        if self.recompute is not None:
            values["activation_checkpointing"] = self.recompute
        return values

    @property
    def sharding(self) -> str:
        """How model states split over the data-parallel ranks: none (replicas), optimizer (ZeRO-1), gradients
        (ZeRO-2: FSDP keeping gathered parameters through the step) or parameters (ZeRO-3)."""
        mechanism = self.spec.mechanism.sharding
        if mechanism == "optimizer":
            return "optimizer"
        if mechanism == "nothing" or self.degrees.dp_shard_cp == 1:
            return "none"
        return "parameters" if self.gathers_twice else "gradients"

    @property
    def gathers_twice(self) -> bool:
        """Whether FSDP gathers parameters again for backward: it reshards after forward, outside a pipeline."""
        return not self.spec.pipeline and self.reshard_after_forward

    def micro_batching(self, batch_size: int, micro_batch_size: int) -> tuple[int, int]:
        """(sequences per micro-batch, micro-batches per rank and step), as training splits the batch."""
        pipeline_m = self.microbatches if self.spec.pipeline else None
        return micro_batching(batch_size, micro_batch_size, self.degrees.dp, pipeline_m)

    def parallel_values(self) -> dict[str, Any]:
        """The parallel.* keys that run this layout."""
        d = self.degrees
        return {
            "layout": self.layout,
            "pp": d.pp,
            "dp_replicate": d.dp_replicate,
            "dp_shard": d.dp_shard,
            "cp": d.cp,
            "tp": d.tp,
            "ep": d.ep,
            "reshard_after_forward": self.reshard_after_forward,
            "sequence_parallel": self.sequence_parallel,
            "loss_parallel": self.loss_parallel,
            "pp_schedule": self.pp_schedule,
            "pp_stages_per_rank": self.pp_stages_per_rank,
            "microbatches": self.microbatches,
            "pp_edge_blocks": self.pp_edge_blocks,
        }

    def command_line(self) -> str:
        """The overrides that select this layout on a train.py command line."""
        d, extra = self.degrees, []
        for dim in ("pp", "dp_replicate", "dp_shard", "tp"):
            extra.append(f"parallel.{dim}={getattr(d, dim)}")
        if d.cp > 1:
            extra.append(f"parallel.cp={d.cp}")
        if d.ep > 1:
            extra.append(f"parallel.ep={d.ep}")
        if self.degrees.tp > 1:
            extra.append(f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}")
        if self.spec.mechanism.sharding == "parameters" and not self.spec.pipeline:
            extra.append(f"parallel.reshard_after_forward={str(self.reshard_after_forward).lower()}")
        extra += [f"train.{key}={value}" for key, value in self.train_values().items()]
        return " ".join([f"parallel={self.layout}", *extra])


def describe_layout(parallel_cfg, world_size: int) -> Candidate:
    """The candidate a configured parallel group (not `auto`) runs."""
    degrees = resolve_degrees(parallel_cfg, world_size)
    p = parallel_cfg
    return Candidate(
        layout=p.layout,
        degrees=degrees,
        reshard_after_forward=p.reshard_after_forward,
        sequence_parallel=degrees.tp > 1 and p.sequence_parallel,
        loss_parallel=p.loss_parallel,
        pp_schedule=p.pp_schedule,
        pp_stages_per_rank=p.pp_stages_per_rank,
        microbatches=p.microbatches,
        pp_edge_blocks=p.pp_edge_blocks,
    )


def enumerate_candidates(
    world_size: int, ranks_per_node: int, model_cfg, train_cfg, which: str, pp_schedule: str = "1f1b"
) -> list[Candidate]:
    """The layouts for `world_size` ranks: the data-parallel rows (`which`="dp"), or every row ("all") over each
    split of the ranks among the degrees its template sets, each above 1, with tensor and context parallelism kept
    inside a node; then ("all") the rows' planner extras: context parallelism inside a node and, for a mixture of
    experts, expert parallelism. Layouts the model or batch cannot split into are left out."""
    if world_size == 1:
        return [Candidate("single", Degrees())]
    rows = {
        name: spec
        for name, spec in LAYOUTS.items()
        if which == "all" or (set(spec.degrees) <= {"dp_replicate", "dp_shard"} and not spec.pipeline)
    }
    found = [
        _candidate(name, spec, degrees, pp_schedule)
        for name, spec in rows.items()
        for degrees in _splits(world_size, ranks_per_node, spec.degrees)
    ]
    for name, spec in rows.items() if which == "all" else ():
        for degrees in _splits(world_size, ranks_per_node, spec.degrees):
            if "cp" in spec.planner_extras:
                for cp in _divisors(math.gcd(degrees.dp_shard, ranks_per_node))[1:]:
                    split = Degrees(**{**_mesh_degrees(degrees), "dp_shard": degrees.dp_shard // cp, "cp": cp})
                    found.append(_candidate(name, spec, split, pp_schedule))
            if "ep" in spec.planner_extras and model_cfg.moe.num_experts:
                for ep in _divisors(degrees.dp_shard_cp)[1:]:
                    found.append(_candidate(name, spec, Degrees(**_mesh_degrees(degrees), ep=ep), pp_schedule))
    return [c for c in found if _runs(c, model_cfg, train_cfg)]


def _candidate(name: str, spec: LayoutSpec, degrees: Degrees, pp_schedule: str) -> Candidate:
    pipeline: dict[str, Any] = {}
    if spec.pipeline:
        pipeline = dict(pp_schedule=pp_schedule, pp_stages_per_rank=schedule_spec(pp_schedule).fewest_stages_per_rank)
    return Candidate(
        name,
        degrees,
        reshard_after_forward=spec.settings.get("reshard_after_forward", True),
        sequence_parallel=degrees.tp > 1,
        **pipeline,
    )


def _mesh_degrees(degrees: Degrees) -> dict[str, int]:
    return {dim: getattr(degrees, dim) for dim in MESH_DIMS}


def _splits(world_size: int, ranks_per_node: int, template: dict[str, int | str]) -> list[Degrees]:
    """Every way to give `world_size` ranks to the degrees `template` sets, each above 1, a RANKS_PER_NODE degree
    the ranks of one node and those of WITHIN_NODE_DIMS no more than a node has."""
    pinned = {dim: ranks_per_node for dim, value in template.items() if value == RANKS_PER_NODE}
    free = [dim for dim in template if dim not in pinned]
    rest, remainder = divmod(world_size, math.prod(pinned.values()))
    if remainder or not template or any(degree < 2 for degree in pinned.values()):
        return []
    splits = []
    for values in itertools.product(_divisors(rest)[1:], repeat=len(free)):
        degrees = {**pinned, **dict(zip(free, values))}
        if math.prod(values) == rest and all(degrees.get(dim, 1) <= ranks_per_node for dim in WITHIN_NODE_DIMS):
            splits.append(Degrees(**degrees))
    return splits


def with_knobs(candidates: list[Candidate], micro_batch_size: int, recompute: str) -> list[Candidate]:
    """Each candidate as configured, then with smaller micro-batches (the configured size's divisors, so the batch
    still splits) and more activation recomputation: what an expert turns when a layout does not fit. The
    configured knobs come first, so that they win a tie."""
    micro_sizes = [m for m in range(micro_batch_size, 0, -1) if micro_batch_size % m == 0]
    found = []
    for candidate in candidates:
        for mode in RECOMPUTE_MODES[RECOMPUTE_MODES.index(recompute) :]:
            for micro in micro_sizes:
                found.append(
                    replace(
                        candidate,
                        micro_batch_size=micro if micro != micro_batch_size else None,
                        recompute=mode if mode != recompute else None,
                    )
                )
    return found


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _runs(c: Candidate, model_cfg, train_cfg) -> bool:
    """Whether training could run this layout: the plan training would make of it (llmtrain/parallel_plan.py) checks
    out."""
    try:
        ParallelPlan.of(ParallelConfig(**c.parallel_values()), train_cfg, model_cfg, math.prod(c.degrees.as_tuple()))
    except ConfigError:
        return False
    return True


def runnable(candidates: list[Candidate], cfg, samples: bool) -> list[Candidate]:
    """The candidates this run can take: its optimizer's (for_optimizer), a sampling step's (for_sampling), NF4
    experts' (for_nf4_experts)."""
    return for_nf4_experts(for_sampling(for_optimizer(candidates, cfg.optim), samples), cfg.model)


def for_nf4_experts(candidates: list[Candidate], model_cfg) -> list[Candidate]:
    """Where NF4 holds the routed experts (model.quantize_base=nf4 beside adapters), the candidates that do not
    shard them by both expert parallelism and FSDP: torchao's NF4 gathers under FSDP alone (parallel/fsdp.py)."""
    if not (model_cfg.moe.num_experts and model_cfg.quantize_base == "nf4" and model_cfg.lora.rank):
        return candidates
    return [c for c in candidates if c.degrees.ep == 1 or c.degrees.dp_shard_cp // c.degrees.ep == 1]


def for_sampling(candidates: list[Candidate], samples: bool) -> list[Candidate]:
    """Where a step samples completions (train.objective=grpo), the candidates that can: no pipeline, no context
    parallelism, tensor parallelism without sequence parallelism (parallel/sampling.py says why)."""
    if not samples:
        return candidates
    kept = [c for c in candidates if c.degrees.pp == 1 and c.degrees.cp == 1]
    return list(dict.fromkeys(replace(c, sequence_parallel=False) for c in kept))


def for_optimizer(candidates: list[Candidate], optim_cfg) -> list[Candidate]:
    """The candidates that can run `optim`: flat fp32 slices (ZeRO-1's) hold neither 8-bit moments nor host-side
    state, so they are left out under optim.state_bits=8 and optim.offload, and for an optimizer without a form
    over them."""
    if optim_cfg.offload or optim_cfg.state_bits != 32 or OPTIMIZERS[optim_cfg.name].zero1 is None:
        return [c for c in candidates if not c.spec.mechanism.flat_optimizer]
    return candidates
