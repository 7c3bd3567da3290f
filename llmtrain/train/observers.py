"""What follows the training loop's steps: the hooks the loop calls at fixed points of every step (`StepObserver`)
and the list a trainer calls them through (`Observers`). The observers are the hang watchdog (watchdog.py), the
straggler report (stragglers.py), the profiler (profiling.py), the fault points (fault_points.py) and, the one that
steers, the update guard (update_guard.py: a step's update dropped, or the run ended, on a bad loss). A stop signal
is none of them: it decides where the run ends, and the loop asks it itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class StepObserver(Protocol):
    """The loop's fixed points, in the order a step reaches them. An observer subclasses this and implements the
    hooks it needs; the others do nothing (their bodies return, so that they are not abstract)."""

    def step_begins(self, step: int) -> None:
        """Step `step` starts: nothing of it has run yet."""
        return None

    def phase_begins(self, step: int, phase: str) -> None:
        """The loop enters `phase` of `step` (watchdog.PHASES, in the order a step runs them)."""
        return None

    def gradients_computed(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The backward of `step` has run: the loss (reduced over the ranks) the step goes on with."""
        return loss

    def values_to_read(self, step: int) -> torch.Tensor | None:
        """Device values to come over with the step's results in its one host read; None: none."""
        return None

    def results_read(self, step: int, values: list[float] | None, record: dict[str, Any]) -> None:
        """The step's results are on the host, the optimizer not yet stepped: `values` are those `values_to_read`
        asked for (None where it asked none), `record` the step's record so far."""
        return None

    def allows_update(self, step: int, record: dict[str, Any]) -> bool:
        """Whether step `step`'s update reaches the weights, its record (loss and gradient norm over all ranks) in
        hand: every rank answers alike. False drops it (its gradients are zeroed with the others')."""
        return True

    def step_ends(self, step: int, seconds: float) -> None:
        """Step `step` is done: it took `seconds` (Trainer: from the step before's host read to its own)."""
        return None

    def close(self) -> None:
        """The run is over, however it ended."""
        return None


class Observers:
    """A trainer's observers (none: an empty list), each hook called on each in the order given."""

    def __init__(self, observers: Sequence[StepObserver]):
        self._observers = list(observers)
        self._asked: list[int | None] = []  # per observer, how many values it asked this step's read for

    def step_begins(self, step: int) -> None:
        for observer in self._observers:
            observer.step_begins(step)

    def phase_begins(self, step: int, phase: str) -> None:
        for observer in self._observers:
            observer.phase_begins(step, phase)

    def gradients_computed(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        for observer in self._observers:
            loss = observer.gradients_computed(step, loss)
        return loss

    def values_to_read(self, step: int) -> list[torch.Tensor]:
        """What every observer asked to read, in their order: `results_read` hands each its own values back."""
        asked = [observer.values_to_read(step) for observer in self._observers]
        self._asked = [None if values is None else values.numel() for values in asked]
        return [values for values in asked if values is not None]

    def allows_update(self, step: int, record: dict[str, Any]) -> bool:
        """Whether every observer lets the step's update through (each asked, in order, until one does not)."""
        return all(observer.allows_update(step, record) for observer in self._observers)

    def results_read(self, step: int, values: list[float], record: dict[str, Any]) -> None:
        """`values`: those the tensors of `values_to_read` held, read in one piece."""
        for observer, count in zip(self._observers, self._asked):
            if count is None:
                observer.results_read(step, None, record)
            else:
                observer.results_read(step, values[:count], record)
                values = values[count:]

    def step_ends(self, step: int, seconds: float) -> None:
        for observer in self._observers:
            observer.step_ends(step, seconds)

    def close(self) -> None:
        for observer in self._observers:
            observer.close()
