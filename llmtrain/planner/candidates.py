"""The layouts the planner weighs: each a registered strategy with its mesh degrees, named as conf/parallel/ names
them, checked against the model and batch by the plan training makes (llmtrain/plan.py: a layout that cannot run is
not a candidate)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from llmtrain.catalog import RECOMPUTE_MODES, schedule_spec
from llmtrain.config import ParallelConfig
from llmtrain.errors import ConfigError
from llmtrain.plan import Degrees, ParallelPlan, micro_batching, resolve_degrees


@dataclass(frozen=True)
class Candidate:
    """One layout: `strategy` over `degrees`, with the parallel.* keys that shape its memory and traffic."""

    name: str
    strategy: str
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
        if self.degrees.dp_shard_cp == 1 and self.strategy != "zero1":
            return "none"
        if self.strategy == "zero1":
            return "optimizer"
        if self.strategy == "pp" or not self.reshard_after_forward:
            return "gradients"
        return "parameters"

    def micro_batching(self, batch_size: int, micro_batch_size: int) -> tuple[int, int]:
        """(sequences per micro-batch, micro-batches per rank and step), as training splits the batch."""
        pipeline_m = self.microbatches if self.degrees.pp > 1 else None
        return micro_batching(batch_size, micro_batch_size, self.degrees.dp, pipeline_m)

    def parallel_values(self) -> dict[str, Any]:
        """The parallel.* keys that run this layout."""
        d = self.degrees
        return {
            "strategy": self.strategy,
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
        base = f"parallel={self.name}" if self.name in _PLAIN else f"parallel={self.strategy}"
        d, extra = self.degrees, []
        for dim in ("pp", "dp_replicate", "dp_shard", "tp"):
            extra.append(f"parallel.{dim}={getattr(d, dim)}")
        if d.cp > 1:
            extra.append(f"parallel.cp={d.cp}")
        if d.ep > 1:
            extra.append(f"parallel.ep={d.ep}")
        if self.degrees.tp > 1:
            extra.append(f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}")
        if self.strategy == "fsdp":
            extra.append(f"parallel.reshard_after_forward={str(self.reshard_after_forward).lower()}")
        extra += [f"train.{key}={value}" for key, value in self.train_values().items()]
        return " ".join([base, *extra])


_PLAIN = ("single", "ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "pp")


def describe_layout(parallel_cfg, world_size: int) -> Candidate:
    """The candidate a configured parallel group (not `auto`) runs."""
    degrees = resolve_degrees(parallel_cfg, world_size)
    p = parallel_cfg
    candidate = Candidate(
        name=p.strategy,
        strategy=p.strategy,
        degrees=degrees,
        reshard_after_forward=p.reshard_after_forward,
        sequence_parallel=degrees.tp > 1 and p.sequence_parallel,
        loss_parallel=p.loss_parallel,
        pp_schedule=p.pp_schedule,
        pp_stages_per_rank=p.pp_stages_per_rank,
        microbatches=p.microbatches,
        pp_edge_blocks=p.pp_edge_blocks,
    )
    return replace(candidate, name=_layout_name(candidate))


def _layout_name(c: Candidate) -> str:
    d = c.degrees
    if c.strategy == "pp":
        inner = [name for name, on in (("fsdp", d.dp > 1), ("tp", d.tp > 1)) if on]
        return "3d" if len(inner) == 2 else "_".join(["pp", *inner])
    if c.strategy != "fsdp":
        return c.strategy
    context = (f" cp{d.cp}" if d.cp > 1 else "") + (f" ep{d.ep}" if d.ep > 1 else "")
    if d.tp > 1:
        return ("fsdp_tp" if d.dp_shard_cp > 1 else "ddp_tp") + context
    if d.dp_replicate > 1:
        return ("hsdp" if d.dp_shard_cp > 1 else "ddp") + context
    return ("fsdp" if c.reshard_after_forward else "zero2") + context


def enumerate_candidates(
    world_size: int, ranks_per_node: int, model_cfg, train_cfg, which: str, pp_schedule: str = "1f1b"
) -> list[Candidate]:
    """The layouts for `world_size` ranks: the data-parallel ones (`which`="dp"), or also tensor, pipeline, 3-D,
    context-parallel (fsdp with cp) and, for a mixture of experts, expert-parallel (fsdp with ep) ones ("all"), with
    tensor and context parallelism kept inside a node.
    Layouts the model or batch cannot split into are left out."""
    w = world_size
    if w == 1:
        return [Candidate("single", "single", Degrees())]
    found = [
        Candidate("ddp", "ddp", Degrees(dp_replicate=w)),
        Candidate("zero1", "zero1", Degrees(dp_replicate=w)),
        Candidate("zero2", "fsdp", Degrees(dp_shard=w), reshard_after_forward=False),
        Candidate("fsdp", "fsdp", Degrees(dp_shard=w)),
    ]
    if w > ranks_per_node and w % ranks_per_node == 0:
        found.append(Candidate("hsdp", "fsdp", Degrees(dp_replicate=w // ranks_per_node, dp_shard=ranks_per_node)))
    if which == "all":
        stages_per_rank = 1 if schedule_spec(pp_schedule).stages_per_rank == "one" else 2
        for tp in _divisors(w):
            for pp in _divisors(w // tp):
                dp = w // (tp * pp)
                if (tp == 1 and pp == 1) or tp > ranks_per_node:
                    continue
                degrees = Degrees(pp=pp, dp_shard=dp, tp=tp)
                pipeline = dict(pp_schedule=pp_schedule, pp_stages_per_rank=stages_per_rank) if pp > 1 else {}
                candidate = Candidate(
                    "", "pp" if pp > 1 else ("tp" if dp == 1 else "fsdp"), degrees, sequence_parallel=tp > 1,
                    **pipeline,  # type: ignore[arg-type]
                )  # fmt: skip
                found.append(replace(candidate, name=_layout_name(candidate)))
        for cp in _divisors(min(w, ranks_per_node))[1:]:  # context parallel inside a node, FSDP over the rest
            candidate = Candidate("", "fsdp", Degrees(dp_shard=w // cp, cp=cp))
            found.append(replace(candidate, name=_layout_name(candidate)))
        for ep in _divisors(w)[1:] if model_cfg.moe.num_experts else []:  # experts over ep of FSDP's ranks
            candidate = Candidate("", "fsdp", Degrees(dp_shard=w, ep=ep))
            found.append(replace(candidate, name=_layout_name(candidate)))
    return [c for c in found if _runs(c, model_cfg, train_cfg)]


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
    """Whether training could run this layout: the plan training would make of it (llmtrain/plan.py) checks out."""
    try:
        ParallelPlan.of(ParallelConfig(**c.parallel_values()), train_cfg, model_cfg, math.prod(c.degrees.as_tuple()))
    except ConfigError:
        return False
    return True


def for_optimizer(candidates: list[Candidate], optim_cfg) -> list[Candidate]:
    """The candidates that can run `optim`: ZeRO-1's flat fp32 slices hold neither 8-bit moments nor host-side
    state, so it is left out under optim.state_bits=8 and optim.offload."""
    if optim_cfg.offload or optim_cfg.state_bits != 32:
        return [c for c in candidates if c.strategy != "zero1"]
    return candidates
