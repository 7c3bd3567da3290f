"""`parallel.strategy` name -> Strategy class. A new layout is one module with `@register("name")`, imported by
`_register_all` below, plus one `conf/parallel/<name>.yaml`; the trainer does not change."""

from __future__ import annotations

from collections.abc import Callable

from llmtrain.errors import ConfigError
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


def _register_all() -> None:
    """Import the modules whose classes register themselves (once; later calls are dictionary lookups)."""
    import llmtrain.parallel.layouts
    import llmtrain.parallel.pipeline.strategy  # noqa: F401


def strategy_names() -> list[str]:
    _register_all()
    return sorted(_STRATEGIES)


def get_strategy(name: str) -> type[Strategy]:
    _register_all()
    if name not in _STRATEGIES:
        raise ConfigError(
            f"parallel.strategy={name!r} is not a registered strategy: use one of {', '.join(strategy_names())}"
        )
    return _STRATEGIES[name]
