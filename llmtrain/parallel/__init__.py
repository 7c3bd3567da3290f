"""Parallel layouts: a registry of strategies keyed by `parallel.strategy`. Importing this package registers them:
layouts.py (single, tp, ddp, zero1, fsdp) and pipeline/ (pp, and the 3-D layouts pp_fsdp, pp_tp, 3d). How a
layout is applied to the model: parallelize.py, one step per module (tp.py, fsdp.py, ddp.py, zero.py)."""

from llmtrain.parallel import layouts, pipeline  # noqa: F401  (each registers its strategies)
from llmtrain.parallel.registry import get_strategy, register, strategy_names
from llmtrain.parallel.strategy import Strategy

__all__ = ["Strategy", "get_strategy", "register", "strategy_names"]
