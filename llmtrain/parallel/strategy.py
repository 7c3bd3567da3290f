"""What a parallel layout provides to the trainer. The trainer calls these methods and never asks which layout
it runs; each layout overrides only what it changes (wrapping, gradient sync, reductions, the step itself)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, ClassVar, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from llmtrain.config import ConfigError
from llmtrain.model import GPT, cross_entropy_loss
from llmtrain.parallel.mesh import MESH_DIMS, build_mesh, resolve_degrees
from llmtrain.runtime import Runtime
from llmtrain.train.optim import build_adamw

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]
PrecisionContext = Callable[[], AbstractContextManager]
_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


class Strategy:
    """Base layout: resolves the degrees, checks them (`validate`), then builds the mesh. Subclasses name the
    mesh dimensions they use in `supported_dims`; a degree above 1 on any other dimension is refused."""

    name: ClassVar[str]
    supported_dims: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg, runtime: Runtime):
        self.cfg = cfg
        self.runtime = runtime
        if runtime.world_size == 1 and self.supported_dims:
            raise ConfigError(f"parallel={cfg.parallel.strategy} splits the work over processes but this is a single "
                              f"process: launch with torchrun --nproc_per_node=N, or set parallel.nproc=N")
        self.degrees = resolve_degrees(cfg.parallel, runtime.world_size)
        self.validate()
        self.mesh: DeviceMesh | None = None
        self.dp_mesh: DeviceMesh | None = None
        if runtime.world_size > 1:
            self.mesh = build_mesh(self.degrees, runtime.device.type)
            # One flat data-parallel dimension over replicas and shards: the group the loss is averaged over.
            self.dp_mesh = self.mesh["dp_replicate", "dp_shard"]._flatten("dp")

    # -- layout ---------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError when the layout cannot run with these degrees."""
        for dim in MESH_DIMS:
            if getattr(self.degrees, dim) > 1 and dim not in self.supported_dims:
                raise ConfigError(f"parallel.{dim}={getattr(self.degrees, dim)} but parallel.strategy={self.name} "
                                  f"does not split over {dim} (it uses {', '.join(self.supported_dims) or 'no dimension'}): "
                                  f"set parallel.{dim}=1 or choose a layout that has it")

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    @property
    def dp_size(self) -> int:
        return self.degrees.dp

    def micro_batching(self) -> tuple[int, int]:
        """(sequences per micro-batch, micro-batches per rank and step)."""
        t = self.cfg.train
        return t.micro_batch_size, t.batch_size // (t.micro_batch_size * self.dp_size)

    def describe(self) -> str:
        """One line for the start-up summary: the layout and its mesh."""
        return f"{self.name} ({self.degrees.describe()})"

    def parallelize(self, model: GPT) -> nn.Module:
        """Apply the layout to a freshly initialised GPT, in torchtitan's order: tensor parallelism first (the
        other steps see the sharded layers), then activation checkpointing and compilation of each block (so they
        capture the sharded computation), and the data-parallel wrapper last (it hooks the module tree as it will
        run)."""
        self.apply_tensor_parallel(model)
        model.activation_checkpointing = self.cfg.train.activation_checkpointing
        if self.cfg.train.compile:
            for block in model.blocks.values():
                block.compile()
        return self.wrap(model)

    def apply_tensor_parallel(self, model: GPT) -> None:
        """Split layers across the tp dimension (layouts with tensor parallelism)."""

    def wrap(self, model: GPT) -> nn.Module:
        """The data-parallel wrapper (DDP, FSDP), or the model itself."""
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return build_adamw(model, self.cfg.optim)

    # -- one step -------------------------------------------------------------------------------------------
    def loss_context(self) -> AbstractContextManager:
        """Context around the loss and its backward (tensor parallelism computes it on vocabulary shards)."""
        return nullcontext()

    def grad_sync(self, model: nn.Module, is_last_micro_batch: bool) -> AbstractContextManager:
        """Context for one micro-batch's forward + backward; layouts that reduce gradients skip all but the last."""
        return nullcontext()

    def forward_backward(self, model: nn.Module, micro_batches: MicroBatches,
                         precision: PrecisionContext) -> torch.Tensor:
        """Accumulate gradients of the mean loss over this rank's micro-batches; return that mean (detached)."""
        total = torch.zeros((), device=self.runtime.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            with self.grad_sync(model, is_last_micro_batch=i == len(micro_batches) - 1), self.loss_context():
                with precision():
                    loss = cross_entropy_loss(model(inputs.to(self.runtime.device)),
                                              targets.to(self.runtime.device))
                (loss / len(micro_batches)).backward()
            total += plain_value(loss)
        return total / len(micro_batches)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, micro_batches: MicroBatches, precision: PrecisionContext) -> torch.Tensor:
        total = torch.zeros((), device=self.runtime.device)
        for inputs, targets in micro_batches:
            with precision(), self.loss_context():
                total += plain_value(cross_entropy_loss(model(inputs.to(self.runtime.device)),
                                                        targets.to(self.runtime.device)))
        return total / len(micro_batches)

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a per-rank scalar over the data-parallel ranks (each holds an equal share of the batch).
        Gloo has no AVG reduction, hence SUM then divide."""
        if self.dp_mesh is None or self.dp_size == 1:
            return value
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.dp_mesh.get_group())
        return value / self.dp_size

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global gradient norm (over all ranks' shards and stages)."""
        return squared_norm(grads_by_layout(model.parameters())).sqrt()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` (0: measure only) and return the global gradient norm before clipping."""
        norm = self.grad_norm(model)
        if max_norm > 0:
            scale = min(1.0, max_norm / (norm.item() + 1e-6))  # torch's clip_grad_norm_ formula
            for grads in grads_by_layout(model.parameters()):
                torch._foreach_mul_(grads, scale)
        return norm

    # -- results --------------------------------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's weights as full CPU tensors under the unsplit GPT's names, on rank 0
        (None on the other ranks), whatever the layout holds (replicas, ZeRO-1 buffers, FSDP shards)."""
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.runtime.is_main else None

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Model and optimizer state as this rank holds it (DTensor shards where sharded), keyed by the unsplit
        model's parameter names (the optimizer's flattened: "state.<param>.exp_avg"), so that a checkpoint saved
        under one layout loads under any other. DCP saves it, or loads into it in place.

        The LM head's weight is the embedding matrix (tied in one model, equal copies on two pipeline stages): it
        is stored once, under the embedding's names, and handed back to every parameter that uses it on load."""
        model_state, optimizer_state = self.model_and_optimizer_state(model, optimizer)
        state = {}
        self._stored_as = {}  # part -> {stored key: the keys of this rank's state it stands for}
        for part, values in (("model", model_state), ("optimizer", optimizer_state)):
            state[part], self._stored_as[part] = _store_tied_once(values)
        return state

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Put a `checkpoint_state` that DCP has filled back into the model and optimizer."""
        self.load_model_and_optimizer_state(model, optimizer,
                                            *(_restore_tied(state[part], self._stored_as[part])
                                              for part in ("model", "optimizer")))

    def model_and_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        return (get_model_state_dict(model),
                get_optimizer_state_dict(model, optimizer, options=_FLAT_OPTIMIZER))

    def load_model_and_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                       model_state: dict, optimizer_state: dict) -> None:
        set_model_state_dict(model, model_state)
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=_FLAT_OPTIMIZER)

    def report(self, run_dir: str) -> dict:
        """Collective, after training: what this layout measured, for the end summary (rank 0 may also write
        files into run_dir); {} on the other ranks."""
        return {}


def grads_by_layout(params: Iterable[nn.Parameter]) -> list[list[torch.Tensor]]:
    """Gradients grouped by how they are laid out (plain, or DTensor mesh + placements): a norm over one group
    is one reduction, and layouts mix in one model (tensor-parallel weights beside replicated LayerNorms)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            grad = param.grad
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            groups.setdefault(key, []).append(grad)
    return list(groups.values())


def squared_norm(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    return torch.stack([_full(torch.nn.utils.get_total_norm(grads)) ** 2 for grads in groups]).sum()


_HEAD, _EMBEDDING = "lm_head.weight", "tok_emb.weight"


def _store_tied_once(values: dict) -> tuple[dict, dict[str, list[str]]]:
    """`values` with every "lm_head.weight" key folded into its "tok_emb.weight" twin (one kept when a rank
    holds both), and which original keys each stored key stands for."""
    stored: dict = {}
    stands_for: dict[str, list[str]] = {}
    for key, value in values.items():
        name = key.replace(_HEAD, _EMBEDDING)
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


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

def plain_value(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain scalar: a loss computed on vocabulary shards is a replicated DTensor."""
    return _full(loss.detach())
