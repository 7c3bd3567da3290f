"""A model laid out over this rank's mesh, whole when constructed: its modules allocated and initialised, its
optimizer, its precision; per step forward/backward, reductions, clipping, and its state for checkpoints. The
trainer calls these methods and never asks which layout it runs. One class for every layout: what differs is held,
not overridden: the data-parallel mechanism (data_parallel.py) and, for a pipelined layout, the pipeline
(pipeline/pipeline.py), each made whole before the model is; how the modules are laid out is layout.py's linear
sequence of steps."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from llmtrain.catalog import layout_spec
from llmtrain.config import OptimConfig
from llmtrain.errors import ConfigError
from llmtrain.model import (
    LayeredModel,
    Materializer,
    ParameterInit,
    auxiliary_loss_scale,
    materialize,
    summed_cross_entropy,
)
from llmtrain.model.documents import document_starts
from llmtrain.model.scoring import UNSCORED, RowStatistic
from llmtrain.parallel.context import shard_tokens
from llmtrain.parallel.data_parallel import DataParallel
from llmtrain.parallel.float8 import float8_summary, precompute_scales_after_step
from llmtrain.parallel.layout import apply_layout, layout_steps
from llmtrain.parallel.mesh import RankMesh, mean_over, sum_over
from llmtrain.parallel.precision import precision_policy, uses_bf16
from llmtrain.parallel.tensors import MicroBatches, Statistic, full_tensor, grads_by_layout, squared_norm
from llmtrain.parallel.tp import loss_context
from llmtrain.plan import ParallelPlan
from llmtrain.runtime import Runtime

if TYPE_CHECKING:
    from llmtrain.parallel.pipeline.pipeline import Pipeline


def data_parallel_class(name: str) -> type[DataParallel]:
    """The mechanism class of layout `name`'s row (llmtrain/catalog.py), imported when a run asks for it."""
    module, _, class_name = layout_spec(name).mechanism.implementation.partition(":")
    return getattr(importlib.import_module(module), class_name)


class ParallelModel:
    """The model of a checked `plan` (llmtrain/plan.py) laid out over this rank's `mesh`, allocated and initialised
    on this rank (`model` arrives on the meta device; `init` fills what this rank holds), with its optimizer over
    `optim`.

    What the trainer, checkpointing, evaluation and the tools use: `name`, `plan`, `mesh`, `runtime`, `module`
    (what runs: the model, its DDP wrapper, or this rank's pipeline part), `optimizer`, `precision` (the forward
    passes' context) and `precision_description`; per step `forward_backward`, `clip_grad_norm`, `reduce_mean`,
    `expert_load`; forward only `evaluate`, `row_sums`, `loss_context`; state `tied_parameters`,
    `full_state_dict`, `model_and_optimizer_state` and its load, `model_state` and its load; `report` at the end."""

    def __init__(
        self,
        plan: ParallelPlan,
        mesh: RankMesh,
        runtime: Runtime,
        model: LayeredModel,
        init: ParameterInit,
        optim: OptimConfig,
        materializer: Materializer = materialize,
        eos_id: int | None = None,
        masked_targets: bool = False,
    ):
        self.plan, self.mesh, self.runtime = plan, mesh, runtime
        needs_eos = "train.attention=document" if plan.train.attention == "document" else None
        needs_eos = needs_eos or (None if plan.train.score_after_eos else "train.score_after_eos=false")
        if eos_id is None and needs_eos:
            raise ConfigError(
                f"{needs_eos}: no end-of-text token to find documents by; build the model with a tokenizer"
            )
        self._separator = eos_id if plan.train.attention == "document" else None
        self._unscored_input = None if plan.train.score_after_eos else eos_id
        # Whether some targets may be unscored, so the loss's denominator is counted: at end-of-text tokens, or
        # wherever the data says (`masked_targets`: fine-tuning trains the assistant's tokens alone).
        self._counts_scored = masked_targets or self._unscored_input is not None
        steps = layout_steps(plan, mesh, runtime.device)
        # Where parameters live: the device, or host memory when FSDP offloads them.
        init_device = torch.device("cpu") if plan.parallel.cpu_offload else runtime.device
        self._data_parallel = data_parallel_class(plan.name)(mesh, runtime, plan.parallel)
        self._pipeline: Pipeline | None = None
        if plan.pipelined:  # imported only where a run pipelines: torch's pipelining costs a process ~0.7 s
            from llmtrain.parallel.pipeline.pipeline import Pipeline

            self._pipeline = Pipeline(plan, mesh, runtime, model, steps, init_device, init, materializer)
        if self._pipeline is None:
            apply_layout(model, steps)
            materializer(model, init_device, init)
        self.module = self._data_parallel.wrap(model if self._pipeline is None else self._pipeline.part)
        bf16 = uses_bf16(plan.train.precision, runtime.device)
        # Muon's Newton-Schulz runs in the run's compute precision.
        self.optimizer = self._data_parallel.build_optimizer(
            self.module, optim, torch.bfloat16 if bf16 else torch.float32
        )
        self._precompute_float8_scales: Callable[[], None] | None = None
        if steps.float8 is not None and steps.float8.fsdp_all_gather:
            self._precompute_float8_scales = precompute_scales_after_step(self.optimizer, self.module)
        fsdp_mixed_precision = steps.fsdp_mesh is not None and steps.param_dtype is not None
        # Between blocks (what pipeline stages send): bf16 where FSDP gathers bf16 weights; autocast's residual
        # adds keep fp32.
        self.residual_dtype = torch.bfloat16 if fsdp_mixed_precision else torch.float32
        self.precision, self.precision_description = precision_policy(runtime.device, bf16, fsdp_mixed_precision)
        frozen = [param for param in self.module.parameters() if not param.requires_grad and param.ndim == 2]
        if frozen and all(param.dtype == torch.bfloat16 for param in frozen):
            self.precision_description += "; the frozen base held in bf16"
        if steps.float8 is not None:
            self.precision_description += "; " + float8_summary(steps.float8, self.module)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def pipeline(self) -> Pipeline | None:
        """This rank's stages and their schedule, where the plan pipelines."""
        return self._pipeline

    # -- one step -------------------------------------------------------------------------------------------
    def _context_shard(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of every sequence of `tokens` (batch, seq): all of it without context parallelism."""
        cp = self.mesh.cp_mesh
        return tokens if cp is None else shard_tokens(tokens, cp.size(), cp.get_local_rank())

    def _documents(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The forward's `documents` keyword for whole windows `tokens` (batch, seq): where the packed document of
        each position this rank holds starts (model/documents.py); nothing under causal attention."""
        if self._separator is None:
            return {}
        starts = self._context_shard(document_starts(tokens, self._separator))
        return {"documents": starts.to(self.runtime.device)}

    def _scored(self, micro_batches: MicroBatches) -> MicroBatches:
        """The micro-batches with the target at each end-of-text token unscored where train.score_after_eos is off."""
        if self._unscored_input is None:
            return micro_batches
        return [(x, y.masked_fill(x == self._unscored_input, UNSCORED)) for x, y in micro_batches]

    def _loss_scale(self, micro_batches: MicroBatches, pieces: int) -> float | torch.Tensor:
        """What a micro-batch's summed loss (over this rank's scored targets) is multiplied by so that the means the
        layout then takes, over `pieces` micro-batches and over the data- and context-parallel ranks (of losses,
        and of gradients by DDP / FSDP), give the mean over every scored target of the global batch: those ranks
        x pieces / the global batch's scored targets. Known without communication when every target is scored;
        otherwise the counts (of whole rows, the same on each context-parallel rank) are summed over the
        data-parallel ranks, on the device, without a host read."""
        ranks = self.plan.dp_size * self.plan.degrees.cp * pieces
        if not self._counts_scored:
            return ranks / (sum(targets.numel() for _, targets in micro_batches) * self.plan.dp_size)
        counts = [(targets != UNSCORED).sum() for _, targets in micro_batches]
        scored = sum_over(torch.stack(counts).sum().to(self.runtime.device, torch.float32), self.mesh.dp_mesh)
        return ranks / scored.clamp(min=1)

    def loss_context(self) -> AbstractContextManager:
        """Context around the loss and its backward (tensor parallelism computes it on vocabulary shards)."""
        return loss_context(self.plan.degrees.tp, self.plan.parallel.loss_parallel)

    def forward_backward(self, micro_batches: MicroBatches) -> torch.Tensor:
        """Accumulate gradients of the mean loss over this rank's micro-batches; return that mean (detached)."""
        micro_batches = self._scored(micro_batches)
        if self._pipeline is not None:
            device = self.runtime.device
            whole = torch.cat([x for x, _ in micro_batches])
            inputs = self._context_shard(whole).to(device)
            targets = self._context_shard(torch.cat([y for _, y in micro_batches])).to(device)
            scale = self._loss_scale(micro_batches, self.plan.microbatches)
            with self.loss_context(), self.precision():
                mean = self._pipeline.forward_backward(inputs, targets, self._documents(whole), scale)
        else:
            mean = self._accumulate(micro_batches)
        self._data_parallel.after_backward(self.optimizer)
        return mean_over(mean, self.mesh.cp_mesh)

    def _accumulate(self, micro_batches: MicroBatches) -> torch.Tensor:
        device, count = self.runtime.device, len(micro_batches)
        scale = self._loss_scale(micro_batches, count)
        total = torch.zeros((), device=device)
        for i, (whole, targets) in enumerate(micro_batches):
            documents = self._documents(whole)
            inputs, targets = self._context_shard(whole), self._context_shard(targets)
            with self._data_parallel.accumulating(self.module, i == count - 1), self.loss_context():
                with self.precision(), auxiliary_loss_scale(1 / count):
                    logits = self.module(inputs.to(device), **documents)
                    loss = summed_cross_entropy(logits, targets.to(device)) * scale
                (loss / count).backward()
            total += full_tensor(loss.detach())
        return total / count

    @torch.no_grad()
    def evaluate(self, micro_batches: MicroBatches) -> torch.Tensor:
        """The mean loss over this rank's micro-batches, without gradients."""
        micro_batches = self._scored(micro_batches)
        scale = self._loss_scale(micro_batches, len(micro_batches))
        means = self._forward_only(micro_batches, lambda logits, targets: summed_cross_entropy(logits, targets) * scale)
        mean = torch.stack(means).mean() if means else torch.zeros((), device=self.runtime.device)
        if self._pipeline is not None:
            mean = self._pipeline.share(mean)
        return mean_over(mean, self.mesh.cp_mesh)

    @torch.no_grad()
    def row_sums(self, micro_batches: MicroBatches, statistic: RowStatistic) -> torch.Tensor:
        """(rows, statistic.columns) over this rank's micro-batches, row by row: `statistic` summed over each row's
        scored targets (those not UNSCORED; llmtrain/model/scoring.py), whole rows whatever the layout splits them
        into."""
        sums = self._forward_only(micro_batches, statistic.compute)
        if self._pipeline is None:
            return sum_over(torch.cat(sums), self.mesh.cp_mesh)
        rows = sum(len(inputs) for inputs, _ in micro_batches)
        empty = torch.zeros(rows, statistic.columns, dtype=torch.float64, device=self.runtime.device)
        return sum_over(self._pipeline.share(torch.cat(sums) if sums else empty), self.mesh.cp_mesh)

    def _forward_only(self, micro_batches: MicroBatches, statistic: Statistic) -> list[torch.Tensor]:
        """`statistic(logits, targets)` of each micro-batch (this rank's part of each sequence); under a pipeline
        on the last stage's rank alone ([] elsewhere)."""
        device, results = self.runtime.device, []
        with self.precision(), self.loss_context():
            if self._pipeline is not None:
                return self._pipeline.forward_only(micro_batches, statistic, self._context_shard, self._documents)
            for whole, targets in micro_batches:
                documents = self._documents(whole)
                inputs, targets = self._context_shard(whole), self._context_shard(targets)
                logits = self.module(inputs.to(device), **documents)
                results.append(full_tensor(statistic(logits, targets.to(device))))
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
        return load / self.plan.degrees.tp

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a per-rank scalar over the data-parallel ranks (each holds an equal share of the batch)."""
        return mean_over(value, self.mesh.dp_mesh)

    def _grad_norm(self) -> torch.Tensor:
        """The global gradient norm (over all ranks' shards and stages)."""
        if self._pipeline is not None:
            return self._pipeline.grad_norm()
        return squared_norm(grads_by_layout(self.module.parameters())).sqrt()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` (0: measure only) and return the global gradient norm before clipping."""
        return self._data_parallel.clip_grad_norm(self.module, self.optimizer, max_norm, self._grad_norm)

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def tied_parameters(self) -> dict[str, str]:
        """Parameter name -> the name of the parameter it is a copy of (the LM head's weight is the embedding)."""
        return unwrap(self.module).tied_parameters

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's weights as full CPU tensors under the unsplit model's names, on rank 0
        (None on the other ranks), whatever the layout holds (replicas, ZeRO-1 buffers, FSDP shards, stages).
        Gathered one tensor at a time: the other ranks drop each one as soon as it is gathered."""
        if self._pipeline is not None:
            return self._pipeline.full_state_dict()
        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast(dict[str, torch.Tensor], state) if self.runtime.is_main else None

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
        return self._pipeline.report(run_dir) if self._pipeline is not None else {}


def unwrap(model: nn.Module) -> LayeredModel:
    """The model inside a DDP wrapper."""
    return cast(LayeredModel, getattr(model, "module", model))
