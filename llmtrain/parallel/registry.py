"""`parallel.layout` name -> the ParallelModel class that lays it out, from its row in llmtrain/catalog.py. A new
layout is one row (and, if it needs mechanics no row has, one class named by it); the trainer does not change. A
class is imported only when a run asks for it."""

from __future__ import annotations

import importlib

from llmtrain.catalog import layout_spec
from llmtrain.config import OptimConfig
from llmtrain.model import LayeredModel, ParameterInit
from llmtrain.parallel.mesh import RankMesh
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.plan import ParallelPlan
from llmtrain.runtime import Runtime


def parallel_model_class(name: str) -> type[ParallelModel]:
    module, _, class_name = layout_spec(name).implementation.partition(":")
    return getattr(importlib.import_module(module), class_name)


def parallelize(
    model: LayeredModel, init: ParameterInit, plan: ParallelPlan, mesh: RankMesh, runtime: Runtime, optim: OptimConfig
) -> ParallelModel:
    """`model` (built on the meta device) laid out by `plan` over this rank's `mesh`: allocated, initialised by
    `init` where this rank holds it, with its optimizer over `optim`."""
    return parallel_model_class(plan.name)(plan, mesh, runtime, model, init, optim)
