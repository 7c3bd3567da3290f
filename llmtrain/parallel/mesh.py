"""Parallel degrees -> one DeviceMesh with named dimensions.

The dimensions run outer to inner as pp, dp_replicate, dp_shard, cp, tp (torchtitan's order): consecutive ranks
share the innermost dimension, so the chattiest traffic (tensor parallel, then the context-parallel ring and sharded
data parallel) stays on the fastest links (the GPUs of one node), and the sparsest (pipeline sends, replica
all-reduces) crosses nodes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llmtrain.catalog import MESH_DIMS
from llmtrain.plan import Degrees


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
