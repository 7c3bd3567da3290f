"""Which parameter each optimizer updates how: the parameter groups every layout builds its optimizer from."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from llmtrain.catalog import OPTIMIZERS


def is_hidden_matrix(name: str, param: nn.Parameter) -> bool:
    """A weight matrix inside the transformer blocks (attention and MLP projections, the router, each expert's
    matrices): what Muon orthogonalises. Embeddings and the head (the model's edges, where a row is a token rather
    than a direction) and every vector (norms, biases) are left to AdamW, as in modded-nanogpt and Moonlight."""
    return param.ndim >= 2 and "blocks" in name.split(".")


def adamw_options(optim_cfg) -> dict:
    """AdamW's options of `optim` (its groups' defaults, under Muon too)."""
    return dict(lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps)


# torch's AdamW runs fused (one kernel over all of a group's tensors on CUDA, a vectorised loop on a CPU, DTensor
# shards included) wherever llmtrain runs it itself: its default would be a foreach launch per operation on a GPU
# and the per-tensor loop on a host, and the CPU tests then run another kernel than the GPU's.
FUSED = True


def fused_for(params: list[Tensor]) -> bool:
    """Whether the fused AdamW takes these tensors in one call: it refuses DTensors mixed with plain tensors (a
    tensor-parallel layout leaves some weights whole), which then take torch's default path."""
    return FUSED and len({isinstance(param, DTensor) for param in params}) <= 1


def refuse_inherited_fusion(optimizer: torch.optim.Optimizer) -> None:
    """After a load: each AdamW group runs fused as this layout's tensors allow, not as the saved options say (the
    layout that saved them may have held the group's tensors all of one kind)."""
    for group in optimizer.param_groups:
        if "fused" in group:
            group["fused"] = fused_for(group["params"])


def adamw_state(state: dict, param: Tensor, fused: bool) -> dict:
    """`param`'s AdamW `state` (filled in place) as torch.optim.AdamW keeps it: zero moments beside the parameter
    and a step count where there are none yet, the count beside the parameter for the fused kernel (which refuses a
    host count beside GPU tensors, and a checkpoint's load may leave it on the host) and on the host otherwise."""
    if not state:
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    step = state.get("step", torch.zeros(()))
    state["step"] = step.to(device=param.device if fused else "cpu", dtype=torch.float32)
    return state


def adamw_update(
    group: dict,
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
) -> None:
    """torch's AdamW update (its functional form) of `params` with `group`'s options, what torch.optim.AdamW runs:
    Muon's AdamW groups and the offloaded AdamW (offload.py) call it on state they keep themselves."""
    beta1, beta2 = group["betas"]
    adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
        fused=fused_for(params),
    )


def param_groups(model: nn.Module, optim_cfg) -> list[dict]:
    """The non-empty groups of `model`'s trainable parameters. AdamW alone: weight decay on matrices (Linear
    weights, embeddings), none on biases and norms, whose decay would only pull scales and offsets towards zero.
    Muon: its hidden matrices first (`muon: True`, learning rate `optim.muon_lr`), then those two AdamW groups
    for the rest (`muon: False`)."""
    muon = OPTIMIZERS[optim_cfg.name].needs_whole_matrices
    matrices: list[nn.Parameter] = []
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if muon and is_hidden_matrix(name, param):
            matrices.append(param)
        else:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": optim_cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if muon:
        groups = [{**group, "muon": False} for group in groups]
        muon_lr = optim_cfg.lr if optim_cfg.muon_lr is None else optim_cfg.muon_lr
        groups.insert(0, {"params": matrices, "weight_decay": optim_cfg.weight_decay, "muon": True, "lr": muon_lr})
    return [group for group in groups if group["params"]]
