"""The layouts without a pipeline, keyed by `parallel.strategy` in llmtrain/catalog.py (conf/parallel/*.yaml picks
one): what each adds to the base Strategy. The pipeline layouts live in pipeline/strategy.py; `single` (one process,
no wrapper: every other layout is tested against it) and `tp` (tensor parallelism over all ranks, which the base
applies wherever parallel.tp > 1) are the base Strategy itself.

  ddp     DistributedDataParallel (ddp.py)
  zero1   ZeRO-1: AdamW state sharded over the data-parallel ranks (zero.py)
  fsdp    FSDP2 over dp_shard (and HSDP over dp_replicate x dp_shard), with TP inside when parallel.tp > 1 and
          context parallelism (sequences split over cp ranks, context.py) when parallel.cp > 1
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.nn.parallel import DistributedDataParallel

from llmtrain.config import OptimConfig
from llmtrain.parallel.ddp import apply_ddp
from llmtrain.parallel.fsdp import fsdp_mesh
from llmtrain.parallel.parallelize import Layout
from llmtrain.parallel.strategy import MicroBatches, PrecisionContext, Strategy, clip_gradients
from llmtrain.parallel.zero import ZeroOneAdamW


class DDP(Strategy):
    def _wrap(self, model: nn.Module) -> nn.Module:
        return apply_ddp(model, self._dp_group, self.runtime.device)

    def _grad_sync(self, model: nn.Module, is_last_micro_batch: bool) -> AbstractContextManager:
        return nullcontext() if is_last_micro_batch else cast(DistributedDataParallel, model).no_sync()


class ZeroOne(Strategy):
    def build_optimizer(self, model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
        self.optimizer = ZeroOneAdamW(model, optim, self._dp_group)
        return self.optimizer

    def forward_backward(
        self, model: nn.Module, micro_batches: MicroBatches, precision: PrecisionContext
    ) -> torch.Tensor:
        loss = super().forward_backward(model, micro_batches, precision)
        self.optimizer.reduce_scatter_gradients()
        return loss

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The global norm from the reduced slices: each rank's sum of squares, summed over ranks."""
        grads = self.optimizer.shard_gradients()
        squares = torch.stack([grad.float().pow(2).sum() for grad in grads]).sum()
        dist.all_reduce(squares, group=self.optimizer.group)
        norm = squares.sqrt()
        clip_gradients(self.optimizer.shards(), max_norm, norm)
        return norm

    def _model_and_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        return get_model_state_dict(model), cast(ZeroOneAdamW, optimizer).flat_state_dict(_names(model))

    def _load_model_and_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict
    ) -> None:
        set_model_state_dict(model, model_state)
        cast(ZeroOneAdamW, optimizer).load_flat_state_dict(optimizer_state, _names(model))


def _names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {param: name for name, param in model.named_parameters()}


class FSDP(Strategy):
    def _layout(self) -> Layout:
        return self._base_layout(
            fsdp_mesh=fsdp_mesh(self.device_mesh, self.degrees),
            reshard_after_forward=self.parallel.reshard_after_forward,
        )
