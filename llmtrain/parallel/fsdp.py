"""The FSDP step of `parallel=fsdp | zero2 | hsdp | fsdp_tp | ddp_tp` and of pipeline stages: FSDP2 (`fully_shard`)
over the data-parallel mesh dimensions, on top of tensor parallelism when parallel.tp > 1 (2-D: TP inside, FSDP
across, over DTensor parameters that are already TP-sharded).

Each transformer block is one FSDP unit, the input embeddings another, [final norm, head] a third and the root
the rest (a head tied to the embedding stays in the root with it: edge_units): a block's parameters are
all-gathered just before it runs (the next block's gather issued as it starts: forward prefetch) and freed after,
so a rank holds 1/N of the parameters, gradients and AdamW state (Ψ/N + Ψ/N + 2Ψ/N) plus one or two gathered blocks
at a time. The last block stays gathered from the end of forward, where backward starts.
- `fsdp` (ZeRO-3): reshard after forward; per step all-gather Ψ in forward, again Ψ in backward (less the root
  and the last block, kept), reduce-scatter Ψ of gradients: about 3Ψ on the wire.
- `zero2` (ZeRO-2-like): keep the gathered parameters from forward to backward (reshard_after_forward=False):
  2Ψ on the wire, full parameters held during the step, gradients and optimizer state still sharded.
- `hsdp`: a 2-D mesh (dp_replicate x dp_shard): shard inside a node, replicate across nodes; gradients are
  reduce-scattered over dp_shard and all-reduced over dp_replicate.
On GPU with bf16 precision, parameters are gathered and computed in bf16 while gradients are reduced in fp32.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from llmtrain.errors import ConfigError
from llmtrain.model.base import LayeredModel
from llmtrain.model.moe import Experts
from llmtrain.model.quantize import GROUP, is_nf4, nf4_shards_fit
from llmtrain.parallel_plan import Degrees


def apply_fsdp(
    model: LayeredModel,
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None,
    cpu_offload: bool,
    experts: tuple[DeviceMesh, int] | None = None,
) -> None:
    """Shard every block, then the root, over `mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP). With expert
    parallelism, `experts` = (mesh, data-parallel size): each mixture's experts first become a unit of their own
    over that mesh, dividing their gradients by the whole data-parallel size (expert.py says why)."""
    check_nf4_shards(model, shards_of(mesh))
    mixed = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if param_dtype is not None:
        hold_frozen_in(model, param_dtype)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()

    def shard(modules: nn.Module | list[nn.Module], on: DeviceMesh, reshard: bool) -> None:
        # Over one shard FSDP gathers nothing, and torch 2.13's one-shard path copies only the first of a tensor
        # subclass's all-gather inputs (NF4 has three): NF4 weights then stay whole, outside FSDP, as they would be
        # (the experts' over an expert-parallel mesh that leaves them one shard, too).
        parts = modules if isinstance(modules, list) else [modules]
        whole = {p for part in parts for p in part.parameters() if is_nf4(p)} if shards_of(on) == 1 else None
        fully_shard(
            modules,
            mesh=on,
            reshard_after_forward=reshard,
            mp_policy=mixed,
            offload_policy=offload,
            shard_placement_fn=experts_placement(modules, on),
            ignored_params=whole,
        )

    reshards = reshard_flags(model, reshard_after_forward)
    blocks = list(model.blocks.values())
    for block in blocks:
        if experts is not None:
            _shard_experts(block, *experts, shard, reshards[block])
        shard(block, mesh, reshards[block])
    for current, following in zip(blocks, blocks[1:]):
        # the next block's all-gather issued as this one's forward starts, not after it, so the two overlap
        cast(FSDPModule, current).set_modules_to_forward_prefetch([cast(FSDPModule, following)])
    embedding, head = edge_units(model)
    if embedding:
        shard(embedding, mesh, reshards[embedding[0]])
    if head:
        shard(head, mesh, reshards[head[0]])
    # The root holds what is left: the tied embedding and head, whose one weight serves both ends of the step.
    shard(model, mesh, reshards[model])
    # The root returns the head's logits, which nn.Linear makes a view of its 2-D product; FSDP warns that an
    # in-place op on that view would skip its backward hook. The loss only reads the logits.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")


def _shard_experts(
    block: nn.Module,
    expert_mesh: DeviceMesh,
    data_parallel_size: int,
    shard: Callable[[nn.Module, DeviceMesh, bool], None],
    reshard: bool,
) -> None:
    """Each mixture's experts in `block` as an FSDP unit of their own over `expert_mesh` (`shard` makes one), their
    gradients divided by the whole data-parallel size."""
    for module in block.modules():
        if isinstance(module, Experts) and shards_of(expert_mesh) > 1 and any(map(is_nf4, module.parameters())):
            raise ConfigError(
                f"model.quantize_base=nf4 holds the experts, which expert parallelism would leave FSDP to split over "
                f"{shards_of(expert_mesh)} ranks more: torchao's NF4 gathers under FSDP alone, not beside expert "
                f"parallelism's split; set parallel.ep to the data-parallel ranks or to 1"
            )
        if isinstance(module, Experts):
            shard(module, expert_mesh, reshard)
            unit = cast(FSDPModule, module)  # fully_shard made it one
            unit.set_gradient_divide_factor(data_parallel_size)
            if shards_of(expert_mesh) > 1:
                # SUM then divide: the reduction every backend has (gloo has no pre-multiplied sum). Not with one
                # shard: torch 2.13 then divides once when it skips the reduce-scatter and again after it.
                unit.set_force_sum_reduction_for_comms(True)


def hold_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """A frozen weight (the base beside low-rank adapters) is only ever read as FSDP gathers it: held in that dtype,
    its shard takes half the memory and its all-gather casts nothing (FSDP wants one dtype among the trainable
    parameters alone). Set in place, so tied parameters stay one."""
    for param in model.parameters():
        # (an NF4 weight, model.quantize_base, says it is bf16 and would dequantise on any `to`)
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def check_nf4_shards(model: nn.Module, shards: int) -> None:
    """A one-line ConfigError when an NF4 weight (model.quantize_base) cannot split into `shards` row shards of
    whole NF4 groups: FSDP splits its codes, scales and factors alike."""
    for name, param in model.named_parameters():
        if is_nf4(param) and not nf4_shards_fit(param, shards):
            raise ConfigError(
                f"model.quantize_base=nf4: {name} ({' x '.join(map(str, param.shape))}) does not split into "
                f"{shards} FSDP shards of whole {GROUP}-weight NF4 groups: shard over fewer ranks (parallel.dp_shard)"
                f" or use parallel=ddp"
            )


def shards_of(mesh: DeviceMesh) -> int:
    """The shards FSDP splits over on `mesh`: its last dimension, its index counted from the front (torch 2.11's
    DeviceMesh.size(-1) asserts on the meshes FSDP gets under context and expert parallelism)."""
    return mesh.size(mesh.ndim - 1)


def experts_placement(
    modules: nn.Module | list[nn.Module], mesh: DeviceMesh
) -> Callable[[nn.Parameter], Shard | None] | None:
    """Where FSDP splits the expert weights under `modules` (E x d x f each): by expert (dim 0, FSDP's default)
    while every shard gets one, by their second dimension once the shards outnumber the experts, as torchtitan's
    (split by expert, the ranks past the last expert would hold padding only, and the others whole experts); FSDP
    splits a dimension other than the first only evenly, so where the second does not divide, by expert.
    Tensor-parallel experts (DTensors already split along their width) stay split by expert. None (dim 0 for
    everything) where nothing changes."""
    shards = shards_of(mesh)
    by_columns = {
        id(param)
        for part in (modules if isinstance(modules, list) else [modules])
        for expert_module in part.modules()
        if isinstance(expert_module, Experts)
        for param in expert_module.parameters(recurse=False)
        if param.shape[0] < shards and param.shape[1] % shards == 0 and not isinstance(param, DTensor)
    }
    if not by_columns:
        return None
    return lambda param: Shard(1) if id(param) in by_columns else None


def reshard_flags(model: LayeredModel, reshard_after_forward: bool) -> dict[nn.Module, bool]:
    """Whether each FSDP unit of `model` (a block, with every module in it; the edge units; the root) frees its
    gathered parameters after its forward pass, under the layout's `reshard_after_forward`."""
    blocks = list(model.blocks.values())
    flags: dict[nn.Module, bool] = {}
    for index, block in enumerate(blocks):
        # The last block's parameters are the first backward needs: kept from the end of forward, not re-gathered.
        flags.update(dict.fromkeys(block.modules(), reshard_after_forward and index < len(blocks) - 1))
    embedding, head = edge_units(model)
    flags.update(dict.fromkeys(embedding, reshard_after_forward))  # gathered for the first layer only
    flags.update(dict.fromkeys(head, False))  # needed again at the start of backward: kept from the end of forward
    flags[model] = False
    return flags


@contextmanager
def gathered_whole(model: LayeredModel, reshard_after_forward: bool) -> Iterator[None]:
    """`model`'s FSDP units gathered once, all of them, and kept gathered through every forward pass inside (a
    rollout's decoding steps then gather nothing); after, each unit sharded again with its own reshard_after_forward
    (reshard_flags). Nothing to do for a model FSDP does not shard."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        flags = reshard_flags(model, reshard_after_forward)
        for unit in units:
            unit.set_reshard_after_forward(flags[unit], recurse=False)
            unit.reshard()


def edge_units(model: LayeredModel) -> tuple[list[nn.Module], list[nn.Module]]:
    """The input embeddings and the [final norm, head] of `model` (or of a pipeline part) as FSDP units of their
    own, as torchtitan's: the embedding is then freed once the first block has its input, instead of staying
    gathered, with its gradient, for the whole step in the root. Not when the head is the token embedding (tied,
    as GPT-2): one weight needed at both ends of the step stays in the root."""
    tok_emb, lm_head = getattr(model, "tok_emb", None), getattr(model, "lm_head", None)
    if tok_emb is not None and lm_head is not None and lm_head.weight is tok_emb.weight:
        return [], []
    embedding = [m for m in (tok_emb, getattr(model, "pos_emb", None)) if m is not None]
    head = [m for m in (getattr(model, "norm", None), lm_head) if m is not None]
    return embedding, head


def fsdp_mesh(mesh: DeviceMesh, degrees: Degrees) -> DeviceMesh:
    """A 2-D (replicate, shard) mesh makes fully_shard hybrid: sharded within, replicated across. With context
    parallelism the shards span dp_shard x cp: cp ranks hold the same parameters and their gradients are averaged
    with the data-parallel ones, so sharding over them too costs no extra traffic."""
    if degrees.cp == 1:
        return mesh["dp_replicate", "dp_shard"] if degrees.dp_replicate > 1 else mesh["dp_shard"]
    shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return DeviceMesh._concatenate([mesh["dp_replicate"], shard]) if degrees.dp_replicate > 1 else shard


def expert_fsdp_mesh(expert_mesh: DeviceMesh, degrees: Degrees) -> DeviceMesh:
    """The experts' FSDP mesh: the expert_shard ranks that ep leaves (HSDP across dp_replicate, as the rest)."""
    return expert_mesh["dp_replicate", "expert_shard"] if degrees.dp_replicate > 1 else expert_mesh["expert_shard"]
