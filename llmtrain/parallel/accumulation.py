"""The executor of every layout that does not pipeline (executor.py): the whole model, as the layout splits it,
runs each micro-batch of the step in turn, forward then backward, and its gradients add up; the data-parallel
mechanism says whether they are reduced after each micro-batch or only after the last."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from llmtrain.model import LayeredModel, auxiliary_loss_scale
from llmtrain.parallel.data_parallel import DataParallel
from llmtrain.parallel.executor import Combine
from llmtrain.parallel.layout import LayoutSteps, apply_layout
from llmtrain.parallel.step_setup import StepSetup
from llmtrain.parallel.tensors import MicroBatches, Statistic, full_tensor, grads_by_layout, squared_norm


class Accumulation:
    """`model` (on the meta device) laid out by `steps`, then allocated and initialised by `allocate`, then wrapped
    by `data_parallel` where its mechanism wraps (DDP): all at construction."""

    def __init__(
        self,
        setup: StepSetup,
        model: LayeredModel,
        steps: LayoutSteps,
        allocate: Callable[[nn.Module], None],
        data_parallel: DataParallel,
    ):
        self._setup, self._data_parallel = setup, data_parallel
        apply_layout(model, steps)
        allocate(model)
        self.module = data_parallel.wrap(model)
        self.pp_rank = 0

    def forward_backward(self, micro_batches: MicroBatches) -> torch.Tensor:
        setup, device, count = self._setup, self._setup.runtime.device, len(micro_batches)
        scale = setup.loss_scale(micro_batches, count)
        total = torch.zeros((), device=device)
        for i, (whole, targets) in enumerate(micro_batches):
            documents = setup.documents(whole)
            inputs, targets = setup.context_shard(whole), setup.context_shard(targets)
            with self._data_parallel.accumulating(self.module, i == count - 1), setup.loss_context():
                with setup.precision(), auxiliary_loss_scale(1 / count):
                    logits = self.module(inputs.to(device), **documents)
                    loss = setup.loss(logits, targets.to(device)) * scale
                (loss / count).backward()
            total += full_tensor(loss.detach())
        return total / count

    def forward_only(self, micro_batches: MicroBatches, statistic: Statistic, combine: Combine) -> torch.Tensor:
        setup, device, results = self._setup, self._setup.runtime.device, []
        with setup.precision(), setup.loss_context():
            for whole, targets in micro_batches:
                documents = setup.documents(whole)
                inputs, targets = setup.context_shard(whole), setup.context_shard(targets)
                logits = self.module(inputs.to(device), **documents)
                results.append(full_tensor(statistic(logits, targets.to(device))))
        return combine(results)

    def grad_norm(self) -> torch.Tensor:
        return squared_norm(grads_by_layout(self.module.parameters())).sqrt()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Gathered one tensor at a time: the other ranks drop each one as soon as it is gathered."""
        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast(dict[str, torch.Tensor], state) if self._setup.runtime.is_main else None

    def report(self, run_dir: str) -> dict:
        return {}
