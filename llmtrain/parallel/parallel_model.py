"""A model laid out over this rank's mesh, whole when constructed: its modules allocated and initialised, its
optimizer, its precision; per step forward/backward, reductions, clipping, and its state for checkpoints. The
trainer calls these methods and never asks which layout it runs. One class for every layout: what differs is held,
not overridden: the data-parallel mechanism (data_parallel.py) and the executor that runs the step's micro-batches
(executor.py: accumulation.py's, or for a pipelined layout pipelined.py's), each made whole before the model
is; what every executor does alike to a step is step_setup.py's; how the modules are laid out is layout.py's linear
sequence of steps."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from llmtrain.catalog import layout_spec
from llmtrain.config import OptimConfig
from llmtrain.model import LayeredModel, Materializer, ParameterInit, materialize
from llmtrain.model.quantize import dequantized, is_nf4
from llmtrain.model.scoring import NO_MARKS, RowStatistic, TokenMarks
from llmtrain.parallel.accumulation import Accumulation
from llmtrain.parallel.data_parallel import DataParallel
from llmtrain.parallel.executor import Executor
from llmtrain.parallel.float8 import float8_summary, precompute_scales_after_step
from llmtrain.parallel.layout import COMPILED_AS, compile_unit, layout_steps
from llmtrain.parallel.mesh import RankMesh, mean_over, sum_over
from llmtrain.parallel.precision import precision_policy, uses_bf16
from llmtrain.parallel.step_setup import StepSetup
from llmtrain.parallel.tensors import MicroBatches
from llmtrain.parallel_plan import ParallelPlan
from llmtrain.process.runtime import Runtime


def data_parallel_class(name: str) -> type[DataParallel]:
    """The mechanism class of layout `name`'s row (llmtrain/catalog/layouts.py), imported when a run asks for it."""
    module, _, class_name = layout_spec(name).mechanism.implementation.partition(":")
    return getattr(importlib.import_module(module), class_name)


class ParallelModel:
    """The model of a checked `plan` (llmtrain/parallel_plan.py) laid out over this rank's `mesh`, allocated and
    initialised on this rank (`model` arrives on the meta device; `init` fills what this rank holds), with its
    optimizer over `optim`.

    What the trainer, checkpointing, evaluation and the tools use: `name`, `plan`, `mesh`, `runtime`, `executor`
    (how the step runs: executor.py), `module` (what runs: the model, its DDP wrapper, or this rank's pipeline
    part), `optimizer`, `precision` (the forward passes' context) and `precision_description`; per step
    `forward_backward`, `clip_grad_norm`, `reduce_mean`, `expert_load`; forward only `evaluate`, `row_sums`,
    `loss_context`; state `tied_parameters`, `full_state_dict`, `model_and_optimizer_state` and its load,
    `model_state` and its load; `report` at the end."""

    def __init__(
        self,
        plan: ParallelPlan,
        mesh: RankMesh,
        runtime: Runtime,
        model: LayeredModel,
        init: ParameterInit,
        optim: OptimConfig,
        materializer: Materializer = materialize,
        marks: TokenMarks = NO_MARKS,
    ):
        self.plan, self.mesh, self.runtime = plan, mesh, runtime
        steps = layout_steps(plan, mesh, runtime.device)
        bf16 = uses_bf16(plan.train.precision, runtime.device)
        fsdp_mixed_precision = steps.fsdp_mesh is not None and steps.param_dtype is not None
        self.precision, self.precision_description = precision_policy(runtime.device, bf16, fsdp_mixed_precision)
        self._setup = StepSetup.of(plan, mesh, runtime, self.precision, marks)
        # Where parameters live: the device, or host memory when FSDP offloads them.
        init_device = torch.device("cpu") if plan.parallel.cpu_offload else runtime.device

        def allocate(module: nn.Module) -> None:
            materializer(module, init_device, init)

        self._data_parallel = data_parallel_class(plan.name)(mesh, runtime, plan.parallel)
        self.executor: Executor
        if plan.pipelined:  # imported only where a run pipelines: torch's pipelining costs a process ~0.7 s
            from llmtrain.parallel.pipelined import Pipeline

            self.executor = Pipeline(self._setup, model, steps, allocate)
        else:
            self.executor = Accumulation(self._setup, model, steps, allocate, self._data_parallel)
        self.module = self.executor.module
        # Muon's Newton-Schulz runs in the run's compute precision.
        self.optimizer = self._data_parallel.build_optimizer(
            self.module, optim, torch.bfloat16 if bf16 else torch.float32
        )
        self._precompute_float8_scales: Callable[[], None] | None = None
        if steps.float8 is not None and steps.float8.fsdp_all_gather:
            self._precompute_float8_scales = precompute_scales_after_step(self.optimizer, self.module)
        frozen = [param for param in self.module.parameters() if not param.requires_grad and param.ndim == 2]
        if frozen and all(param.dtype == torch.bfloat16 for param in frozen):
            self.precision_description += "; the frozen base held in bf16"
        if quantized := sum(is_nf4(param) for param in frozen):
            self.precision_description += f"; {quantized} of its {len(frozen)} weight matrices in NF4"
        if steps.float8 is not None:
            self.precision_description += "; " + float8_summary(steps.float8, self.module)
        if steps.compile != "none":
            unit = compile_unit(steps.compile, model)
            loss = ", the loss apart" if self._setup.compiles_loss else ""
            self.precision_description += f"; compiled {COMPILED_AS[unit]}{loss}"

    @property
    def name(self) -> str:
        return self.plan.name

    # -- one step -------------------------------------------------------------------------------------------
    def loss_context(self) -> AbstractContextManager:
        """Context around the loss and its backward (tensor parallelism computes it on vocabulary shards)."""
        return self._setup.loss_context()

    def forward_backward(self, micro_batches: MicroBatches) -> torch.Tensor:
        """Accumulate gradients of the mean loss over this rank's micro-batches; return that mean (detached)."""
        mean = self.executor.forward_backward(self._setup.scored(micro_batches))
        self._data_parallel.after_backward(self.optimizer)
        return mean_over(mean, self.mesh.cp_mesh)

    @torch.no_grad()
    def evaluate(self, micro_batches: MicroBatches) -> torch.Tensor:
        """The mean loss over this rank's micro-batches, without gradients."""
        micro_batches = self._setup.scored(micro_batches)
        scale = self._setup.loss_scale(micro_batches, len(micro_batches))

        def mean(losses: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack(losses).mean() if losses else torch.zeros((), device=self.runtime.device)

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return self._setup.cross_entropy(logits, targets) * scale

        return mean_over(self.executor.forward_only(micro_batches, loss, mean), self.mesh.cp_mesh)

    @torch.no_grad()
    def row_sums(self, micro_batches: MicroBatches, statistic: RowStatistic) -> torch.Tensor:
        """(rows, statistic.columns) over this rank's micro-batches, row by row: `statistic` summed over each row's
        scored targets (those not UNSCORED; llmtrain/model/scoring.py), whole rows whatever the layout splits them
        into."""
        rows = sum(len(inputs) for inputs, _ in micro_batches)

        def stacked(sums: list[torch.Tensor]) -> torch.Tensor:
            if sums:
                return torch.cat(sums)
            return torch.zeros(rows, statistic.columns, dtype=torch.float64, device=self.runtime.device)

        return sum_over(self.executor.forward_only(micro_batches, statistic.compute, stacked), self.mesh.cp_mesh)

    def expert_load(self) -> torch.Tensor | None:
        """Collective: slots routed to each expert this step over the whole global batch and every mixture block
        (None for a dense model). Ranks hold different tokens (data, context parallel) or blocks (pipeline) and
        their counts add up; tensor-parallel ranks route the same tokens, so their sum is divided by tp."""
        load = unwrap(self.module).take_expert_load(self.runtime.device)
        if load is None or not self.mesh.splits:
            return load
        load = load.to(self.runtime.device, torch.float64)
        dist.all_reduce(load)
        return load / self.plan.degrees.tp

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a per-rank scalar over the data-parallel ranks (each holds an equal share of the batch)."""
        return mean_over(value, self.mesh.dp_mesh)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` (0: measure only) and return the global gradient norm before clipping."""
        return self._data_parallel.clip_grad_norm(self.module, self.optimizer, max_norm, self.executor.grad_norm)

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def tied_parameters(self) -> dict[str, str]:
        """Parameter name -> the name of the parameter it is a copy of (the LM head's weight is the embedding)."""
        return unwrap(self.module).tied_parameters

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's weights as full CPU tensors under the unsplit model's names, on rank 0
        (None on the other ranks), whatever the layout holds (replicas, ZeRO-1 buffers, FSDP shards, stages).
        Gathered one tensor at a time: the other ranks drop each one as soon as it is gathered. An NF4 base
        (model.quantize_base) is written dequantised, as the model computes with it: any unsplit model loads it."""
        state = self.executor.full_state_dict()
        # NF4 shards are gathered part by part through functional collectives that nothing waits for by name;
        # gloo's barrier waits for every collective of its group issued before it, so none is left in flight
        for group in {id(p.device_mesh): p.device_mesh.get_group() for p in self.module.parameters()
                      if is_nf4(p) and isinstance(p, DTensor)}.values():  # fmt: skip
            dist.barrier(group=group)
        return None if state is None else {name: dequantized(tensor) for name, tensor in state.items()}

    def model_and_optimizer_state(self) -> tuple[dict, dict]:
        """Model and optimizer state as this rank holds it (DTensor shards where sharded), keyed by the unsplit
        model's parameter names (the optimizer's flattened: "state.<param>.exp_avg"), so that a checkpoint saved
        under one layout loads under any other (llmtrain/checkpoint/state.py)."""
        return self._data_parallel.state(self.module, self.optimizer)

    def load_model_and_optimizer_state(self, model_state: dict, optimizer_state: dict) -> None:
        """The inverse of model_and_optimizer_state, once a checkpoint's values have been loaded into it."""
        self._data_parallel.load_state(self.module, self.optimizer, model_state, optimizer_state)
        self._weights_set()

    def model_state(self) -> dict:
        """The model's part of model_and_optimizer_state (evaluation loads the weights alone)."""
        return get_model_state_dict(self.module)

    def load_model_state(self, model_state: dict) -> None:
        """The inverse of model_state: the weights set, the optimizer left as built."""
        set_model_state_dict(self.module, model_state)
        self._weights_set()

    def _weights_set(self) -> None:
        """After weights were set other than by a step: what was derived from them follows (float8 scales)."""
        if self._precompute_float8_scales is not None:
            self._precompute_float8_scales()

    def report(self, run_dir: str) -> dict:
        """Collective, after training: what this layout measured, for the end summary (rank 0 may also write
        files into run_dir); {} on the other ranks."""
        return self.executor.report(run_dir)


def unwrap(model: nn.Module) -> LayeredModel:
    """The model inside a DDP wrapper."""
    return cast(LayeredModel, getattr(model, "module", model))
