"""Whole matrices for Newton-Schulz from the pieces a layout holds (Muon's step, muon.py).

A DTensor update is split over some mesh dimensions. A split of a batch dimension (experts by expert parallelism)
leaves whole matrices on each rank: they are orthogonalised where they are. A split of a matrix dimension (FSDP's
rows, tensor parallelism's columns or rows) needs the rest of the matrix, two ways (`optim.whole_matrices`):

  gather  every rank gathers each matrix it holds a piece of (an all-gather over the dimensions that split it),
          orthogonalises it and keeps its own piece: N ranks each receive (N-1)/N of every matrix and each
          orthogonalise all of them.
  spread  the matrices split the same way over one mesh dimension of N ranks are taken N at a time: one all-to-all
          sends matrix j's pieces to rank j, each rank orthogonalises its one matrix whole, and one all-to-all
          sends the pieces back (DistMuon / Dion). Each rank sends 2 (N-1)/N^2 of the matrices and orthogonalises
          1/N of them: N/2 times less traffic and N times less compute than gather. A matrix split over two mesh
          dimensions (FSDP x tensor parallel) is gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

Finish = Callable[[Tensor], Tensor]


def orthogonalize(updates: list[Tensor], finish: Finish, spread: bool) -> list[Tensor]:
    """`finish` applied to every whole matrix of `updates` (plain tensors or DTensors), each result laid out as
    its update."""
    results: list[Tensor | None] = [None] * len(updates)
    together: dict[tuple, list[DTensor]] = {}
    positions: dict[int, int] = {}
    for i, update in enumerate(updates):
        if not isinstance(update, DTensor):
            results[i] = finish(update)
            continue
        splitting = matrix_splitting_dims(update)
        if not splitting:
            results[i] = _like(finish(update.to_local()), update, update.placements)
        elif spread and len(splitting) == 1 and type(update.placements[splitting[0]]) is Shard:
            together.setdefault((update.device_mesh, update.placements, update.shape), []).append(update)
            positions[id(update)] = i
        else:
            results[i] = _gathered(update, splitting, finish)
    for alike in together.values():
        size = alike[0].device_mesh.size(matrix_splitting_dims(alike[0])[0])
        for start in range(0, len(alike), size):
            batch = alike[start : start + size]
            for update, result in zip(batch, _spread(batch, finish)):
                results[positions[id(update)]] = result
    return cast(list[Tensor], results)


def matrix_splitting_dims(update: DTensor) -> list[int]:
    """The mesh dimensions over which a rank holds less than whole matrices: a split of one of the last two
    dimensions, or a partial sum."""
    matrix_dims = (update.ndim - 2, update.ndim - 1)
    # FSDP's split of a dimension tensor parallelism also splits is a _StridedShard, which is no Shard in torch 2.13.
    return [
        mesh_dim
        for mesh_dim, placement in enumerate(update.placements)
        if placement.is_partial() or (isinstance(placement, (Shard, _StridedShard)) and placement.dim in matrix_dims)
    ]


def _like(local: Tensor, shaped_as: DTensor, placements) -> DTensor:
    return DTensor.from_local(
        local, shaped_as.device_mesh, placements, run_check=False, shape=shaped_as.shape, stride=shaped_as.stride()
    )


def _gathered(update: DTensor, splitting: list[int], finish: Finish) -> DTensor:
    whole_placements = [Replicate() if dim in splitting else kept for dim, kept in enumerate(update.placements)]
    whole = update.redistribute(update.device_mesh, whole_placements)
    # From Replicate back to the update's split: each rank keeps its piece, no communication.
    return _like(finish(whole.to_local()), update, whole_placements).redistribute(update.device_mesh, update.placements)


def _spread(updates: list[DTensor], finish: Finish) -> list[DTensor]:
    """Up to N updates of one shape split over one mesh dimension of N ranks: matrix j whole on rank j for
    `finish`, then split back. DTensor's own route (a stack of them, redistributed from split rows to a split
    stack) falls back to an all-gather on CPU process groups; all_to_all_single is one exchange on both."""
    first = updates[0]
    mesh, (mesh_dim,) = first.device_mesh, matrix_splitting_dims(first)
    split_dim = cast(Shard, first.placements[mesh_dim]).dim
    group, size, rank = mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    # torch.chunk's split, as DTensor's: every rank's length along split_dim (trailing ranks may hold none).
    chunk = -(-first.shape[split_dim] // size)
    lengths = [max(0, min(chunk, first.shape[split_dim] - r * chunk)) for r in range(size)]
    local_shape = first.to_local().shape
    row_shape = [1 if dim == split_dim else length for dim, length in enumerate(local_shape)]
    per_row = int(torch.Size(row_shape).numel())
    mine = rank < len(updates)
    received = torch.empty(sum(lengths) * per_row if mine else 0, dtype=first.dtype, device=first.to_local().device)
    send_sizes = [lengths[rank] * per_row if j < len(updates) else 0 for j in range(size)]
    receive_sizes = [lengths[r] * per_row if mine else 0 for r in range(size)]
    dist.all_to_all_single(
        received,
        torch.cat([update.to_local().reshape(-1) for update in updates]),
        receive_sizes,
        send_sizes,
        group=group,
    )
    if mine:
        pieces = [
            piece.view(*local_shape[:split_dim], length, *local_shape[split_dim + 1 :])
            for piece, length in zip(received.split(receive_sizes), lengths)
        ]
        done = finish(torch.cat(pieces, dim=split_dim))
        outgoing = torch.cat([piece.reshape(-1) for piece in done.split(lengths, dim=split_dim)])
    else:
        outgoing = received
    back = torch.empty(sum(send_sizes), dtype=first.dtype, device=received.device)
    dist.all_to_all_single(back, outgoing, send_sizes, receive_sizes, group=group)
    return [
        _like(piece.view(local_shape), update, update.placements)
        for piece, update in zip(back.split(send_sizes), updates)
    ]
