"""Tensor parallelism with DTensor: `parallel=tp`, and the TP step of every layout with parallel.tp > 1.

`apply_tensor_parallel` applies a family's plan (module name -> parallel style; the GPT's is
`gpt_tensor_parallel_plan`, which family.py binds to the GPT) over the `tp` mesh dimension and keeps tied parameters
tied. With loss parallelism the cross-entropy runs on vocabulary shards (`loss_context`), so no rank holds
full-vocabulary logits. The plan lives here, beside the parallelism it drives, not in the model (as torchtitan's
parallelize functions name their model's modules): the model modules import nothing of tensor parallelism.

The plan, the Megatron way. Within a block, the first matmul of each pair is column-parallel (q, k, v split by
heads, grouped-query attention's key/value heads with their query heads; the MLP's up-projection and SwiGLU gate
split by hidden units) and the second row-parallel (attention output, MLP down-projection), so a block needs one
all-reduce in forward (Megatron's g) and one in backward (f) per pair: 4 per layer, 8·b·s·h·(t−1)/t bytes.

With sequence parallelism the activations between the pairs (LayerNorms, residual adds, dropout) stay sharded
along the sequence: each all-reduce becomes an all-gather into the pair and a reduce-scatter out of it, the same
bytes on the wire, while LayerNorm inputs and residuals shrink t times.

A linear layer with low-rank adapters (model/lora.py) splits them the way its weight is split (`AdaptedColwise`,
`AdaptedRowwise`), so the update is computed on the same shards as the base and needs no communication of its own.

A mixture-of-experts block splits every expert like the dense MLP, by hidden units (each rank holds a 1/t slice of
all experts). Routing is replicated: every rank routes the same tokens the same way, so the router needs no plan,
and only the experts' input and output cross the tensor-parallel boundary (`SplitExperts`: Megatron's f and g).
Shared experts are a dense MLP with the dense plan.

The token embedding is split by vocabulary rows and the tied LM head by the same rows, so with loss parallelism
the cross-entropy runs on vocabulary shards and no rank ever holds full-vocabulary logits.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from llmtrain.model import GPT
from llmtrain.model.base import LayeredModel
from llmtrain.model.dropout import Dropout, Split
from llmtrain.model.gpt import ProjectionRMSNorm
from llmtrain.model.materialize import retie, tied_groups
from llmtrain.model.moe import Experts, MoE
from llmtrain.parallel.float8 import float8_tensor_parallel_plan


def apply_tensor_parallel(
    model: LayeredModel, plan: dict[str, ParallelStyle], tp_mesh: DeviceMesh, float8_styles: bool = False
) -> None:
    """`plan` (its family's, llmtrain/parallel/family.py) over `tp_mesh`; `float8_styles`: the model's float8
    layers get torchao's float8 styles (float8.py)."""
    tied = tied_groups(model)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, float8_tensor_parallel_plan(model, plan) if float8_styles else plan)
    # parallelize_module gives each module its own DTensor parameter; tied ones share one placement (the
    # embedding and the head are both split by vocabulary rows), so the tie is restored as it was.
    retie(model, tied)
    # and some of torch's styles (SequenceParallel's norms) make every new parameter trainable: what was frozen
    # (the base beside low-rank adapters) stays frozen.
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def loss_context(tp: int, loss_parallel_on: bool) -> AbstractContextManager:
    """Around the loss and its backward: cross-entropy on vocabulary shards when the head's output is split."""
    return loss_parallel() if loss_parallel_on and tp > 1 else nullcontext()


class VocabParallelEmbedding(ParallelStyle):
    """The token embedding split by vocabulary rows (Megatron's VocabParallelEmbedding): each rank looks up the ids
    its rows hold on its local shard, zeros the others, and the ranks' partial sums are reduced into
    `output_layout` (the sequence chunk under sequence parallelism). The weight's gradient is then the rank's rows
    alone. DTensor's own embedding backward has no rule that keeps rows split: it makes a Partial gradient of the
    whole table, which FSDP reduce-scatters afterwards and a pipeline stage kept whole across its micro-batches (an
    fp32 copy of the whole vocabulary on every tensor-parallel rank)."""

    def __init__(self, output_layout: Placement):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute_parameters(module, device_mesh, {"weight": Shard(0)}, self.src_data_rank)
        embedding = cast(nn.Embedding, module)
        # FSDP2 swaps the module's class and its parameter but calls `forward`, so the lookup stays this one
        embedding.forward = partial(_lookup_own_rows, embedding, device_mesh, self.output_layout)  # type: ignore[method-assign]
        return module


def _lookup_own_rows(module: nn.Embedding, mesh: DeviceMesh, layout: Placement, ids: torch.Tensor) -> torch.Tensor:
    weight = cast(DTensor, module.weight)  # FSDP's gathered one in a forward, split by rows over `mesh`
    rows = weight.to_local()  # backward returns this rank's rows' gradient as the weight's own placement
    first = mesh.get_local_rank() * -(-weight.shape[0] // mesh.size())  # Shard(0) puts ceil(V / t) rows a rank
    elsewhere = (ids < first) | (ids >= first + rows.shape[0])
    found = F.embedding((ids - first).masked_fill(elsewhere, 0), rows).masked_fill(elsewhere.unsqueeze(-1), 0)
    return DTensor.from_local(found, mesh, [Partial()], run_check=False).redistribute(mesh, [layout]).to_local()


class SplitDropout(ParallelStyle):
    """Tells a Dropout that its input is this rank's chunk along `dim` (heads of attention weights, the sequence
    of residual activations), so its mask is the matching part of the unsplit tensor's (model/dropout.py)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        cast(Dropout, module).split = Split(dim=self.dim, rank=device_mesh.get_local_rank(), parts=device_mesh.size())
        return module


class ChunkPositions(ParallelStyle):
    """Under sequence parallelism the position embedding keeps replicated weights (a DTensor, so the partial
    gradients of the ranks' sequence chunks are summed) and each rank looks up its own chunk of positions (the last
    dimension: (t,) positions, or (batch, t) within packed documents)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def positions_chunk(_module, inputs, mesh):
            positions = DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False)
            return (positions.redistribute(mesh, [Shard(positions.ndim - 1)]),)

        return distribute_module(
            module, device_mesh, input_fn=positions_chunk, output_fn=lambda _module, output, _mesh: output.to_local()
        )


def _distribute_parameters(
    module: nn.Module, device_mesh: DeviceMesh, placements: dict[str, Placement], src_data_rank: int | None
) -> None:
    """Each of `module`'s own parameters named in `placements` as a DTensor placed so, keeping its requires_grad."""
    for name, param in list(module.named_parameters(recurse=False)):
        split = distribute_tensor(param, device_mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))


class AdaptedColwise(ColwiseParallel):
    """ColwiseParallel that also splits a layer's low-rank adapters: B by output rows like the weight, A whole, so
    each rank computes its own output columns' update from the whole input (a plain nn.Linear splits as with
    ColwiseParallel)."""

    def _partition_linear_fn(self, name, module, device_mesh):
        placements = {"weight": Shard(0), "bias": Shard(0), "lora_a": Replicate(), "lora_b": Shard(0)}
        _distribute_parameters(module, device_mesh, placements, self.src_data_rank)


class AdaptedRowwise(RowwiseParallel):
    """RowwiseParallel that also splits a layer's low-rank adapters: A by input columns like the weight, B whole, so
    the update is a partial sum reduced with the base's, in the layer's one all-reduce (or reduce-scatter)."""

    def _partition_linear_fn(self, name, module, device_mesh):
        placements = {"weight": Shard(1), "bias": Replicate(), "lora_a": Shard(1), "lora_b": Replicate()}
        _distribute_parameters(module, device_mesh, placements, self.src_data_rank)


# The experts' hidden-unit dimension in each stacked weight: (E, d, f) for w_in and w_gate, (E, f, d) for w_out.
EXPERT_HIDDEN_DIM = {"w_in": 2, "w_gate": 2, "w_out": 1}


@dataclass(frozen=True)
class MegatronSplit:
    """moe.HiddenSplit over `mesh`: Megatron's f and g as DTensor conversions."""

    mesh: DeviceMesh

    def into(self, x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

    def out_of(self, x: torch.Tensor) -> torch.Tensor:
        local = DTensor.from_local(x, self.mesh, [Partial()], run_check=False)
        return local.redistribute(self.mesh, [Replicate()]).to_local()


class SplitExperts(ParallelStyle):
    """Each rank keeps a slice of every expert's hidden units and computes a partial sum of each routed slot's
    output; the MoE reduces them once per token (moe.py: Megatron's f and g around the experts, after the slots
    are combined). Expert-parallel weights arrive already split over the expert mesh's (ep, tp) and are left as
    they are."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                split = distribute_tensor(param.data, device_mesh, [Shard(EXPERT_HIDDEN_DIM[name])], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
        assert isinstance(module, Experts)
        module.hidden_split = MegatronSplit(device_mesh)
        return module


class SplitProjectionNorm(ParallelStyle):
    """A norm over a whole column-parallel projection (model/gpt.py ProjectionRMSNorm, OLMo 2's query and key
    norms): its weight split by the projection's columns, and the squares of each position summed over the ranks
    forward and backward (an all-reduce of one number per position each way)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, ProjectionRMSNorm)
        _distribute_parameters(module, device_mesh, {"weight": Shard(0)}, src_data_rank=None)
        module.split = MegatronSplit(device_mesh)
        return module


def _mixture_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A mixture block's MLP: replicated routing on the whole sequence, split experts, a dense plan for shared
    experts; under sequence parallelism the sequence is gathered in and each rank keeps its chunk out."""
    plan: dict[str, ParallelStyle] = {
        "mlp.experts": SplitExperts(),
        "mlp.shared.fc_in": AdaptedColwise(),
        "mlp.shared.fc_gate": AdaptedColwise(),
        "mlp.shared.fc_out": AdaptedRowwise(),
    }
    if sequence_parallel:
        plan["mlp"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
        )
    return plan


def _block_plan(sequence_parallel: bool, mixture: bool = False) -> dict[str, ParallelStyle]:
    """Module name (inside a Block) -> parallel style."""
    plan = _dense_block_plan(sequence_parallel)
    if mixture:
        plan = {name: style for name, style in plan.items() if name != "mlp" and not name.startswith("mlp.")}
        plan.update(_mixture_plan(sequence_parallel))
    return plan


# Query and key norms (Qwen3) see this rank's heads, dimension 2 of (batch, t, heads, head_dim): their one weight is
# replicated and its gradient, a partial sum over each rank's heads, summed (as a sequence-parallel norm's is).
_HEAD_NORMS: dict[str, ParallelStyle] = {
    "attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    "attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
}


def _dense_block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    return {**_HEAD_NORMS, **_projections_plan(sequence_parallel)}


def _projections_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    if not sequence_parallel:
        # q, k and v read one shared DTensor, so backward sums their input gradients before a single all-reduce
        # (Megatron's f), as a fused qkv projection would; three plain inputs would cost three.
        share_input = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
        )
        return {
            "attn": share_input,
            "attn.q_proj": AdaptedColwise(),
            "attn.k_proj": AdaptedColwise(),
            "attn.v_proj": AdaptedColwise(),
            "attn.out_proj": AdaptedRowwise(),
            "attn.attn_dropout": SplitDropout(dim=1),
            "mlp.fc_in": AdaptedColwise(),
            "mlp.fc_gate": AdaptedColwise(),
            "mlp.fc_out": AdaptedRowwise(),
        }
    gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "attn_norm": SequenceParallel(),
        # Gemma's norms of each branch's output, on its sequence chunk, added to the residual stream's chunk
        "attn_post_norm": SequenceParallel(use_local_output=True),
        "mlp_post_norm": SequenceParallel(use_local_output=True),
        "attn": gather_sequence,
        "attn.q_proj": AdaptedColwise(),
        "attn.k_proj": AdaptedColwise(),
        "attn.v_proj": AdaptedColwise(),
        "attn.out_proj": AdaptedRowwise(output_layouts=Shard(1)),
        "attn.attn_dropout": SplitDropout(dim=1),
        "attn.resid_dropout": SplitDropout(dim=1),
        "mlp_norm": SequenceParallel(),
        "mlp": gather_sequence,
        "mlp.fc_in": AdaptedColwise(),
        "mlp.fc_gate": AdaptedColwise(),
        "mlp.fc_out": AdaptedRowwise(output_layouts=Shard(1)),
        "mlp.dropout": SplitDropout(dim=1),
    }


def gpt_tensor_parallel_plan(model: GPT, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan for the blocks and the embeddings / final norm / head this model (or pipeline part) holds. Each
    rank then computes its own heads: the attention reshape derives the head count from the local width."""
    plan = {
        f"blocks.{i}.{name}": _projection_norm_style(block, name, style)
        for i, block in model.blocks.items()
        for name, style in _block_plan(sequence_parallel, isinstance(block.get_submodule("mlp"), MoE)).items()
        if _holds(block, name)  # the gate only in a SwiGLU MLP, shared experts only where configured
    }
    residual = Shard(1) if sequence_parallel else Replicate()
    if model.tok_emb is not None:
        plan["tok_emb"] = VocabParallelEmbedding(output_layout=residual)
        if sequence_parallel:
            if model.pos_emb is not None:  # rotary positions have no weights
                plan["pos_emb"] = ChunkPositions()
            plan["emb_dropout"] = SplitDropout(dim=1)
    if model.lm_head is not None:
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def _projection_norm_style(block: nn.Module, name: str, style: ParallelStyle) -> ParallelStyle:
    """A query or key norm's style: over each head (the plan's), or over the whole projection (OLMo 2's)."""
    return SplitProjectionNorm() if isinstance(block.get_submodule(name), ProjectionRMSNorm) else style


def _holds(block: nn.Module, name: str) -> bool:
    try:
        return block.get_submodule(name) is not None
    except AttributeError:
        return False
