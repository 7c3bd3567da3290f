"""`optim.offload`: AdamW whose state and step live in host memory (ZeRO-Offload's split, Ren et al., 2021).

The device keeps the weights and gradients it computes with; the host keeps an fp32 copy of each weight this rank
updates, AdamW's two moments and the step count. Each optimizer step goes a slice of tensors (SLICE values or more)
at a time, as a pipeline:
  1. every slice's gradients are queued for pinned host memory on a copy stream, an event after each slice;
  2. the host waits for a slice's event alone and runs torch's own AdamW update (groups.py: adamw_update) on its
     copies of that slice, while the next slices' gradients are still coming down;
  3. the slice's updated weights go up on a second copy stream without waiting (PCIe carries both directions at
     once), while the host updates the next slice; the device's next forward waits for the last copy.
So a step's host time is near the longest of the three, not their sum.
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
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from llmtrain.optim.groups import FUSED, adamw_options, adamw_update
from llmtrain.optim.loading import load_in_place

# The step goes a slice of at least this many values at a time: the host updates one slice while the next one's
# gradients come down and the last one's weights go up.
SLICE = 1 << 23


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _slices(params: list[torch.Tensor], at_least: int) -> list[list[torch.Tensor]]:
    """`params` in order, in runs of whole tensors of at least `at_least` values (the last may have fewer)."""
    runs: list[list[torch.Tensor]] = [[]]
    for param in params:
        if sum(_local(p).numel() for p in runs[-1]) >= at_least:
            runs.append([])
        runs[-1].append(param)
    return [run for run in runs if run]


class HostAdamW(torch.optim.Optimizer):
    """AdamW over `groups` (llmtrain/optim/groups.py) with its state and update on the host."""

    def __init__(self, groups: list[dict], optim_cfg, device: torch.device):
        # torch's AdamW's defaults, so that the two write the same state dict and resume from each other's
        defaults = torch.optim.AdamW([torch.zeros(1)], **adamw_options(optim_cfg), fused=FUSED).defaults
        super().__init__(groups, defaults)
        self.device = device
        pin = device.type == "cuda"
        # The copy streams: gradients down on one, weights up on the other, at once (PCIe carries both ways).
        self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if pin else None
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
        """Gradients down, torch's AdamW on the host, weights up, a slice at a time (see the module's docstring)."""
        slices = [
            (group, part)
            for group in self.param_groups
            for part in _slices([p for p in group["params"] if p.grad is not None], SLICE)
        ]
        if self._streams is None:  # the device is the host: nothing to overlap
            for group, params in slices:
                for param in params:
                    self._gradients[param].copy_(_local(cast(torch.Tensor, param.grad)))
                self._update(group, params)
                for param in params:
                    _local(param).copy_(self._weights[param])
            return
        down, up = self._streams
        compute = torch.cuda.current_stream(self.device)
        down.wait_stream(compute)  # the gradients are complete
        up.wait_stream(compute)  # and the step's last reads of the weights are done
        arrived = []
        with torch.cuda.stream(down):
            for _, params in slices:
                for param in params:
                    self._gradients[param].copy_(_local(cast(torch.Tensor, param.grad)), non_blocking=True)
                arrived.append(down.record_event())
        for (group, params), event in zip(slices, arrived):
            event.synchronize()
            self._update(group, params)
            with torch.cuda.stream(up):
                for param in params:
                    _local(param).copy_(self._weights[param], non_blocking=True)
        # The next forward reads the weights, and the gradients' memory is reused, after the copies.
        compute.wait_stream(up)
        compute.wait_stream(down)

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        """torch's AdamW on the host copies of `params`, from their host gradients."""
        states = [self._state_of(p) for p in params]
        adamw_update(
            group,
            [self._weights[p] for p in params],
            [self._gradients[p] for p in params],
            [_local(state["exp_avg"]) for state in states],
            [_local(state["exp_avg_sq"]) for state in states],
            [state["step"] for state in states],
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's format (what `state_dict` writes), copied into the host state in place."""
        load_in_place(self, state_dict, self._state_of)
        for param in self._weights:  # the host copies follow the weights just loaded into the model
            self._weights[param].copy_(_local(param).detach())
