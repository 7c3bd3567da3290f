"""The data-parallel mechanisms of llmtrain/catalog.py's DATA_PARALLEL that wrap or replace the base
ParallelModel's step, for layouts without a pipeline (pipeline/parallel_model.py holds those):

  ddp     DistributedDataParallel (ddp.py)
  zero1   ZeRO-1: AdamW state sharded over the data-parallel ranks (zero.py)

The mechanisms `none` and `fsdp` are the base ParallelModel itself: FSDP2 is one of the steps layout.py applies
(over dp_shard, HSDP over dp_replicate x dp_shard, with TP inside when parallel.tp > 1 and context parallelism
when parallel.cp > 1).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.nn.parallel import DistributedDataParallel

from llmtrain.catalog import OPTIMIZERS
from llmtrain.config import OptimConfig
from llmtrain.parallel.ddp import apply_ddp
from llmtrain.parallel.parallel_model import MicroBatches, ParallelModel, clip_gradients
from llmtrain.parallel.zero import ZeroOneAdamW, ZeroOneMuon


class DDP(ParallelModel):
    def _wrap(self, model: nn.Module) -> nn.Module:
        return apply_ddp(model, self.mesh.dp_group, self.runtime.device)

    def _grad_sync(self, is_last_micro_batch: bool) -> AbstractContextManager:
        return nullcontext() if is_last_micro_batch else cast(DistributedDataParallel, self.module).no_sync()


class ZeroOne(ParallelModel):
    optimizer: ZeroOneAdamW | ZeroOneMuon

    def _optimizer(self, optim: OptimConfig) -> torch.optim.Optimizer:
        if self.mesh.dp_mesh is None:
            raise RuntimeError("zero1 shards the optimizer over a process group: a single process has none")
        if OPTIMIZERS[optim.name].whole_matrices:
            return ZeroOneMuon(self.module, optim, self.mesh.dp_mesh, self._ns_dtype)
        return ZeroOneAdamW(self.module, optim, self.mesh.dp_mesh)

    def forward_backward(self, micro_batches: MicroBatches) -> torch.Tensor:
        loss = super().forward_backward(micro_batches)
        self.optimizer.reduce_scatter_gradients()
        return loss

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global norm from the reduced slices: each rank's sum of squares, summed over ranks."""
        grads = self.optimizer.shard_gradients()
        squares = torch.stack([grad.float().pow(2).sum() for grad in grads]).sum()
        dist.all_reduce(squares, group=self.optimizer.group)
        norm = squares.sqrt()
        clip_gradients(self.optimizer.shards(), max_norm, norm)
        return norm

    def model_and_optimizer_state(self) -> tuple[dict, dict]:
        return get_model_state_dict(self.module), self.optimizer.flat_state_dict(self._names())

    def load_model_and_optimizer_state(self, model_state: dict, optimizer_state: dict) -> None:
        set_model_state_dict(self.module, model_state)
        self.optimizer.load_flat_state_dict(optimizer_state, self._names())

    def _names(self) -> dict[nn.Parameter, str]:
        return {param: name for name, param in self.module.named_parameters()}
