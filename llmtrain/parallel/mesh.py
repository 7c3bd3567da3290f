"""Parallel degrees -> one DeviceMesh with named dimensions.

The dimensions run outer to inner as pp, dp_replicate, dp_shard, cp, tp (torchtitan's order): consecutive ranks
share the innermost dimension, so the chattiest traffic (tensor parallel, then the context-parallel ring and sharded
data parallel) stays on the fastest links (the GPUs of one node), and the sparsest (pipeline sends, replica
all-reduces) crosses nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llmtrain.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Degrees:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # borrowed from dp_shard x cp, not a mesh dimension of its own (expert_mesh)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """The ranks FSDP shards over: data-parallel shards and context-parallel ranks hold the same weights."""
        return self.dp_shard * self.cp

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(getattr(self, dim) for dim in MESH_DIMS)

    @property
    def expert_shard(self) -> int:
        """The ranks each expert's weights are sharded over (FSDP): those of dp_shard x cp that ep leaves."""
        return self.dp_shard_cp // self.ep

    def describe(self) -> str:
        split = " x ".join(f"{dim} {getattr(self, dim)}" for dim in MESH_DIMS if getattr(self, dim) > 1) or "1 rank"
        return split + (f", experts over ep {self.ep}" if self.ep > 1 else "")


def _listing(values: dict[str, int]) -> str:
    return ", ".join(f"parallel.{dim}={value}" for dim, value in values.items())


def resolve_degrees(parallel_cfg, world_size: int) -> Degrees:
    """The five degrees with a -1 (at most one) replaced by the ranks that remain; their product must be the
    world size."""
    values = {dim: int(getattr(parallel_cfg, dim)) for dim in MESH_DIMS}
    free = [dim for dim, value in values.items() if value == -1]
    if len(free) > 1:
        raise ConfigError(
            f"-1 ('the remaining ranks') is set on {' and '.join('parallel.' + d for d in free)}: "
            f"set it on at most one degree ({_listing(values)})"
        )
    if any(value == 0 or value < -1 for value in values.values()):
        raise ConfigError(f"parallel degrees must be positive or -1 ({_listing(values)})")
    fixed = math.prod(value for value in values.values() if value != -1)
    if free:
        if world_size % fixed:
            raise ConfigError(
                f"the world size {world_size} is not divisible by the fixed degrees' product {fixed} "
                f"({_listing(values)}): change them so their product divides {world_size}"
            )
        values[free[0]] = world_size // fixed
    elif fixed != world_size:
        raise ConfigError(
            f"parallel degrees multiply to {fixed} but the world size is {world_size} "
            f"({_listing(values)}): make their product {world_size}, or use -1 on one of them"
        )
    ep = int(getattr(parallel_cfg, "ep", 1))
    if ep < 1:
        raise ConfigError(f"parallel.ep={ep}: set it to a positive number of ranks (1: experts are not split)")
    shard_cp = values["dp_shard"] * values["cp"]
    if shard_cp % ep:
        raise ConfigError(
            f"parallel.ep={ep} does not divide dp_shard x cp = {shard_cp}: expert parallelism takes its ranks from "
            f"the sharded data-parallel ones; set parallel.ep to a divisor of {shard_cp}"
        )
    return Degrees(**values, ep=ep)


def build_mesh(degrees: Degrees, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, degrees.as_tuple(), mesh_dim_names=MESH_DIMS)


EXPERT_MESH_DIMS = ("pp", "dp_replicate", "expert_shard", "ep", "tp")


def build_expert_mesh(degrees: Degrees, device_type: str) -> DeviceMesh:
    """The mesh of the experts' weights: the same ranks as `build_mesh`'s, with dp_shard x cp regrouped as
    expert_shard x ep (ep innermost, so an expert all-to-all stays among neighbouring ranks). Row-major order makes
    the flat index of (dp_shard, cp) equal that of (expert_shard, ep): both meshes cover the same data-parallel
    ranks, only grouped differently."""
    shape = (degrees.pp, degrees.dp_replicate, degrees.expert_shard, degrees.ep, degrees.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_DIMS)


def mean_over(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """The mean of a per-rank scalar over the ranks of a 1-D `mesh` (each holding an equal share: of the batch over
    data-parallel ranks, of each sequence over context-parallel ones); the value itself without one. Gloo has no
    AVG reduction, hence SUM then divide."""
    if mesh is None or mesh.size() == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return value / mesh.size()
