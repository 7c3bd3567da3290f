"""How a catalog row names the code it runs, and how a key's doc lists a table's rows."""

from __future__ import annotations

import importlib
from typing import Any


def imported(reference: str) -> Any:
    """What a row's import string "module:Name" names, its module imported now."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


def described(table: dict[str, Any]) -> str:
    """Each name of `table` with its row's one-line description, for the doc of the key that chooses among them."""
    return "; ".join(f"`{name}`: {row.description}" for name, row in table.items())
