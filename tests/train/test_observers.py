"""The trainer's observers (llmtrain/train/observers.py): the values each asks to read with a step's results come
back to it alone, whichever others ask, and a hook reaches every observer in the order given."""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.train.observers import Observers, StepObserver


class Asking(StepObserver):
    """Asks for `count` values on the steps in `on_steps`, and keeps what it was handed."""

    def __init__(self, count: int, on_steps: set[int], calls: list[str], name: str):
        self.count, self.on_steps, self.calls, self.name = count, on_steps, calls, name
        self.handed: list[list[float] | None] = []

    def values_to_read(self, step: int) -> torch.Tensor | None:
        if step not in self.on_steps:
            return None
        return torch.arange(self.count, dtype=torch.float64) + 100 * len(self.name)

    def results_read(self, step: int, values: list[float] | None, record: dict[str, Any]) -> None:
        self.handed.append(values)

    def phase_begins(self, step: int, phase: str) -> None:
        self.calls.append(f"{self.name}: {phase}")


def _one_read(observers: Observers, step: int) -> None:
    asked = observers.values_to_read(step)
    values = torch.cat(asked).tolist() if asked else []
    observers.results_read(step, values, {})


def test_each_observer_gets_back_the_values_it_asked_for_and_none_where_it_asked_none():
    calls: list[str] = []
    first, silent, second = Asking(2, {1, 2}, calls, "a"), Asking(0, set(), calls, "bb"), Asking(3, {2}, calls, "ccc")
    observers = Observers([first, silent, second])
    _one_read(observers, 1)
    _one_read(observers, 2)
    assert first.handed == [[100.0, 101.0], [100.0, 101.0]]
    assert silent.handed == [None, None]
    assert second.handed == [None, [300.0, 301.0, 302.0]]
    observers.phase_begins(2, "optimizer")
    assert calls == ["a: optimizer", "bb: optimizer", "ccc: optimizer"]
