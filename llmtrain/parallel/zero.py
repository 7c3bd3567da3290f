"""The optimizer of `parallel=zero1`: ZeRO stage 1, written here from two collectives (Rajbhandari et al., 2020).

Each rank keeps all parameters (Ψ) and accumulates full local gradients (Ψ), but AdamW state only for its own
1/N slice of the parameters (2Ψ/N). At the end of a step:
  1. reduce-scatter the flat gradient: rank r receives the sum over ranks of slice r only   (Ψ on the wire)
  2. AdamW updates slice r                                                                   (no communication)
  3. all-gather the updated slices back into every rank's full parameters                    (Ψ on the wire)
The same 2Ψ as DDP's all-reduce, which is itself a reduce-scatter followed by an all-gather: ZeRO-1 just does the
optimizer step in between, on the slice each rank already owns.

Parameters and gradients live in one flat buffer per weight-decay group (padded to a multiple of N), with every
model parameter and its gradient a view into it, so the collectives need no packing copies.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from llmtrain.optim import Compute, Muon, adamw_options, param_groups
from llmtrain.optim.groups import FUSED, adamw_state
from llmtrain.process.runtime import all_gather_single, reduce_scatter_single

# torch 2.13 renamed the flat-tensor collectives; the older names still work on older releases.


@dataclass
class FlatBucket:
    params: list[nn.Parameter]
    flat_params: torch.Tensor  # all of the group's parameters, padded to a multiple of the world size
    flat_grads: torch.Tensor
    shard: nn.Parameter  # this rank's slice of flat_params: what the inner AdamW updates
    shard_range: slice  # where that slice lies in the flat buffers


def _flatten(params: list[nn.Parameter], world: int, rank: int) -> FlatBucket:
    numel = sum(p.numel() for p in params)
    shard_numel = math.ceil(numel / world)
    reference = params[0]
    flat_params = torch.zeros(shard_numel * world, dtype=reference.dtype, device=reference.device)
    flat_grads = torch.zeros_like(flat_params)
    offset = 0
    for param in params:
        n = param.numel()
        flat_params[offset : offset + n].copy_(param.detach().flatten())
        # The parameter and its gradient become views of the flat buffers: autograd accumulates into them in
        # place, and the all-gather below writes the updated weights straight into the model.
        param.data = flat_params[offset : offset + n].view_as(param)
        param.grad = flat_grads[offset : offset + n].view_as(param)
        offset += n
    mine = slice(rank * shard_numel, (rank + 1) * shard_numel)
    shard = nn.Parameter(flat_params[mine])
    shard.grad = flat_grads[mine]
    return FlatBucket(params, flat_params, flat_grads, shard, mine)


class ZeroOneShards:
    """The ZeRO-1 half of ZeroOneAdamW and ZeroOneMuon, an optimizer's form over flat slices (its row's `zero1` in
    llmtrain/catalog/optimizers.py's OPTIMIZERS): the optimizer they extend (torch's AdamW, Muon) updates this rank's
    slices only; `reduce_scatter_gradients` before `step`, which all-gathers after."""

    param_groups: list[dict]
    state: Any

    def _shard_groups(self, model: nn.Module, optim_cfg, mesh: DeviceMesh) -> list[dict]:
        """The optimizer's groups: one slice per group of the model's parameters (llmtrain/optim/groups.py)."""
        self.mesh = mesh  # the data-parallel ranks, one dimension
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.rank = mesh.get_local_rank()
        self.buckets: list[FlatBucket] = []
        shard_groups = []
        for param_group in param_groups(model, optim_cfg):
            bucket = _flatten(param_group["params"], self.world, self.rank)
            # Every rank starts from rank 0's weights, as DDP guarantees by its initial broadcast.
            dist.broadcast(bucket.flat_params, src=dist.get_global_rank(self.group, 0), group=self.group)
            self.buckets.append(bucket)
            shard_groups.append({**param_group, "params": [bucket.shard]})
        return shard_groups

    @torch.no_grad()
    def reduce_scatter_gradients(self) -> None:
        """Slice r of every bucket's gradient becomes the mean over ranks; the other slices are left stale."""
        for bucket in self.buckets:
            reduced = torch.empty_like(bucket.shard)
            reduce_scatter_single(reduced, bucket.flat_grads, op=dist.ReduceOp.SUM, group=self.group)
            bucket.flat_grads[bucket.shard_range].copy_(reduced.div_(self.world))

    def shards(self) -> list[nn.Parameter]:
        """This rank's slices, whose gradients are the reduced ones after reduce_scatter_gradients."""
        return [bucket.shard for bucket in self.buckets]

    def shard_gradients(self) -> list[torch.Tensor]:
        return [bucket.flat_grads[bucket.shard_range] for bucket in self.buckets]

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)  # type: ignore[misc]
        for bucket in self.buckets:
            all_gather_single(bucket.flat_params, bucket.shard.detach().clone(), group=self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero in place whatever `set_to_none` says: the gradients are views of the flat buffers."""
        for bucket in self.buckets:
            bucket.flat_grads.zero_()

    # -- checkpoints: per-parameter state under the model's names, as the unsplit optimizer's would be ----------
    def _shard_state(self, bucket: FlatBucket, group: dict) -> dict[str, torch.Tensor]:
        state = self.state[bucket.shard]
        if not state:  # before the first step: what the optimizer would start from
            if group.get("muon"):
                state.update(momentum_buffer=torch.zeros_like(bucket.shard))
            else:
                adamw_state(state, bucket.shard, FUSED)
        return state

    def _pieces(self, bucket: FlatBucket) -> Iterator[tuple[nn.Parameter, int, list[tuple[int, slice, slice]]]]:
        """Each parameter of the bucket, its offset in the flat buffers, and where it lies: (rank, its span in the
        parameter's flat view, the same span in that rank's slice) for every rank holding part of it."""
        shard_numel, offset = bucket.shard.numel(), 0
        for param in bucket.params:
            spans = []
            for rank in range(self.world):
                start, stop = max(offset, rank * shard_numel), min(offset + param.numel(), (rank + 1) * shard_numel)
                if start < stop:
                    in_slice = slice(start - rank * shard_numel, stop - rank * shard_numel)
                    spans.append((rank, slice(start - offset, stop - offset), in_slice))
            yield param, offset, spans
            offset += param.numel()

    @torch.no_grad()
    def flat_state_dict(self, names: dict[nn.Parameter, str]) -> dict[str, Any]:
        """Collective: "state.<name>.<key>" (AdamW's exp_avg, exp_avg_sq, step; Muon's momentum_buffer) and
        "param_groups.<name>.<option>", each moment a DTensor of the parameter split by rows over the ranks, as
        FSDP's: any layout loads it, and DCP writes each rank's rows. Built one parameter at a time (its moment
        assembled from the slices that hold it, this rank's rows kept), so a save holds this rank's share of the
        moments and one parameter's whole moment, not 2Ψ: a memory spike exactly where ZeRO-1 was chosen to fit."""
        flat: dict[str, Any] = {}
        for bucket, group in zip(self.buckets, self.param_groups):
            state = self._shard_state(bucket, group)
            for param, _, spans in self._pieces(bucket):
                name = names[param]
                for key, value in state.items():
                    if key == "step":
                        flat[f"state.{name}.step"] = value.clone()
                        continue
                    whole = torch.empty_like(param)
                    for rank, in_param, in_slice in spans:
                        piece = whole.view(-1)[in_param]
                        if rank == self.rank:
                            piece.copy_(value[in_slice])
                        dist.broadcast(piece, src=dist.get_global_rank(self.group, rank), group=self.group)
                    flat[f"state.{name}.{key}"] = self._by_rows(whole)
                for option, value in group.items():
                    if option != "params":
                        flat[f"param_groups.{name}.{option}"] = value
        return flat

    def _by_rows(self, whole: torch.Tensor) -> DTensor:
        """This rank's rows of `whole` as a DTensor split by rows (torch.chunk's split, as FSDP's Shard(0))."""
        if whole.ndim == 0:
            return DTensor.from_local(whole, self.mesh, [Replicate()], run_check=False)
        rows = -(-whole.shape[0] // self.world)
        mine = whole[self.rank * rows : (self.rank + 1) * rows].clone()  # a copy: the whole moment is freed
        return DTensor.from_local(
            mine, self.mesh, [Shard(0)], run_check=False, shape=whole.shape, stride=whole.stride()
        )

    @torch.no_grad()
    def load_flat_state_dict(self, flat: dict[str, Any], names: dict[nn.Parameter, str]) -> None:
        """Collective, the inverse of flat_state_dict: each parameter's moment assembled from the rows (one at a
        time), this rank's slice kept."""
        for bucket, group in zip(self.buckets, self.param_groups):
            state = self._shard_state(bucket, group)
            first = names[bucket.params[0]]
            for option in group:
                if option != "params":
                    group[option] = flat[f"param_groups.{first}.{option}"]
            for key, value in state.items():
                if key == "step":
                    value.copy_(flat[f"state.{first}.step"])
                    continue
                for param, _, spans in self._pieces(bucket):
                    whole = flat[f"state.{names[param]}.{key}"].full_tensor().view(-1)
                    for rank, in_param, in_slice in spans:
                        if rank == self.rank:
                            value[in_slice].copy_(whole[in_param])


class ZeroOneAdamW(ZeroOneShards, torch.optim.AdamW):
    """torch's fp32 AdamW over flat slices, fused: the slices are plain tensors on the parameters' device, so
    `compute` asks nothing of it."""

    def __init__(self, model: nn.Module, optim_cfg, mesh: DeviceMesh, compute: Compute):
        groups = self._shard_groups(model, optim_cfg, mesh)
        torch.optim.AdamW.__init__(self, groups, **adamw_options(optim_cfg), fused=FUSED)


class ZeroOneMuon(ZeroOneShards, Muon):
    """Muon over flat slices, which cut across matrices: each step all-gathers the matrices' updates (as the
    parameters after it) and orthogonalises only the matrices that overlap this rank's slice."""

    def __init__(self, model: nn.Module, optim_cfg, mesh: DeviceMesh, compute: Compute):
        Muon.__init__(self, self._shard_groups(model, optim_cfg, mesh), optim_cfg, compute)

    def _orthogonalized(self, params: list[torch.Tensor], updates: list[torch.Tensor], finish) -> list[torch.Tensor]:
        buckets = {id(bucket.shard): bucket for bucket in self.buckets}
        results = []
        for shard, update in zip(params, updates):
            bucket = buckets[id(shard)]
            everyone = torch.empty_like(bucket.flat_params)
            all_gather_single(everyone, update.contiguous(), group=self.group)
            mine = torch.zeros_like(update)
            for param, offset, spans in self._pieces(bucket):
                for rank, in_param, in_slice in spans:
                    if rank == self.rank:
                        whole = everyone[offset : offset + param.numel()].view_as(param)
                        mine[in_slice] = finish(whole).reshape(-1)[in_param]
            results.append(mine)
        return results
