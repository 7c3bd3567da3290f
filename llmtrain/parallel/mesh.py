"""Parallel degrees -> one DeviceMesh with named dimensions.

The dimensions run outer to inner as pp, dp_replicate, dp_shard, cp, tp (torchtitan's order): consecutive ranks
share the innermost dimension, so the chattiest traffic (tensor parallel, then the context-parallel ring and sharded
data parallel) stays on the fastest links (the GPUs of one node), and the sparsest (pipeline sends, replica
all-reduces) crosses nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llmtrain.catalog import MESH_DIMS
from llmtrain.parallel_plan import Degrees, ParallelPlan
from llmtrain.process.runtime import Runtime, join_single_process_group


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


def sum_over(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """The sum of a per-rank tensor over the ranks of a 1-D `mesh` (parts of each sequence over context-parallel
    ranks); the value itself without one."""
    if mesh is None or mesh.size() == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return value


def mean_over(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """The mean of a per-rank scalar over the ranks of a 1-D `mesh` (each holding an equal share: of the batch over
    data-parallel ranks, of each sequence over context-parallel ones); the value itself without one. Gloo has no
    AVG reduction, hence SUM then divide."""
    if mesh is None or mesh.size() == 1:
        return value
    return sum_over(value, mesh) / mesh.size()


@dataclass(frozen=True)
class RankMesh:
    """Where this rank sits in a plan's layout: the mesh (None for one process without a parallel dimension), its
    flattened data-parallel dimension (replicas and shards: the ranks a loss is averaged over), its context- and
    tensor-parallel dimensions when split (sliced once: slicing a mesh builds a new one, reading its ranks on the
    host, which the step must not do) and, with expert parallelism, the experts' mesh."""

    degrees: Degrees
    _mesh: DeviceMesh | None  # read through device_mesh, which refuses the None
    dp_mesh: DeviceMesh | None
    expert_mesh: DeviceMesh | None
    cp_mesh: DeviceMesh | None = None
    tp_mesh: DeviceMesh | None = None

    @classmethod
    def of(cls, plan: ParallelPlan, runtime: Runtime) -> RankMesh:
        """The mesh of a checked plan on this rank (a collective: every rank builds it)."""
        degrees = plan.degrees
        if runtime.world_size == 1 and plan.dims:
            join_single_process_group(runtime)  # every degree is 1: the layout runs as one rank of many would
        if runtime.world_size == 1 and not plan.dims:
            return cls(degrees, None, None, None)
        mesh = build_mesh(degrees, runtime.device.type)
        expert = build_expert_mesh(degrees, runtime.device.type) if degrees.ep > 1 else None
        return cls(
            degrees,
            mesh,
            mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            expert,
            cp_mesh=mesh["cp"] if degrees.cp > 1 else None,
            tp_mesh=mesh["tp"] if degrees.tp > 1 else None,
        )

    @property
    def splits(self) -> bool:
        """Whether the layout has a mesh: a single process without parallel dimensions has none."""
        return self._mesh is not None

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh of a multi-process layout (a single process has none)."""
        if self._mesh is None:
            raise RuntimeError("a single process without parallel dimensions has no mesh")
        return self._mesh

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The data-parallel ranks' process group (replicas and shards together)."""
        if self.dp_mesh is None:
            raise RuntimeError("a single process without parallel dimensions has no data-parallel group")
        return self.dp_mesh.get_group()
