"""The training loop's state: where it is and what it recorded, as a checkpoint restores it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoopState:
    step: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float = 0.0
    bad_steps: int = 0  # consecutive steps skipped: a non-finite loss or gradient norm, or a spike under on_spike=skip
