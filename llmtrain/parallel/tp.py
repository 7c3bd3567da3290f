"""Tensor parallelism with DTensor: `parallel=tp`, and the TP step of every layout with parallel.tp > 1.

The model supplies its plan (module name -> parallel style: llmtrain/model/parallel_plan.py for the GPT); this
step applies it over the `tp` mesh dimension and keeps tied parameters tied. With loss parallelism the
cross-entropy runs on vocabulary shards (`loss_context`), so no rank holds full-vocabulary logits.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from llmtrain.model.base import LayeredModel
from llmtrain.model.materialize import retie, tied_groups
from llmtrain.parallel.float8 import float8_tensor_parallel_plan


def apply_tensor_parallel(
    model: LayeredModel,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    loss_parallel_on: bool,
    float8_styles: bool = False,
) -> None:
    """`float8_styles`: the model's float8 layers get torchao's float8 styles (float8.py)."""
    tied = tied_groups(model)
    plan = model.tensor_parallel_plan(sequence_parallel, loss_parallel_on)
    parallelize_module(model, tp_mesh, float8_tensor_parallel_plan(model, plan) if float8_styles else plan)
    # parallelize_module gives each module its own DTensor parameter; tied ones share one placement (the
    # embedding and the head are both split by vocabulary rows), so the tie is restored as it was.
    retie(model, tied)


def loss_context(tp: int, loss_parallel_on: bool) -> AbstractContextManager:
    """Around the loss and its backward: cross-entropy on vocabulary shards when the head's output is split."""
    return loss_parallel() if loss_parallel_on and tp > 1 else nullcontext()
