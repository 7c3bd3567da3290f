"""Whether a step's update reaches the weights. A step whose loss or gradient norm is not finite does not touch
them: its gradients are dropped, the step is recorded with `skipped: true`, and after train.max_bad_steps such
steps in a row the run stops. A finite loss over train.spike_factor times the recent median is a spike: a warning
naming the step and its batch, `spike: true` in its record, and under train.on_spike=skip its update dropped as a
non-finite step's is; under rollback the run ends for its restart to leave the batch out (attempts.py). Spikes are
judged only where the objective's loss measures progress (its row's loss_is_progress: not GRPO's). Loss and norm are
reduced over all ranks and the recent losses are the same on each, so every rank decides alike."""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

from llmtrain.catalog import OBJECTIVES, objective_of
from llmtrain.config import RootConfig
from llmtrain.data import Data, RankSlice
from llmtrain.errors import RolledBack, TrainingDiverged
from llmtrain.process import attempts
from llmtrain.process.runtime import Runtime
from llmtrain.train.observers import StepObserver
from llmtrain.train.state import LoopState

log = logging.getLogger("llmtrain")


class RecentLosses:
    """The losses of the last `window` steps that updated the weights, against whose median a loss over `factor`
    times it is a spike (factor 0: none is); `losses`, those of the steps before (a resumed run's, so that it judges
    its steps as the uninterrupted run would have)."""

    def __init__(self, factor: float, window: int, losses: Sequence[float] = ()):
        self.factor = factor
        self.losses: deque[float] = deque(losses, maxlen=window)

    def spike_median(self, loss: float) -> float | None:
        """The median `loss` is a spike against; None when it is not one, or the window is not yet full (early
        losses fall too fast for a median of a few to judge by)."""
        if self.factor == 0 or len(self.losses) < (self.losses.maxlen or 0):
            return None
        median = statistics.median(self.losses)
        return median if loss > self.factor * median else None

    def add(self, loss: float) -> None:
        """The loss of a step whose update was applied."""
        self.losses.append(loss)


class UpdateGuard(StepObserver):
    """Collective when made (the recent losses agreed): the skip, spike and rollback rules of the module docstring
    over `state`'s steps, the batches of `data` as `train_slice` takes them, the run's batches left out so far
    (`left_out`, attempts.py) in `run_dir`."""

    def __init__(
        self,
        config: RootConfig,
        runtime: Runtime,
        state: LoopState,
        data: Data,
        train_slice: RankSlice,
        run_dir: str,
        left_out: set[int],
    ):
        self._train, self._runtime, self._state = config.train, runtime, state
        self._data, self._train_slice, self._run_dir, self._left_out = data, train_slice, run_dir, left_out
        judged = OBJECTIVES[objective_of(config.train.objective, config.data.source)].loss_is_progress
        self._recent_losses = self._agreed_recent_losses(config.train.spike_factor if judged else 0.0)

    def _agreed_recent_losses(self, factor: float) -> RecentLosses:
        """Collective where spikes are watched for: the losses of the last train.spike_window steps that updated the
        weights, as rank 0's records hold them. A resumed run's records are rank 0's metrics.jsonl, which another
        rank may not see, or see while rank 0 rewrites it: windows that differed would split the ranks' decisions
        under train.on_spike=skip."""
        window = self._train.spike_window
        if factor == 0:
            return RecentLosses(factor, window)
        updated = [record["loss"] for record in self._state.records if not record.get("skipped")]
        return RecentLosses(factor, window, self._runtime.from_main(updated[-window:]))

    def allows_update(self, step: int, record: dict[str, Any]) -> bool:
        loss, grad_norm = record["loss"], record["grad_norm"]
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._skip(record, f"step {step}: loss {loss}, gradient norm {grad_norm}: not finite")
            return False
        median = self._recent_losses.spike_median(loss)
        if median is not None and not self._trains_on_spike(step, record, loss, median):
            return False
        self._state.bad_steps = 0
        self._recent_losses.add(loss)
        return True

    def _trains_on_spike(self, step: int, record: dict[str, Any], loss: float, median: float) -> bool:
        """A spike's step: reported, then trained on (log), skipped (skip) or the run rolled back (RolledBack)."""
        record["spike"] = True
        spike = (
            f"step {step}: loss {loss:.4g} is {loss / median:.1f}x the median of the last "
            f"{len(self._recent_losses.losses)} steps ({median:.4g}): a spike ({self._batch_position(step)})"
        )
        if self._train.on_spike == "skip":
            self._skip(record, spike)
            return False
        if self._train.on_spike == "rollback":
            if self._runtime.is_main:
                attempts.leave_out_batch(self._run_dir, step)
            raise RolledBack(
                f"{spike}: rolled back: a restart or requeue resumes from the last complete checkpoint with this "
                f"batch left out (exit {RolledBack.exit_code})"
            )
        log.warning(spike)
        return True

    def _batch_position(self, step: int) -> str:
        """Which batch of the data stream step `step` trained on, reproducibly: every step takes the next global
        batch (a resumed run's data continues from its checkpoint's position), so it is batch step - 1 counting
        from 0; a prepared store or a mixture also names the batch's sequences in its seeded order."""
        taken_before = step - 1 + sum(1 for left_out in self._left_out if left_out <= step)
        position = f"batch {taken_before} of the data stream, counting from 0"
        taken = self._data.train.state_dict().get("next_sample")  # the position after the batch
        if taken is None:
            return position
        return f"{position}: its sequences {taken - self._train_slice.batch_size}-{taken - 1}"

    def _skip(self, record: dict[str, Any], reason: str) -> None:
        """Drop the step's update (its gradients are zeroed with the others'); after train.max_bad_steps such
        steps in a row, stop the run."""
        record["skipped"] = True
        self._state.bad_steps += 1
        bad, most = self._state.bad_steps, self._train.max_bad_steps
        log.warning(f"{reason}: the weights were left unchanged ({bad} skipped step(s) in a row)")
        if bad >= most:
            raise TrainingDiverged(
                f"step {record['step']}: {bad} steps in a row skipped for a non-finite loss or gradient norm or a "
                f"loss spike (train.max_bad_steps={most}), the run stops; its last checkpoint is intact. Lower "
                f"optim.lr, raise optim.warmup_steps, or check the data"
            )
