"""`optim.state_bits=8`: AdamW with its moments in 8 bits, updated chunk by chunk by one compiled function.

The moments are torchao's (Dettmers et al., 2022): blockwise dynamic quantisation, a code byte a value and an fp32
scale per BLOCK values, for every tensor state_bits.is_quantized names; smaller ones keep fp32 moments. The update
is torchao's AdamW8bit's, from the same quantisation functions, in the same order of operations: eagerly, the two
agree to the bit (tests/optim/test_low_precision.py).

What differs is how the step runs. torchao calls a compiled function once per parameter: its guards checked and
its kernels launched per tensor, and a compile per parameter shape. On GPT-2 on one H200 that made a run 0.43x as
fast as one with AdamW. Here each group's quantised moments lie in one flat buffer per moment, the group's tensors
end to end, and the step walks that flat space CHUNK values at a time: the chunk's weights and gradients are
gathered into two staging buffers (one multi-tensor copy each), one compiled call updates the chunk and its codes
and scales in place, and one copy puts the weights back. Every chunk has the same shape (the last is padded), so
the function compiles once per group, and a step costs a few launches per CHUNK values whatever the number of
tensors. The fp32 moments of the small tensors take torch's fused AdamW, one call a group.

The per-parameter state is what torchao keeps (views of the flat buffers, wrapped as torchao's 8-bit tensors and in
DTensors where the weights are), so checkpoints (state_bits.py) and the memory accounting see torchao's layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from llmtrain.optim.groups import adamw_options, adamw_state, adamw_update, fused_for
from llmtrain.optim.loading import load_in_place
from llmtrain.optim.state_bits import BLOCK, is_quantized
from llmtrain.optional import import_torchao

_quant = import_torchao("torchao.optim.quant_utils")
_subclass = import_torchao("torchao.optim.subclass_8bit")

# The most values updated per compiled call: staging holds as many fp32 weights and as many gradients (128 MiB in
# all), few enough for a 16 GB card, many enough that GPT-2's step is 8 calls.
CHUNK = 1 << 24


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Quantized(NamedTuple):
    """A moment as torchao keeps it: a code a value, an fp32 scale per BLOCK values, the code map."""

    codes: Tensor
    scale: Tensor
    qmap: Tensor

    def values(self) -> Tensor:
        return _quant.dequant_with_qmap(self.codes, self.qmap, self.scale)


class Hyper(NamedTuple):
    """AdamW's options that stay fixed over a run (compiled in as constants)."""

    beta1: float
    beta2: float
    weight_decay: float
    eps: float

    @classmethod
    def of(cls, group: dict) -> Hyper:
        beta1, beta2 = group["betas"]
        return cls(beta1, beta2, group["weight_decay"], group["eps"])


def update_chunk(
    weights: Tensor, grads: Tensor, exp_avg: Quantized, exp_avg_sq: Quantized, lr: Tensor, step: Tensor, hyper: Hyper
) -> Tensor:
    """AdamW on flat fp32 `weights` and `grads` (torchao's single_param_adam, op for op): the moments are read from
    their codes and scales, updated in fp32, written back quantised in place; returns the updated weights."""
    weights = weights - lr * hyper.weight_decay * weights
    avg = exp_avg.values().lerp(grads, 1 - hyper.beta1)
    avg_sq = exp_avg_sq.values().lerp(grads.square(), 1 - hyper.beta2)
    for values, moment in ((avg, exp_avg), (avg_sq, exp_avg_sq)):
        scaled, scale = _quant.scale_tensor(values, BLOCK)
        moment.codes.copy_(_quant.quantize_8bit_with_qmap(scaled, moment.qmap))
        moment.scale.copy_(scale)
    denom = avg_sq.sqrt() / (1 - hyper.beta2**step).sqrt() + hyper.eps
    return weights - lr * (avg / (1 - hyper.beta1**step)) / denom


@dataclass(frozen=True)
class _Piece:
    """Values `own` of tensor `index` (local, flattened), staged at `staged` in a chunk."""

    index: int
    own: slice
    staged: slice


def _chunks(sizes: list[int], chunk: int) -> list[list[_Piece]]:
    """The pieces of each `chunk`-value window of the tensors of `sizes` laid end to end."""
    offsets = [0, *accumulate(sizes)]
    windows: list[list[_Piece]] = [[] for _ in range(-(-offsets[-1] // chunk))]
    for index, size in enumerate(sizes):
        begin, end = offsets[index], offsets[index] + size
        while begin < end:
            window, at = divmod(begin, chunk)
            stop = min(end, (window + 1) * chunk)
            own = slice(begin - offsets[index], stop - offsets[index])
            windows[window].append(_Piece(index, own, slice(at, at + stop - begin)))
            begin = stop
    return windows


class _FlatMoments:
    """One group's quantised moments: codes and scales of its tensors end to end, padded to whole chunks, and the
    staging buffers the chunks are updated through."""

    def __init__(self, locals_: list[Tensor]):
        device = locals_[0].device
        sizes = [local.numel() for local in locals_]
        self.offsets = [0, *accumulate(sizes)]
        total = self.offsets[-1]
        chunks = -(-total // CHUNK)  # as few as CHUNK allows, evenly sized: the padding is under a block a chunk
        self.chunk = -(-total // chunks // BLOCK) * BLOCK
        self.windows = _chunks(sizes, self.chunk)
        padded = len(self.windows) * self.chunk
        self.maps = {
            signed: torch.tensor(qmap(), dtype=torch.float32, device=device)
            for signed, qmap in ((True, _subclass.get_qmap_signed), (False, _subclass.get_qmap_unsigned))
        }
        self.codes = {signed: torch.zeros(padded, dtype=torch.uint8, device=device) for signed in (True, False)}
        self.scales = {signed: torch.zeros(padded // BLOCK, device=device) for signed in (True, False)}
        self.weights = torch.zeros(self.chunk, device=device)
        self.grads = torch.zeros(self.chunk, device=device)
        self.lr = torch.zeros((), device=device)
        self.step = torch.zeros((), device=device)

    def quantized(self, signed: bool, begin: int, end: int) -> Quantized:
        """Values [begin, end) of the flat moment (`signed`: the first moment; else the second)."""
        return Quantized(
            self.codes[signed][begin:end], self.scales[signed][begin // BLOCK : end // BLOCK], self.maps[signed]
        )

    def moment(self, index: int, shape: torch.Size, signed: bool) -> Tensor:
        """Tensor `index`'s moment: torchao's 8-bit tensor over its slice of the flat codes and scales."""
        codes, scale, qmap = self.quantized(signed, self.offsets[index], self.offsets[index + 1])
        return _subclass.OptimState8bit(codes.view(shape), scale, qmap, signed)

    def update(self, weights: list[Tensor], grads: list[Tensor], group: dict, step: float) -> None:
        """One AdamW step over the group's flat local `weights` with their flat local `grads`."""
        # One graph per group (every chunk has one shape; the scalars that change each step come in as tensors).
        # torch.compile is asked at each step, as torch reads TORCHDYNAMO_DISABLE then; it compiles once.
        compiled = torch.compile(update_chunk, fullgraph=True, dynamic=False)
        self.lr.fill_(group["lr"])
        self.step.fill_(step)
        for window, pieces in enumerate(self.windows):
            torch._foreach_copy_([self.weights[p.staged] for p in pieces], [weights[p.index][p.own] for p in pieces])
            torch._foreach_copy_([self.grads[p.staged] for p in pieces], [grads[p.index][p.own] for p in pieces])
            filled = pieces[-1].staged.stop
            if filled < self.chunk:  # the padding updates nothing: zero weights, gradients and moments
                self.weights[filled:].zero_()
                self.grads[filled:].zero_()
            begin, end = window * self.chunk, (window + 1) * self.chunk
            updated = compiled(
                self.weights,
                self.grads,
                self.quantized(True, begin, end),
                self.quantized(False, begin, end),
                self.lr,
                self.step,
                Hyper.of(group),
            )
            torch._foreach_copy_([weights[p.index][p.own] for p in pieces], [updated[p.staged] for p in pieces])


def _wrapped(local_moment: Tensor, param: Tensor) -> Tensor:
    """`local_moment` as `param` holds its values: a DTensor of the same spec where `param` is one."""
    if not isinstance(param, DTensor):
        return local_moment
    return DTensor.from_local(
        local_moment, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


class AdamW8bit(torch.optim.Optimizer):
    """AdamW over `groups` (llmtrain/optim/groups.py) with 8-bit moments (see the module's docstring). Its state
    exists from construction, every tensor's (a checkpoint's load reads into it: see load_state_dict)."""

    def __init__(self, groups: list[dict], optim_cfg):
        defaults = dict(**adamw_options(optim_cfg), weight_decay=0.0)
        super().__init__(groups, defaults)
        self._quantized = [[p for p in group["params"] if is_quantized(_local(p))] for group in self.param_groups]
        self._small = [[p for p in group["params"] if not is_quantized(_local(p))] for group in self.param_groups]
        self._flat = [_FlatMoments([_local(p) for p in params]) if params else None for params in self._quantized]
        for params, flat in zip(self._quantized, self._flat):
            for index, param in enumerate(params):
                assert flat is not None
                shape = _local(param).shape
                self.state[param] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": _wrapped(flat.moment(index, shape, True), param),
                    "exp_avg_sq": _wrapped(flat.moment(index, shape, False), param),
                }
        for params in self._small:
            for param in params:
                adamw_state(self.state[param], param, fused_for(params))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Each group's quantised tensors chunk by chunk, its others by torch's fused AdamW."""
        for group, quantized, small, flat in zip(self.param_groups, self._quantized, self._small, self._flat):
            if flat is not None:
                self._step_quantized(group, flat, quantized)
            stepped = [p for p in small if p.grad is not None]
            if stepped:
                states = [adamw_state(self.state[p], p, fused_for(small)) for p in stepped]
                adamw_update(
                    group,
                    stepped,
                    [p.grad for p in stepped],
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    [s["step"] for s in states],
                )

    def _step_quantized(self, group: dict, flat: _FlatMoments, params: list[Tensor]) -> None:
        """The flat update, where every tensor has a gradient and all are at one step; else tensor by tensor."""
        steps = [self.state[p]["step"] for p in params]
        lockstep = all(p.grad is not None for p in params) and len({float(s) for s in steps}) == 1
        if lockstep:
            torch._foreach_add_(steps, 1.0)
            weights = [_local(p).view(-1) for p in params]
            grads = [_local(p.grad).view(-1) for p in params if p.grad is not None]
            flat.update(weights, grads, group, float(steps[0]))
            return
        for index, param in enumerate(params):  # a tensor without a gradient is skipped, as torch's AdamW skips it
            if param.grad is None:
                continue
            self.state[param]["step"] += 1
            local = _local(param)
            span = flat.offsets[index], flat.offsets[index + 1]
            updated = update_chunk(
                local.detach().float().view(-1),
                _local(param.grad).float().view(-1),
                flat.quantized(True, *span),
                flat.quantized(False, *span),
                torch.tensor(group["lr"]),
                self.state[param]["step"],
                Hyper.of(group),
            )
            local.copy_(updated.view(local.shape))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's format (fp32 moments, state_bits.py), quantised into the flat buffers in place."""
        load_in_place(self, state_dict, self.state.__getitem__)
