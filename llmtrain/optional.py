"""Optional extras (pyproject's `fp8`: torchao), imported only where a key asks for them (config.require_extra has
already said what to install when one is absent)."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

# What importing torchao logs that no user can act on: one warning for each kernel library it was not built for
# here (its mxfp8 and sm_90a CUTLASS kernels, on a CPU or another GPU), and torch's notice about an enum torchao
# registers with the compiler.
_IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def import_torchao(module: str) -> ModuleType:
    """torchao's `module` (e.g. "torchao.float8"), its import-time warnings kept out of the log; later warnings
    are shown as usual."""
    loggers = [logging.getLogger(name) for name in _IMPORT_NOISE]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
