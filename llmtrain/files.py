"""Files written whole or not at all: a reader (a restart, a requeue, a tool) finds the old file or the new one,
never a half-written one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any


def write_json_atomic(path: str, payload: Any, default: Callable[[Any], Any] | None = None) -> None:
    """`payload` as JSON at `path`, written beside it and renamed (`default`: json.dump's, for values JSON has no
    type for)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, default=default)
    os.replace(tmp, path)
