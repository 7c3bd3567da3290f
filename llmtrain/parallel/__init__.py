"""Parallel layouts: `parallel.strategy` names a class in layouts.py (single, tp, ddp, zero1, fsdp) or pipeline/
(pp, and the 3-D layouts pp_fsdp, pp_tp, 3d), looked up in llmtrain/catalog.py's table by registry.py. How a layout
is applied to the model: parallelize.py, one step per module (context.py, tp.py, fsdp.py, ddp.py, zero.py).

Nothing is imported with the package itself: a process that needs one piece (ring_attention.py in a test worker)
does not pay for every layout's imports (FSDP, DCP, pipelining: seconds per process)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmtrain.parallel.registry import get_strategy
    from llmtrain.parallel.strategy import Strategy

__all__ = ["Strategy", "get_strategy"]


def __getattr__(name: str) -> Any:
    if name == "Strategy":
        from llmtrain.parallel.strategy import Strategy

        return Strategy
    if name == "get_strategy":
        from llmtrain.parallel.registry import get_strategy

        return get_strategy
    raise AttributeError(f"module 'llmtrain.parallel' has no attribute {name!r}")
