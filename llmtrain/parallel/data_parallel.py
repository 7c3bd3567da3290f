"""The data-parallel mechanisms of llmtrain/catalog/layouts.py's DATA_PARALLEL: how the ranks that see different data
share the model's state, each an object a ParallelModel holds, whole when made.

  none         DataParallel: the step as it is
  fsdp         FSDP: FSDP2 is a step of layout.py, applied to the modules themselves; here only whether it
               reduce-scatters every micro-batch's gradients or once per step (parallel.reduce_once_per_step)
  ddp          DistributedDataParallel (ddp.py): a wrapper, and no gradient sync while accumulating
  zero1        ZeRO-1 (zero.py): the optimizer updates this rank's flat slice of the gradients, reduce-scattered
               after backward, and the updated parameters are all-gathered
"""

from __future__ import annotations

from collections.abc import Callable
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
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from llmtrain.catalog import imported, zero1_form
from llmtrain.config import OptimConfig, ParallelConfig
from llmtrain.optim import Compute, build_optimizer
from llmtrain.optim.groups import refuse_inherited_fusion
from llmtrain.optim.state_bits import portable_state
from llmtrain.parallel.ddp import apply_ddp
from llmtrain.parallel.mesh import RankMesh
from llmtrain.parallel.tensors import clip_gradients, replicate_partial_gradients
from llmtrain.parallel.zero import ZeroOneShards
from llmtrain.process.runtime import Runtime

_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


class DataParallel:
    """Data parallelism that changes nothing in the step: none at all, or FSDP's, which its hooks do."""

    def __init__(self, mesh: RankMesh, runtime: Runtime, parallel: ParallelConfig):
        self.mesh, self.runtime, self.parallel = mesh, runtime, parallel

    def wrap(self, module: nn.Module) -> nn.Module:
        """A wrapper that needs the materialised weights, or the module itself."""
        return module

    def accumulating(self, module: nn.Module, is_last_micro_batch: bool) -> AbstractContextManager:
        """Context for one micro-batch's forward + backward."""
        return nullcontext()

    def build_optimizer(self, module: nn.Module, optim: OptimConfig, ns_dtype: torch.dtype) -> torch.optim.Optimizer:
        return build_optimizer(module, optim, ns_dtype, self.runtime.device)

    def after_backward(self, optimizer: torch.optim.Optimizer) -> None:
        """Once the step's gradients are complete."""

    def clip_grad_norm(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float, norm: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """Clip to `max_norm` (0: measure only) by the global gradient norm `norm()` and return that norm."""
        replicate_partial_gradients(module.parameters())
        total = norm()
        clip_gradients(module.parameters(), max_norm, total)
        return total

    def state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """Model and optimizer state as this rank holds it, keyed by the unsplit model's names."""
        return (
            get_model_state_dict(module),
            portable_state(get_optimizer_state_dict(module, optimizer, options=_FLAT_OPTIMIZER)),
        )

    def load_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict
    ) -> None:
        set_model_state_dict(module, model_state)
        set_optimizer_state_dict(module, optimizer, optimizer_state, options=_FLAT_OPTIMIZER)
        refuse_inherited_fusion(optimizer)


class DDP(DataParallel):
    def wrap(self, module: nn.Module) -> nn.Module:
        return apply_ddp(module, self.mesh.dp_group, self.runtime.device)

    def accumulating(self, module: nn.Module, is_last_micro_batch: bool) -> AbstractContextManager:
        """Gradients are all-reduced once per step: not on the micro-batches before the last."""
        return nullcontext() if is_last_micro_batch else cast(DistributedDataParallel, module).no_sync()


class FSDP(DataParallel):
    def __init__(self, mesh: RankMesh, runtime: Runtime, parallel: ParallelConfig):
        super().__init__(mesh, runtime, parallel)
        once = parallel.reduce_once_per_step
        # over one shard the unsharded gradient is the shard: holding it costs nothing, reducing it each time does
        self.reduce_once = mesh.degrees.dp_shard_cp == 1 if once is None else once

    def accumulating(self, module: nn.Module, is_last_micro_batch: bool) -> AbstractContextManager:
        """With parallel.reduce_once_per_step, no reduce-scatter on the micro-batches before the last: FSDP keeps
        their gradients unsharded, accumulated in its reduce dtype (fp32)."""
        if self.reduce_once:
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_requires_gradient_sync(is_last_micro_batch, recurse=False)
        return nullcontext()


class ZeroOne(DataParallel):
    def build_optimizer(self, module: nn.Module, optim: OptimConfig, ns_dtype: torch.dtype) -> torch.optim.Optimizer:
        if self.mesh.dp_mesh is None:
            raise RuntimeError("zero1 shards the optimizer over a process group: a single process has none")
        form = imported(zero1_form(optim.name))  # a ConfigError for an optimizer without one
        return form(module, optim, self.mesh.dp_mesh, Compute(self.runtime.device, ns_dtype))

    def after_backward(self, optimizer: torch.optim.Optimizer) -> None:
        cast(ZeroOneShards, optimizer).reduce_scatter_gradients()

    def clip_grad_norm(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float, norm: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """The global norm from the reduced slices: each rank's sum of squares, summed over ranks."""
        sharded = cast(ZeroOneShards, optimizer)
        grads = sharded.shard_gradients()
        squares = torch.stack([grad.float().pow(2).sum() for grad in grads]).sum()
        dist.all_reduce(squares, group=sharded.group)
        total = squares.sqrt()
        clip_gradients(sharded.shards(), max_norm, total)
        return total

    def state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        return get_model_state_dict(module), cast(ZeroOneShards, optimizer).flat_state_dict(_names(module))

    def load_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict
    ) -> None:
        set_model_state_dict(module, model_state)
        cast(ZeroOneShards, optimizer).load_flat_state_dict(optimizer_state, _names(module))


def _names(module: nn.Module) -> dict[nn.Parameter, str]:
    return {param: name for name, param in module.named_parameters()}
