"""`optim.offload`: AdamW whose state and step live in host memory (ZeRO-Offload's split, Ren et al., 2021).

The device keeps the weights and gradients it computes with; the host keeps an fp32 copy of each weight this rank
updates, AdamW's two moments and the step count. Each optimizer step:
  1. every gradient is copied to pinned host memory (one wait for all of them);
  2. the host runs torch's own AdamW update (groups.py: adamw_update) on its copies;
  3. the updated weights are copied back without waiting: the device runs the copies, then the next forward,
     while the host goes on to the next batch.
So the device holds 8 bytes a parameter less (the moments), the host 12 more, and each step moves the rank's
gradients down and its weights up the host link (8 bytes a parameter in fp32). The update is torch's AdamW to the
bit: on a CPU the offloaded run equals the plain one (tests/optim/test_low_precision.py).

The moments are plain host tensors, or DTensors over host tensors where the weight is a DTensor (FSDP shards,
tensor-parallel weights), so `get_optimizer_state_dict` names and reshards them as it does AdamW's, in AdamW's
format (a run with or without offload resumes the other's checkpoint); loading copies into them on the host,
never through the device (torch's own load would place them beside the weights).
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from llmtrain.optim.groups import FUSED, adamw_options, adamw_update
from llmtrain.optim.loading import load_in_place


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class HostAdamW(torch.optim.Optimizer):
    """AdamW over `groups` (llmtrain/optim/groups.py) with its state and update on the host."""

    def __init__(self, groups: list[dict], optim_cfg, device: torch.device):
        # torch's AdamW's defaults, so that the two write the same state dict and resume from each other's
        defaults = torch.optim.AdamW([torch.zeros(1)], **adamw_options(optim_cfg), fused=FUSED).defaults
        super().__init__(groups, defaults)
        self.device = device
        pin = device.type == "cuda"
        self._weights: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> its host fp32 copy
        self._gradients: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> its pinned host gradient
        for param in chain.from_iterable(group["params"] for group in self.param_groups):
            local = _local(param).detach()
            self._weights[param] = torch.empty(local.shape, dtype=torch.float32, pin_memory=pin).copy_(local)
            self._gradients[param] = torch.empty(local.shape, dtype=torch.float32, pin_memory=pin)

    def _state_of(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """AdamW's state of `param` on the host, created as torch's AdamW creates it (zeros, step 0)."""
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            for key in ("exp_avg", "exp_avg_sq"):
                host = torch.zeros_like(self._weights[param])
                # The DTensor's own spec: DTensor.from_local would move a host tensor onto the mesh's device.
                state[key] = DTensor(host, param._spec, requires_grad=False) if isinstance(param, DTensor) else host
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Gradients down, torch's AdamW on the host, weights up (see the module's docstring)."""
        stepped = [[p for p in group["params"] if p.grad is not None] for group in self.param_groups]
        for param in chain.from_iterable(stepped):
            self._gradients[param].copy_(_local(param.grad), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the gradients are on the host
        for group, params in zip(self.param_groups, stepped):
            if not params:
                continue
            states = [self._state_of(p) for p in params]
            adamw_update(
                group,
                [self._weights[p] for p in params],
                [self._gradients[p] for p in params],
                [_local(state["exp_avg"]) for state in states],
                [_local(state["exp_avg_sq"]) for state in states],
                [state["step"] for state in states],
            )
            for param in params:
                _local(param).copy_(self._weights[param], non_blocking=True)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's format (what `state_dict` writes), copied into the host state in place."""
        load_in_place(self, state_dict, self._state_of)
        for param in self._weights:  # the host copies follow the weights just loaded into the model
            self._weights[param].copy_(_local(param).detach())
