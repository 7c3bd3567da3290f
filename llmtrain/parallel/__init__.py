"""Parallel layouts: a registry of strategies keyed by `parallel.strategy`. Importing this package registers them:
single.py (one process), ddp.py (DistributedDataParallel), zero.py (ZeRO-1), fsdp.py (FSDP2: zero2, fsdp, hsdp)."""

from llmtrain.parallel import ddp, fsdp, single, tp, zero  # noqa: F401  (each registers its strategies)
from llmtrain.parallel.registry import get_strategy, register, strategy_names
from llmtrain.parallel.strategy import Strategy

__all__ = ["Strategy", "get_strategy", "register", "strategy_names"]
