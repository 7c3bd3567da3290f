"""Parallel layouts: a registry of strategies keyed by `parallel.strategy`. Importing this package registers them:
single.py (one process), ddp.py (DistributedDataParallel), zero.py (ZeRO-1), fsdp.py (FSDP2: zero2, fsdp, hsdp),
tp.py (tensor parallel), pipeline/ (pipeline parallel and the 3-D layouts: pp, pp_fsdp, pp_tp, 3d)."""

from llmtrain.parallel import ddp, fsdp, pipeline, single, tp, zero  # noqa: F401  (each registers its strategies)
from llmtrain.parallel.registry import get_strategy, register, strategy_names
from llmtrain.parallel.strategy import Strategy

__all__ = ["Strategy", "get_strategy", "register", "strategy_names"]
