"""`parallel.strategy` name -> Strategy class, from the table in llmtrain/catalog.py. A new layout is one class, one
line in that table and one `conf/parallel/<name>.yaml`; the trainer does not change. A class is imported only when
a run asks for it."""

from __future__ import annotations

import importlib

from llmtrain.catalog import STRATEGIES
from llmtrain.errors import ConfigError
from llmtrain.parallel.strategy import Strategy


def strategy_names() -> list[str]:
    return list(STRATEGIES)


def get_strategy(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise ConfigError(f"parallel.strategy={name!r} is not a layout: use one of {', '.join(STRATEGIES)}")
    module, _, class_name = STRATEGIES[name].partition(":")
    strategy = getattr(importlib.import_module(module), class_name)
    strategy.name = name  # the table is the one place a layout's name is written
    return strategy
