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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.optim import adamw_param_groups

# torch 2.13 renamed the flat-tensor collectives; the older names still work on older releases.
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


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


class ZeroOneAdamW(torch.optim.AdamW):
    """AdamW over this rank's slices only; `reduce_scatter_gradients` before `step`, which all-gathers after."""

    def __init__(self, model: nn.Module, optim_cfg, group: dist.ProcessGroup):
        self.group = group
        self.world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.buckets: list[FlatBucket] = []
        shard_groups = []
        for param_group in adamw_param_groups(model, optim_cfg.weight_decay):
            if not param_group["params"]:
                continue
            bucket = _flatten(param_group["params"], self.world, rank)
            # Every rank starts from rank 0's weights, as DDP guarantees by its initial broadcast.
            dist.broadcast(bucket.flat_params, src=dist.get_global_rank(group, 0), group=group)
            self.buckets.append(bucket)
            shard_groups.append({"params": [bucket.shard], "weight_decay": param_group["weight_decay"]})
        super().__init__(shard_groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps)

    @torch.no_grad()
    def reduce_scatter_gradients(self) -> None:
        """Slice r of every bucket's gradient becomes the mean over ranks; the other slices are left stale."""
        for bucket in self.buckets:
            reduced = torch.empty_like(bucket.shard)
            reduce_scatter(reduced, bucket.flat_grads, op=dist.ReduceOp.SUM, group=self.group)
            bucket.flat_grads[bucket.shard_range].copy_(reduced.div_(self.world))

    def shards(self) -> list[nn.Parameter]:
        """This rank's slices, whose gradients are the reduced ones after reduce_scatter_gradients."""
        return [bucket.shard for bucket in self.buckets]

    def shard_gradients(self) -> list[torch.Tensor]:
        return [bucket.flat_grads[bucket.shard_range] for bucket in self.buckets]

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for bucket in self.buckets:
            all_gather(bucket.flat_params, bucket.shard.detach().clone(), group=self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero in place whatever `set_to_none` says: the gradients are views of the flat buffers."""
        for bucket in self.buckets:
            bucket.flat_grads.zero_()

    # -- checkpoints: per-parameter state under the model's names, as a plain AdamW's would be -------------------
    def _shard_state(self, bucket: FlatBucket) -> dict[str, torch.Tensor]:
        state = self.state[bucket.shard]
        if not state:  # before the first step: what AdamW would start from
            state.update(
                step=torch.tensor(0.0),
                exp_avg=torch.zeros_like(bucket.shard),
                exp_avg_sq=torch.zeros_like(bucket.shard),
            )
        return state

    @torch.no_grad()
    def flat_state_dict(self, names: dict[nn.Parameter, str]) -> dict[str, Any]:
        """Collective: "state.<name>.<exp_avg|exp_avg_sq|step>" and "param_groups.<name>.<option>", with each
        moment all-gathered from the slices into every parameter's full tensor."""
        flat: dict[str, Any] = {}
        for bucket, group in zip(self.buckets, self.param_groups):
            state = self._shard_state(bucket)
            moments = {}
            for key in ("exp_avg", "exp_avg_sq"):
                full = torch.empty_like(bucket.flat_params)
                all_gather(full, state[key].contiguous(), group=self.group)
                moments[key] = full
            offset = 0
            for param in bucket.params:
                name, n = names[param], param.numel()
                for key, full in moments.items():
                    flat[f"state.{name}.{key}"] = full[offset : offset + n].view_as(param)
                flat[f"state.{name}.step"] = state["step"].clone()
                for option, value in group.items():
                    if option != "params":
                        flat[f"param_groups.{name}.{option}"] = value
                offset += n
        return flat

    @torch.no_grad()
    def load_flat_state_dict(self, flat: dict[str, Any], names: dict[nn.Parameter, str]) -> None:
        """The inverse of flat_state_dict: this rank keeps its slice of each moment."""
        for bucket, group in zip(self.buckets, self.param_groups):
            state = self._shard_state(bucket)
            first = names[bucket.params[0]]
            state["step"].copy_(flat[f"state.{first}.step"])
            for option in group:
                if option != "params":
                    group[option] = flat[f"param_groups.{first}.{option}"]
            for key in ("exp_avg", "exp_avg_sq"):
                full = torch.zeros_like(bucket.flat_params)
                offset = 0
                for param in bucket.params:
                    full[offset : offset + param.numel()].copy_(flat[f"state.{names[param]}.{key}"].flatten())
                    offset += param.numel()
                state[key].copy_(full[bucket.shard_range])
