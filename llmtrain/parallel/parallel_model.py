"""A model laid out over this rank's mesh, whole when constructed: its modules allocated and initialised, its
optimizer, its precision; per step forward/backward, reductions, clipping, and its state for checkpoints. The
trainer calls these methods and never asks which layout it runs; each layout (data_parallel.py, pipeline/)
overrides only what it changes. How a layout is applied to the modules is layout.py's linear sequence of steps."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate

from llmtrain.config import OptimConfig
from llmtrain.model import (
    LayeredModel,
    ParameterInit,
    auxiliary_loss_scale,
    cross_entropy_loss,
    materialize,
)
from llmtrain.model.scoring import RowStatistic
from llmtrain.optim import build_optimizer
from llmtrain.optim.state_bits import portable_state, restore_low_bits
from llmtrain.parallel.context import shard_tokens
from llmtrain.parallel.float8 import float8_summary, precompute_scales_after_step
from llmtrain.parallel.layout import apply_layout, layout_steps
from llmtrain.parallel.mesh import RankMesh, mean_over, sum_over
from llmtrain.parallel.precision import precision_policy, uses_bf16
from llmtrain.parallel.tp import loss_context
from llmtrain.plan import ParallelPlan
from llmtrain.runtime import Runtime

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]
Statistic = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> a micro-batch's number(s)
_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


class ParallelModel:
    """The base layout (`single`, and `tp` wherever parallel.tp > 1): the model of a checked `plan`
    (llmtrain/plan.py) laid out over `mesh`, allocated and initialised on this rank (`model` arrives on the meta
    device; `init` fills what this rank holds), with its optimizer over `optim`.

    `module` is what runs (the model, its DDP wrapper, or this rank's pipeline part); `optimizer` steps it;
    `precision` is the forward passes' context, `precision_description` says what it does."""

    def __init__(
        self,
        plan: ParallelPlan,
        mesh: RankMesh,
        runtime: Runtime,
        model: LayeredModel,
        init: ParameterInit,
        optim: OptimConfig,
    ):
        self.plan, self.mesh, self.runtime = plan, mesh, runtime
        self.parallel, self.train, self.degrees = plan.parallel, plan.train, plan.degrees
        self.layout = layout_steps(plan, mesh, runtime.device)
        self.module = self._laid_out(model, init)
        self.optimizer = self._optimizer(optim)
        if self.layout.float8 is not None and self.layout.float8.fsdp_all_gather:
            precompute_scales_after_step(self.optimizer, self.module)
        fsdp_mixed_precision = self.layout.fsdp_mesh is not None and self.layout.param_dtype is not None
        self.precision, self.precision_description = precision_policy(
            runtime.device, uses_bf16(self.train.precision, runtime.device), fsdp_mixed_precision
        )
        if self.layout.float8 is not None:
            self.precision_description += "; " + float8_summary(self.layout.float8, self.module)

    @property
    def name(self) -> str:
        return self.plan.name

    # -- construction ---------------------------------------------------------------------------------------
    @property
    def _init_device(self) -> torch.device:
        """Where parameters live: the device, or host memory when FSDP offloads them."""
        return torch.device("cpu") if self.parallel.cpu_offload else self.runtime.device

    def _laid_out(self, model: LayeredModel, init: ParameterInit) -> nn.Module:
        """`model` laid out, this rank's part of it allocated and initialised, wrapped when the layout wraps."""
        apply_layout(model, self.layout)
        materialize(model, self._init_device, init)
        return self._wrap(model)

    def _wrap(self, model: LayeredModel) -> nn.Module:
        """A wrapper that needs the materialised weights (DDP), or the model itself."""
        return model

    def _optimizer(self, optim: OptimConfig) -> torch.optim.Optimizer:
        return build_optimizer(self.module, optim, self._ns_dtype, self.runtime.device)

    @property
    def _ns_dtype(self) -> torch.dtype:
        """Muon's Newton-Schulz precision: the run's compute precision."""
        return torch.bfloat16 if uses_bf16(self.train.precision, self.runtime.device) else torch.float32

    # -- one step -------------------------------------------------------------------------------------------
    def _context_shard(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of every sequence of `tokens` (batch, seq): all of it without context parallelism."""
        cp = self.mesh.cp_mesh
        return tokens if cp is None else shard_tokens(tokens, cp.size(), cp.get_local_rank())

    def loss_context(self) -> AbstractContextManager:
        """Context around the loss and its backward (tensor parallelism computes it on vocabulary shards)."""
        return loss_context(self.degrees.tp, self.parallel.loss_parallel)

    def _grad_sync(self, is_last_micro_batch: bool) -> AbstractContextManager:
        """Context for one micro-batch's forward + backward; layouts that reduce gradients skip all but the last."""
        return nullcontext()

    def forward_backward(self, micro_batches: MicroBatches) -> torch.Tensor:
        """Accumulate gradients of the mean loss over this rank's micro-batches; return that mean (detached)."""
        device, count = self.runtime.device, len(micro_batches)
        total = torch.zeros((), device=device)
        for i, (inputs, targets) in enumerate(micro_batches):
            inputs, targets = self._context_shard(inputs), self._context_shard(targets)
            with self._grad_sync(is_last_micro_batch=i == count - 1), self.loss_context():
                with self.precision(), auxiliary_loss_scale(1 / count):
                    loss = cross_entropy_loss(self.module(inputs.to(device)), targets.to(device))
                (loss / count).backward()
            total += full_tensor(loss.detach())
        return mean_over(total / count, self.mesh.cp_mesh)

    @torch.no_grad()
    def evaluate(self, micro_batches: MicroBatches) -> torch.Tensor:
        """The mean loss over this rank's micro-batches, without gradients."""
        means = self._forward_only(micro_batches, cross_entropy_loss)
        return mean_over(torch.stack(means).mean(), self.mesh.cp_mesh)

    @torch.no_grad()
    def row_sums(self, micro_batches: MicroBatches, statistic: RowStatistic) -> torch.Tensor:
        """(rows, statistic.columns) over this rank's micro-batches, row by row: `statistic` summed over each row's
        scored targets (those not UNSCORED; llmtrain/model/scoring.py), whole rows whatever the layout splits them
        into."""
        sums = torch.cat(self._forward_only(micro_batches, statistic.compute))
        return sum_over(sums, self.mesh.cp_mesh)

    def _forward_only(self, micro_batches: MicroBatches, statistic: Statistic) -> list[torch.Tensor]:
        """`statistic(logits, targets)` of each micro-batch (this rank's part of each sequence)."""
        device, results = self.runtime.device, []
        for inputs, targets in micro_batches:
            inputs, targets = self._context_shard(inputs), self._context_shard(targets)
            with self.precision(), self.loss_context():
                results.append(full_tensor(statistic(self.module(inputs.to(device)), targets.to(device))))
        return results

    def expert_load(self) -> torch.Tensor | None:
        """Collective: slots routed to each expert this step over the whole global batch and every mixture block
        (None for a dense model). Ranks hold different tokens (data, context parallel) or blocks (pipeline) and
        their counts add up; tensor-parallel ranks route the same tokens, so their sum is divided by tp."""
        load = unwrap(self.module).take_expert_load(self.runtime.device)
        if load is None or not self.mesh.splits:
            return load
        load = load.to(self.runtime.device, torch.float64)
        dist.all_reduce(load)
        return load / self.degrees.tp

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a per-rank scalar over the data-parallel ranks (each holds an equal share of the batch)."""
        return mean_over(value, self.mesh.dp_mesh)

    def _grad_norm(self) -> torch.Tensor:
        """The global gradient norm (over all ranks' shards and stages)."""
        return squared_norm(grads_by_layout(self.module.parameters())).sqrt()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` (0: measure only) and return the global gradient norm before clipping."""
        replicate_partial_gradients(self.module.parameters())
        norm = self._grad_norm()
        clip_gradients(self.module.parameters(), max_norm, norm)
        return norm

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def tied_parameters(self) -> dict[str, str]:
        """Parameter name -> the name of the parameter it is a copy of (the LM head's weight is the embedding)."""
        return unwrap(self.module).tied_parameters

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's weights as full CPU tensors under the unsplit model's names, on rank 0
        (None on the other ranks), whatever the layout holds (replicas, ZeRO-1 buffers, FSDP shards). Gathered
        one tensor at a time: the other ranks drop each one as soon as it is gathered."""
        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast(dict[str, torch.Tensor], state) if self.runtime.is_main else None

    def model_and_optimizer_state(self) -> tuple[dict, dict]:
        """Model and optimizer state as this rank holds it (DTensor shards where sharded), keyed by the unsplit
        model's parameter names (the optimizer's flattened: "state.<param>.exp_avg"), so that a checkpoint saved
        under one layout loads under any other (llmtrain/checkpoint/state.py)."""
        return (
            get_model_state_dict(self.module),
            portable_state(get_optimizer_state_dict(self.module, self.optimizer, options=_FLAT_OPTIMIZER)),
        )

    def load_model_and_optimizer_state(self, model_state: dict, optimizer_state: dict) -> None:
        """The inverse of model_and_optimizer_state, once a checkpoint's values have been loaded into it."""
        set_model_state_dict(self.module, model_state)
        set_optimizer_state_dict(self.module, self.optimizer, optimizer_state, options=_FLAT_OPTIMIZER)
        restore_low_bits(self.optimizer)

    def model_state(self) -> dict:
        """The model's part of model_and_optimizer_state (evaluation loads the weights alone)."""
        return get_model_state_dict(self.module)

    def load_model_state(self, model_state: dict) -> None:
        """The inverse of model_state: the weights set, the optimizer left as built."""
        set_model_state_dict(self.module, model_state)

    def report(self, run_dir: str) -> dict:
        """Collective, after training: what this layout measured, for the end summary (rank 0 may also write
        files into run_dir); {} on the other ranks."""
        return {}


def unwrap(model: nn.Module) -> LayeredModel:
    """The model inside a DDP wrapper."""
    return cast(LayeredModel, getattr(model, "module", model))


def params_by_layout(params: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters with gradients, grouped by how the gradients are laid out (plain, or DTensor mesh +
    placements): a norm or a scaling over one group is one foreach operation (and one reduction), and layouts mix
    in one model (tensor-parallel weights beside replicated LayerNorms)."""
    groups: dict[object, list[nn.Parameter]] = {}
    for param in params:
        grad = param.grad
        if grad is not None:
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            groups.setdefault(key, []).append(param)
    return list(groups.values())


def grads_by_layout(params: Iterable[nn.Parameter]) -> list[list[torch.Tensor]]:
    return [[param.grad for param in group if param.grad is not None] for group in params_by_layout(params)]


def squared_norm(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    return torch.stack([full_tensor(torch.nn.utils.get_total_norm(grads)) ** 2 for grads in groups]).sum()


def replicate_partial_gradients(params: Iterable[nn.Parameter]) -> None:
    """Sum, once, the gradients that tensor parallelism leaves as partial sums (replicated weights applied to
    sequence shards: LayerNorms, the position embedding). Left partial, every later read of them (the norm, the
    clip, each of AdamW's updates) would all-reduce them again."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements):
            placements = [Replicate() if placement.is_partial() else placement for placement in grad.placements]
            param.grad = grad.redistribute(grad.device_mesh, placements)


def clip_gradients(params: Iterable[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients by min(1, max_norm / (norm + 1e-6)), torch's clip_grad_norm_ formula, given the
    global norm; on the device, without a host sync. max_norm 0: leave them."""
    if max_norm > 0:
        for group in params_by_layout(params):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered (a loss computed on vocabulary shards is a replicated DTensor)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
