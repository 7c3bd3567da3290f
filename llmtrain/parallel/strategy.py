"""What a parallel layout provides to the trainer: the model laid out and materialised (`parallelize`), the
optimizer, and per step forward/backward, reductions, clipping, and the state for checkpoints. The trainer calls
these methods and never asks which layout it runs; each layout (layouts.py, pipeline/) overrides only what it
changes. How a layout is applied to the model is parallelize.py's linear sequence of steps."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from llmtrain.config import OptimConfig
from llmtrain.model import LayeredModel, ParameterInit, auxiliary_loss_scale, cross_entropy_loss, materialize
from llmtrain.optim import build_adamw
from llmtrain.parallel.context import shard_tokens
from llmtrain.parallel.fsdp import expert_fsdp_mesh
from llmtrain.parallel.mesh import build_expert_mesh, build_mesh, mean_over
from llmtrain.parallel.parallelize import Layout, apply_layout
from llmtrain.parallel.precision import PrecisionContext, precision_policy, uses_bf16
from llmtrain.parallel.tp import loss_context
from llmtrain.plan import ParallelPlan
from llmtrain.runtime import Runtime, join_single_process_group

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]
_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


class Strategy:
    """Base layout: the mesh of a checked `plan` (llmtrain/plan.py) on this rank, and what the trainer calls. The
    plan is whole and checked before the strategy exists; this adds where the rank sits and what runs."""

    def __init__(self, plan: ParallelPlan, runtime: Runtime):
        self.plan, self.runtime = plan, runtime
        self.parallel, self.train, self.degrees = plan.parallel, plan.train, plan.degrees
        self.mesh: DeviceMesh | None = None
        self.dp_mesh: DeviceMesh | None = None
        self.expert_mesh: DeviceMesh | None = None
        if runtime.world_size == 1 and plan.dims:
            join_single_process_group(runtime)  # every degree is 1: the layout runs as one rank of many would
        if runtime.world_size > 1 or plan.dims:
            self.mesh = build_mesh(self.degrees, runtime.device.type)
            # One flat data-parallel dimension over replicas and shards: the group the loss is averaged over.
            self.dp_mesh = self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
            if self.degrees.ep > 1:
                self.expert_mesh = build_expert_mesh(self.degrees, runtime.device.type)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh of a multi-process layout (a single process has none)."""
        if self.mesh is None:
            raise RuntimeError(f"parallel.strategy={self.name} needs a mesh, which a single process does not have")
        return self.mesh

    @property
    def _dp_group(self) -> dist.ProcessGroup:
        """The data-parallel ranks' process group (replicas and shards together)."""
        if self.dp_mesh is None:
            raise RuntimeError(f"parallel.strategy={self.name} needs a mesh, which a single process does not have")
        return self.dp_mesh.get_group()

    # -- layout ---------------------------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    def _layout(self) -> Layout:
        """The steps apply_layout takes on this rank's model: tensor parallelism over the tp dimension when it has
        one, activation checkpointing and compilation as train.* asks; layouts that shard add FSDP."""
        return self._base_layout()

    @functools.cached_property
    def _planned_layout(self) -> Layout:
        """`_layout()`, made once (its meshes are sliced once) and read by `parallelize` and `precision`."""
        return self._layout()

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The context-parallel dimension, when sequences are split (parallel.cp > 1)."""
        return self.device_mesh["cp"] if self.degrees.cp > 1 else None

    def _context_shard(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of every sequence of `tokens` (batch, seq): all of it without context parallelism."""
        cp = self.cp_mesh
        return tokens if cp is None else shard_tokens(tokens, cp.size(), cp.get_local_rank())

    def _base_layout(self, **fsdp) -> Layout:
        tp = self.degrees.tp > 1
        if self.expert_mesh is not None:  # the plan allows ep only where FSDP shards (so `fsdp` is set)
            fsdp.update(
                ep_mesh=self.expert_mesh["ep", "tp"] if self.degrees.tp > 1 else self.expert_mesh["ep"],
                expert_fsdp_mesh=expert_fsdp_mesh(self.expert_mesh, self.degrees),
                data_parallel_size=self.degrees.dp * self.degrees.cp,
            )
        bf16 = uses_bf16(self.train.precision, self.runtime.device)
        return Layout(
            cp_mesh=self.cp_mesh,
            tp_mesh=self.device_mesh["tp"] if tp else None,
            sequence_parallel=tp and self.parallel.sequence_parallel,
            loss_parallel=tp and self.parallel.loss_parallel,
            activation_checkpointing=self.train.activation_checkpointing,
            compile=self.train.compile,
            param_dtype=torch.bfloat16 if bf16 else None,
            cpu_offload=self.parallel.cpu_offload,
            **fsdp,
        )

    @property
    def _init_device(self) -> torch.device:
        """Where parameters live: the device, or host memory when FSDP offloads them."""
        return torch.device("cpu") if self.parallel.cpu_offload else self.runtime.device

    def parallelize(self, model: LayeredModel, init: ParameterInit) -> nn.Module:
        """Lay out `model` (built on the meta device), allocate and initialise this rank's part of it, and return
        what the trainer runs."""
        apply_layout(model, self._planned_layout)
        materialize(model, self._init_device, init)
        return self._wrap(model)

    def precision(self) -> tuple[PrecisionContext, str]:
        """The forward passes' precision context and its description (parallel/precision.py: FSDP's mixed
        precision where the layout applies it, autocast elsewhere)."""
        layout = self._planned_layout
        fsdp_mixed_precision = layout.fsdp_mesh is not None and layout.param_dtype is not None
        return precision_policy(
            self.runtime.device, uses_bf16(self.train.precision, self.runtime.device), fsdp_mixed_precision
        )

    def _wrap(self, model: LayeredModel) -> nn.Module:
        """A wrapper that needs the materialised weights (DDP), or the model itself."""
        return model

    def build_optimizer(self, model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
        return build_adamw(model, optim)

    # -- one step -------------------------------------------------------------------------------------------
    def loss_context(self) -> AbstractContextManager:
        """Context around the loss and its backward (tensor parallelism computes it on vocabulary shards)."""
        return loss_context(self.degrees.tp, self.parallel.loss_parallel)

    def _grad_sync(self, model: nn.Module, is_last_micro_batch: bool) -> AbstractContextManager:
        """Context for one micro-batch's forward + backward; layouts that reduce gradients skip all but the last."""
        return nullcontext()

    def forward_backward(
        self, model: nn.Module, micro_batches: MicroBatches, precision: PrecisionContext
    ) -> torch.Tensor:
        """Accumulate gradients of the mean loss over this rank's micro-batches; return that mean (detached)."""
        total = torch.zeros((), device=self.runtime.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            inputs, targets = self._context_shard(inputs), self._context_shard(targets)
            with self._grad_sync(model, is_last_micro_batch=i == len(micro_batches) - 1), self.loss_context():
                with precision(), auxiliary_loss_scale(1 / len(micro_batches)):
                    loss = cross_entropy_loss(model(inputs.to(self.runtime.device)), targets.to(self.runtime.device))
                (loss / len(micro_batches)).backward()
            total += full_tensor(loss.detach())
        return mean_over(total / len(micro_batches), self.cp_mesh)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, micro_batches: MicroBatches, precision: PrecisionContext) -> torch.Tensor:
        total = torch.zeros((), device=self.runtime.device)
        for inputs, targets in micro_batches:
            inputs, targets = self._context_shard(inputs), self._context_shard(targets)
            with precision(), self.loss_context():
                total += full_tensor(
                    cross_entropy_loss(model(inputs.to(self.runtime.device)), targets.to(self.runtime.device))
                )
        return mean_over(total / len(micro_batches), self.cp_mesh)

    def expert_load(self, model: nn.Module) -> torch.Tensor | None:
        """Collective: slots routed to each expert this step over the whole global batch and every mixture block
        (None for a dense model). Ranks hold different tokens (data, context parallel) or blocks (pipeline) and
        their counts add up; tensor-parallel ranks route the same tokens, so their sum is divided by tp."""
        load = unwrap(model).take_expert_load()
        if load is None or self.mesh is None:
            return load
        load = load.to(self.runtime.device, torch.float64)
        dist.all_reduce(load)
        return load / self.degrees.tp

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a per-rank scalar over the data-parallel ranks (each holds an equal share of the batch)."""
        return mean_over(value, self.dp_mesh)

    def _grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global gradient norm (over all ranks' shards and stages)."""
        return squared_norm(grads_by_layout(model.parameters())).sqrt()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` (0: measure only) and return the global gradient norm before clipping."""
        replicate_partial_gradients(model.parameters())
        norm = self._grad_norm(model)
        clip_gradients(model.parameters(), max_norm, norm)
        return norm

    # -- results --------------------------------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's weights as full CPU tensors under the unsplit model's names, on rank 0
        (None on the other ranks), whatever the layout holds (replicas, ZeRO-1 buffers, FSDP shards). Gathered
        one tensor at a time: the other ranks drop each one as soon as it is gathered."""
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast(dict[str, torch.Tensor], state) if self.runtime.is_main else None

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> CheckpointState:
        """Model and optimizer state as this rank holds it (DTensor shards where sharded), keyed by the unsplit
        model's parameter names (the optimizer's flattened: "state.<param>.exp_avg"), so that a checkpoint saved
        under one layout loads under any other. DCP saves it, or loads into it in place.

        A tied parameter (the LM head's weight is the embedding matrix: one tensor in one model, equal copies on
        two pipeline stages) is stored once, under its source's names, and handed back to every parameter that
        uses it on load."""
        model_state, optimizer_state = self._model_and_optimizer_state(model, optimizer)
        tied = unwrap(model).tied_parameters
        state = CheckpointState({}, {})
        for part, values in (("model", model_state), ("optimizer", optimizer_state)):
            state.values[part], state.stored_as[part] = _store_tied_once(values, tied)
        return state

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: CheckpointState) -> None:
        """Put a `checkpoint_state` whose values DCP has filled back into the model and optimizer."""
        restored = (_restore_tied(state.values[part], state.stored_as[part]) for part in ("model", "optimizer"))
        self._load_model_and_optimizer_state(model, optimizer, *restored)

    def _model_and_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        return (get_model_state_dict(model), get_optimizer_state_dict(model, optimizer, options=_FLAT_OPTIMIZER))

    def _load_model_and_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict
    ) -> None:
        set_model_state_dict(model, model_state)
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=_FLAT_OPTIMIZER)

    def report(self, run_dir: str) -> dict:
        """Collective, after training: what this layout measured, for the end summary (rank 0 may also write
        files into run_dir); {} on the other ranks."""
        return {}


@dataclass(frozen=True)
class CheckpointState:
    """What DCP saves, or loads in place (`values`: "model" and "optimizer" state), and for each part which keys of
    this rank's state each stored key stands for (a tied parameter is stored once)."""

    values: dict[str, dict]
    stored_as: dict[str, dict[str, list[str]]]


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


def _store_tied_once(values: dict, tied: dict[str, str]) -> tuple[dict, dict[str, list[str]]]:
    """`values` with every key of a tied parameter folded into its source's twin (one kept when a rank holds
    both), and which original keys each stored key stands for."""
    stored: dict = {}
    stands_for: dict[str, list[str]] = {}
    for key, value in values.items():
        name = key
        for tied_name, source in tied.items():
            name = name.replace(tied_name, source)
        stands_for.setdefault(name, []).append(key)
        stored.setdefault(name, value)
    return stored, stands_for


def _restore_tied(stored: dict, stands_for: dict[str, list[str]]) -> dict:
    """The inverse of _store_tied_once, after loading: a second key gets its own copy of the tensor."""
    values = {}
    for name, keys in stands_for.items():
        for i, key in enumerate(keys):
            value = stored[name]
            values[key] = value.clone() if i and torch.is_tensor(value) else value
    return values
