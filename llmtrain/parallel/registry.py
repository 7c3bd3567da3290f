"""`parallel.strategy` name -> Strategy class. A new layout is one module with `@register("name")`, imported in
`llmtrain/parallel/__init__.py`, plus one `conf/parallel/<name>.yaml`; the trainer does not change."""

from __future__ import annotations

from collections.abc import Callable

from llmtrain.config import ConfigError
from llmtrain.parallel.strategy import Strategy

_STRATEGIES: dict[str, type[Strategy]] = {}


def register(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    def add(cls: type[Strategy]) -> type[Strategy]:
        if name in _STRATEGIES:
            raise ValueError(f"strategy {name!r} is registered twice")
        cls.name = name
        _STRATEGIES[name] = cls
        return cls

    return add


def strategy_names() -> list[str]:
    return sorted(_STRATEGIES)


def get_strategy(name: str) -> type[Strategy]:
    if name not in _STRATEGIES:
        raise ConfigError(
            f"parallel.strategy={name!r} is not a registered strategy: use one of {', '.join(strategy_names())}"
        )
    return _STRATEGIES[name]
