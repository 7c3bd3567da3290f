"""Muon (Jordan et al., 2024): momentum whose update is orthogonalised, for the blocks' weight matrices; AdamW for
the other parameters, in one optimizer (one state dict, one schedule, one checkpoint format).

Per matrix W with gradient G, each step:
  B <- momentum B + (1 - momentum) G                       (torch.optim.Muon's form of the momentum)
  U <- G + momentum (B - G) with Nesterov, B without
  O <- NS(U)           five Newton-Schulz iterations: U's nearest semi-orthogonal matrix, roughly (U S'V^T)
  W <- W (1 - lr weight_decay) - lr * update_rms * sqrt(max(rows, cols)) * O

O's entries have RMS 1/sqrt(max(rows, cols)), so the last factor gives every matrix's update an RMS of
`update_rms`: 0.2, about AdamW's, lets AdamW's learning rate and weight decay carry over (Liu et al. 2025,
"Muon is Scalable for LLM Training"; torch.optim.Muon's adjust_lr_fn="match_rms_adamw").

Newton-Schulz needs each whole matrix, while FSDP, tensor and expert parallelism hold pieces of it: whole_matrices.py
assembles them (`_orthogonalized`), ZeRO-1's flat slices do it their way (llmtrain/parallel/zero.py).
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor

from llmtrain.optim.compute import Compute
from llmtrain.optim.groups import adamw_options, adamw_state, adamw_update, fused_for
from llmtrain.optim.whole_matrices import orthogonalize

# The quintic's coefficients (Keller Jordan's, as torch.optim.Muon's): the steepest slope at zero that still maps
# every singular value into about [0.5, 1.5] in five steps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def newton_schulz(update: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
    """Each matrix of `update` (its last two dimensions; any before them are a batch, as experts) orthogonalised
    by `steps` Newton-Schulz iterations computed in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    if x.ndim > 3:
        x = x.flatten(0, -3)
    wide = x.size(-2) <= x.size(-1)
    if not wide:  # iterate on the wide orientation: its Gram matrix is the smaller one
        x = x.mT
    multiply_add = torch.addmm if x.ndim == 2 else torch.baddbmm  # c + alpha a b in one kernel, as torch's
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = multiply_add(x, multiply_add(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if not wide:
        x = x.mT
    return x.reshape(update.shape).to(update.dtype)


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked `muon: True`, torch's AdamW update on the others (llmtrain/optim/groups.py
    makes them). The Newton-Schulz iterations run in `compute.dtype`, the run's compute precision."""

    def __init__(self, groups: list[dict], optim_cfg, compute: Compute):
        defaults = dict(
            **adamw_options(optim_cfg),
            weight_decay=optim_cfg.weight_decay,
            momentum=optim_cfg.momentum,
            nesterov=optim_cfg.nesterov,
            ns_steps=optim_cfg.ns_steps,
            update_rms=optim_cfg.update_rms,
            muon=False,
        )
        super().__init__(groups, defaults)
        self.ns_dtype = compute.dtype
        self.spread = optim_cfg.whole_matrices == "spread"

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [param for param in group["params"] if param.grad is not None]
            if params:
                (self._muon_step if group["muon"] else self._adamw_step)(group, params)

    def _adamw_step(self, group: dict, params: list[Tensor]) -> None:
        # as torch.optim.AdamW keeps its state, so that a checkpoint of either loads into the other's form
        fused = fused_for(params)
        states = [adamw_state(self.state[param], param, fused) for param in params]
        adamw_update(
            group,
            params,
            [cast(Tensor, param.grad) for param in params],
            [state["exp_avg"] for state in states],
            [state["exp_avg_sq"] for state in states],
            [state["step"] for state in states],
        )

    def _muon_step(self, group: dict, params: list[Tensor]) -> None:
        momentum, updates = group["momentum"], []
        for param in params:
            grad, state = cast(Tensor, param.grad), self.state[param]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buffer = state["momentum_buffer"]
            buffer.lerp_(grad, 1 - momentum)
            updates.append(grad.lerp(buffer, momentum) if group["nesterov"] else buffer)
        steps, rms = group["ns_steps"], group["update_rms"]

        def finish(whole: Tensor) -> Tensor:
            """A stack of whole matrices -> their orthogonalised updates at the RMS that lets AdamW's lr carry over."""
            scale = rms * math.sqrt(max(whole.shape[-2:]))
            return newton_schulz(whole, steps, self.ns_dtype).mul_(scale)

        lr, decay = group["lr"], group["weight_decay"]
        for param, orthogonal in zip(params, self._orthogonalized(params, updates, finish)):
            param.mul_(1 - lr * decay)
            param.add_(orthogonal, alpha=-lr)

    def _orthogonalized(self, params: list[Tensor], updates: list[Tensor], finish) -> list[Tensor]:
        """`finish` applied to each whole matrix of `updates`, the results laid out as the updates are."""
        return orthogonalize(updates, finish, self.spread)
