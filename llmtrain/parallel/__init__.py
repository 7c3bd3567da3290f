"""Parallel layouts: a registry of strategies keyed by `parallel.strategy`. Importing this package registers them."""

from llmtrain.parallel import single  # noqa: F401  (registers the strategy)
from llmtrain.parallel.registry import get_strategy, register, strategy_names
from llmtrain.parallel.strategy import Strategy

__all__ = ["Strategy", "get_strategy", "register", "strategy_names"]
