"""Expert parallelism (`parallel.ep`): each mixture-of-experts block's experts are split over ep ranks, and every
routed token travels to the rank holding its expert and back, by two all-to-alls (GShard, torchtitan).

The ep ranks are taken from the sharded data-parallel ones (dp_shard x cp), as in torchtitan: they hold different
tokens, so each expert sees the tokens of all ep ranks, and no rank holds every expert. The experts' weights live
on a mesh of their own (mesh.build_expert_mesh): sharded over `ep` on the expert dimension (a DTensor,
Shard(0)), and over the remaining `expert_shard` ranks by FSDP (fsdp.py), replicated over dp_replicate. With
tensor parallelism each expert is also split by hidden units over tp; the tp ranks route the same tokens, and each
exchanges them with the ep ranks of its own tp index.

One block's forward on one rank, with E experts, ep ranks, L = E / ep local experts:
1. route its tokens (moe.py) and sort the routed slots by expert: counts[e] slots for expert e;
2. exchange the counts (an all-to-all of E integers): each rank learns how many slots every other rank sends to
   each of its L experts, which the token all-to-all needs as split sizes (one host sync, the block's only one);
3. all-to-all the slots: rank r receives, from every source rank, the slots for experts rL .. rL+L-1, grouped by
   source then expert; regroup them by expert, run the L experts (one grouped GEMM), undo the regrouping;
4. all-to-all the results back (the first exchange's splits, swapped): every slot returns to the rank and position
   it came from, where moe.py weights and sums them.
Backward is the same two exchanges reversed (torch's autograd all-to-all). No token is dropped (no capacity
factor), so the result equals the unsplit model's whatever ep is.

Gradients: the expert weights on one rank are the sum of contributions from all ep ranks' tokens, and FSDP then
averages over the expert_shard x dp_replicate ranks only, which would leave them ep times too large; their FSDP
unit therefore divides by the whole data-parallel size instead (fsdp.py), like the dense weights' average.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from llmtrain.model.moe import Experts, MoE
from llmtrain.parallel.tp import EXPERT_HIDDEN_DIM


class AllToAllDispatch:
    """Steps 2-4 above for one expert-parallel group: the `dispatch` hook of every MoE block."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = group.size()

    def __call__(self, experts: Experts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        local = len(counts) // self.size
        received_counts = funcol.all_to_all_single(counts, None, None, self.group)
        from_source = received_counts.view(self.size, local)  # (source rank, local expert) -> slots
        split_send, split_received = self.split_sizes(rows, counts.view(self.size, local), from_source)
        received = funcol.all_to_all_single_autograd(rows, split_received, split_send, self.group)
        expert_of_row = torch.arange(local, device=rows.device).repeat(self.size)
        expert_of_row = expert_of_row.repeat_interleave(from_source.flatten(), output_size=sum(split_received))
        by_expert = expert_of_row.argsort(stable=True)
        outputs = experts(received[by_expert], from_source.sum(dim=0))
        outputs = outputs[by_expert.argsort()]
        return funcol.all_to_all_single_autograd(outputs, split_send, split_received, self.group)

    def split_sizes(
        self, rows: torch.Tensor, to_rank: torch.Tensor, from_rank: torch.Tensor
    ) -> tuple[list[int], list[int]]:
        """The slots this rank sends to each rank and receives from each, from the (rank, local expert) counts of
        its routed `rows` (ordered by destination) and of those it receives. The
        split sizes of both exchanges are read on the host together (the exchanges take them as lists): the
        block's one sync. Everything else stays on the device."""
        sizes = torch.cat([to_rank.sum(dim=1), from_rank.sum(dim=1)]).tolist()
        return sizes[: self.size], sizes[self.size :]


def apply_expert_parallel(model: nn.Module, expert_mesh: DeviceMesh) -> None:
    """Shard every mixture's expert weights over `expert_mesh` (on the meta device: nothing is allocated) and hand
    its MoE the all-to-all dispatch. The mesh is (ep) or, with tensor parallelism, (ep, tp): then each expert is
    also split by hidden units, the layout the tensor-parallel plan gives experts (parallel/tp.py), which
    leaves these weights as they are."""
    tensor_parallel = expert_mesh.ndim == 2
    dispatch = AllToAllDispatch(expert_mesh["ep"].get_group())
    for module in model.modules():
        if isinstance(module, MoE):
            for name, param in list(module.experts.named_parameters(recurse=False)):
                placements = [Shard(0), Shard(EXPERT_HIDDEN_DIM[name])] if tensor_parallel else [Shard(0)]
                sharded = distribute_tensor(param.data, expert_mesh, placements, src_data_rank=None)  # no copying
                module.experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            module.dispatch = dispatch
