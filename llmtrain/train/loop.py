"""The training loop: for each optimizer step, the parallel model's forward/backward over this rank's micro-batches,
the global-batch loss, clipping, the optimizer and schedule steps, then metrics, validation and checkpoints on
schedule, and a clean stop when the job is asked to end (preemption.py). What watches the steps without steering
them (the hang watchdog, the straggler report, the profiler, the fault points) hears of them through the hooks of
observers.py.

A step whose loss or gradient norm is not finite does not touch the weights: its gradients are dropped, the step
is recorded with `skipped: true`, and after train.max_bad_steps such steps in a row the run stops. A finite loss
over train.spike_factor times the recent median is a spike: a warning naming the step and its batch, `spike: true`
in its record, and under train.on_spike=skip its update dropped as a non-finite step's is."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from llmtrain import attempts, faults
from llmtrain.config import RootConfig
from llmtrain.data import Data, RankSlice
from llmtrain.data.tasks import Task
from llmtrain.data.tokenizers import token_byte_lengths
from llmtrain.errors import Preempted, RolledBack, TrainingDiverged
from llmtrain.model import GPTConfig
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.parallel.precision import uses_bf16
from llmtrain.parallel.tensors import full_tensor
from llmtrain.runtime import Runtime
from llmtrain.train.downstream import evaluate_tasks
from llmtrain.train.dpo import REWARDS, DirectPreference
from llmtrain.train.metrics import begin_step_memory, mfu, peak_flops, step_memory
from llmtrain.train.observers import Observers, StepObserver

log = logging.getLogger("llmtrain")

# The agreed flag's values (Trainer._agreed_flag), strongest last: MAX over the ranks keeps it.
CLOCK_SAVE, STOP = 1.0, 2.0


class Checkpoints(Protocol):
    def save(self, step: int, by_clock: bool = False) -> None: ...

    def poll(self) -> None: ...

    def finish(self) -> None: ...


@dataclass
class LoopState:
    step: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float = 0.0
    bad_steps: int = 0  # consecutive steps skipped: a non-finite loss or gradient norm, or a spike under on_spike=skip


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


@dataclass(frozen=True)
class StepResults:
    """What a step's one host read brings: loss and gradient norm (reduced over the ranks), the ranks' agreed flag
    (Trainer._agreed_flag), the targets trained (0 where the data trains every target), the experts' load (empty
    without experts) and the observers' values (Observers.values_to_read)."""

    loss: float
    grad_norm: float
    agreed: float
    trained_tokens: float
    expert_load: list[float]
    observed: list[float]
    preference: list[float]  # data=preference: dpo.REWARDS's values (the loss is DPO's); empty otherwise


@dataclass
class Components:
    """What one job trains with, whole when made (llmtrain/job.py's build_training builds it): the config, the
    model laid out with its optimizer, the LR schedule, the data and this rank's slices of each batch, the checkpoints
    and the loop's state (restored when resuming)."""

    config: RootConfig
    runtime: Runtime
    model: ParallelModel
    model_config: GPTConfig  # the model's resolved shape (vocabulary from the tokenizer, padding)
    lr_schedule: torch.optim.lr_scheduler.LRScheduler
    data: Data
    train_slice: RankSlice
    val_slice: RankSlice
    checkpoints: Checkpoints
    state: LoopState
    n_params: int
    n_trainable: int  # n_params, or the low-rank adapters' alone
    model_flops: float  # per token
    wandb_id: str | None  # the W&B run this job continues (rank 0)
    run_dir: str  # where the run's attempts leave what the next one reads (llmtrain/attempts.py)
    tasks: list[Task]  # eval.tasks, read and tokenised (empty: none)


class StopSignals(Protocol):
    """Whether this rank was asked to stop, and by which signal: train/preemption.py's PreemptionWatch."""

    signal_name: str | None

    def stop_requested(self, runtime: Runtime) -> bool: ...


class _Unwatched:
    """No stop signal watched: a benchmark's or a test worker's trainer runs until its caller stops."""

    signal_name: str | None = None

    def stop_requested(self, runtime: Runtime) -> bool:
        return False


_UNWATCHED = _Unwatched()


class Trainer:
    """Runs the steps of one job over its components, reporting each step's record to `on_record`, telling its
    `observers` (train/observers.py: the hang watchdog, the straggler report, the profiler, the fault points) where
    each step is, and stopping cleanly at a step boundary when `preemption` saw a stop signal on any rank. What
    others use of it: `run` (the job), `advance` (a number of steps: benchmarks and test workers), `state`, `model`
    and `checkpoints`."""

    def __init__(
        self,
        parts: Components,
        on_record: Callable[[dict[str, Any]], None],
        *,
        observers: Sequence[StepObserver] = (),
        preemption: StopSignals = _UNWATCHED,
    ):
        self._train = parts.config.train
        self._grad_clip = parts.config.optim.grad_clip
        self._checkpoint_every = parts.config.checkpoint.every
        self._runtime = runtime = parts.runtime
        self.model = parts.model
        self._optimizer = parts.model.optimizer
        self._lr_schedule = parts.lr_schedule
        self._data = parts.data
        self._on_record = on_record
        self._flops_per_token = parts.model_flops
        self._peak = peak_flops(runtime.device, bf16=uses_bf16(self._train.precision, runtime.device))
        self._train_slice = parts.train_slice
        self._val_slice = parts.val_slice
        self.checkpoints = parts.checkpoints
        self._observers = Observers(observers)
        self._preemption = preemption
        self.state = parts.state
        self._run_dir = parts.run_dir
        self._recent_losses = self._agreed_recent_losses()
        # steps at which the batch they would take is left out: its loss spiked before a rollback (attempts.py)
        self._left_out = attempts.batches_left_out(parts.run_dir)
        self._tasks = parts.tasks
        self._preference = DirectPreference(parts.model, parts.config.data.beta) if parts.data.pairs else None
        self._task_every = parts.config.eval.every or self._train.eval_every
        self._val_bytes_per_token = self._measured_val_bytes_per_token()
        self._stop_requested = False  # a rank was asked to stop: set by each step, acted on at its end
        self._clock_save_due = False  # checkpoint.every_minutes have passed: set by each step, acted on at its end
        self._checkpoint_minutes = parts.config.checkpoint.every_minutes
        self._last_save = time.monotonic()  # or the run's start
        self._previous_read: float | None = None  # when the step before read its results, if it was the last wait

    def _is_checkpoint_step(self, step: int) -> bool:
        every = self._checkpoint_every
        return step == self._train.steps or (every > 0 and step % every == 0)

    def _is_eval_step(self, step: int) -> bool:
        every = self._train.eval_every
        return every > 0 and (step % every == 0 or step == self._train.steps)

    def _is_task_step(self, step: int) -> bool:
        every = self._task_every
        return bool(self._tasks) and every > 0 and (step % every == 0 or step == self._train.steps)

    def _agreed_recent_losses(self) -> RecentLosses:
        """Collective where spikes are watched for: the losses of the last train.spike_window steps that updated the
        weights, as rank 0's records hold them. A resumed run's records are rank 0's metrics.jsonl, which another
        rank may not see, or see while rank 0 rewrites it: windows that differed would split the ranks' decisions
        under train.on_spike=skip."""
        factor, window = self._train.spike_factor, self._train.spike_window
        if factor == 0:
            return RecentLosses(factor, window)
        updated = [record["loss"] for record in self.state.records if not record.get("skipped")]
        return RecentLosses(factor, window, self._runtime.from_main(updated[-window:]))

    def _measured_val_bytes_per_token(self) -> list[float]:
        """Collective: per validation set, the UTF-8 bytes per scored token (every rank holds as many rows)."""
        if not self._data.validation:
            return []
        lengths = token_byte_lengths(self._data.tokenizer)
        mine = []
        for validation in self._data.validation:
            targets = validation.rows[:, 1:]
            scored = targets[targets >= 0]  # fine-tuning scores the assistant's tokens alone (data/packing.py)
            mine.append(float(lengths[scored].sum()) / max(scored.size, 1))
        return self.model.reduce_mean(torch.tensor(mine, device=self._runtime.device)).tolist()

    def validate(self) -> dict[str, float]:
        """`val_loss` and `val_bpb`: over the validation sets (one, or a mixture's sources), their mean weighted by
        the sources' weights, and each named set's own `val_loss/<source>`; with preference pairs, DPO's loss and
        rewards on the held-out pairs (`val_loss`, `val_rewards/...`)."""
        self.model.module.eval()
        if self._preference is not None:
            (held_out,) = self._data.validation
            values = self._preference.validation(self._val_slice.micro_batches(held_out.rows, self._runtime.device))
            self.model.module.train()
            names = list(values)
            return dict(zip(names, torch.stack(list(values.values())).tolist()))
        # One host read for all the sets: the device runs every set's forwards without waiting in between.
        losses = torch.stack(
            [
                self.model.reduce_mean(self.model.evaluate(self._val_slice.micro_batches(v.rows, self._runtime.device)))
                for v in self._data.validation
            ]
        ).tolist()
        self.model.module.train()
        weights = [v.weight for v in self._data.validation]
        total = sum(weights)
        record = {"val_loss": sum(w * loss for w, loss in zip(weights, losses)) / total}
        if all(self._val_bytes_per_token):  # nats per token -> bits per byte: comparable across tokenizers
            bits = [loss / (math.log(2) * per_token) for loss, per_token in zip(losses, self._val_bytes_per_token)]
            record["val_bpb"] = sum(w * b for w, b in zip(weights, bits)) / total
        for v, loss in zip(self._data.validation, losses):
            if v.name is not None:
                record[f"val_loss/{v.name}"] = loss
        return record

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over the global batch; its record."""
        step = self.state.step + 1
        started = time.perf_counter()
        self._observers.phase_begins(step, "starting the step")
        self._observers.step_begins(step)
        with faults.counting_host_reads(self._optimizer), faults.counting_device_syncs():
            record, seconds = self._step(step, started)
        self._observers.step_ends(step, seconds)
        return record

    def _step(self, step: int, started: float) -> tuple[dict[str, Any], float]:
        begin_step_memory(self._runtime.device)
        # A phase of its own: a stream that stalls is then named in a hang report, not taken for a collective's wait
        self._observers.phase_begins(step, "waiting for data")
        if step in self._left_out:
            self._data.train.next()
            if self._runtime.is_main:
                log.warning(f"step {step}: the batch whose loss spiked before the run rolled back is left out")
        rows = self._data.train.next()
        micro_batches = self._train_slice.micro_batches(rows, self._runtime.device)
        preference = torch.zeros(0, device=self._runtime.device)
        if self._preference is not None:
            self._observers.phase_begins(step, "reference and policy log-probabilities")
            micro_batches, statistics = self._preference.weighted(micro_batches)
        self._observers.phase_begins(step, "forward/backward")
        loss = self.model.reduce_mean(self.model.forward_backward(micro_batches))
        if self._preference is not None:  # DPO's loss, not the weighted loss its gradient was taken of
            loss, preference = statistics[0], statistics[1:]
        loss = self._observers.gradients_computed(step, loss)
        self._observers.phase_begins(step, "clipping")
        grad_norm = self.model.clip_grad_norm(self._grad_clip)
        results = self._read_results(step, loss, grad_norm, rows, preference)
        seconds = self._seconds_since_last_read(started)
        self._stop_requested = results.agreed >= STOP
        self._clock_save_due = results.agreed == CLOCK_SAVE
        record: dict[str, Any] = {
            "step": step,
            "loss": results.loss,
            "lr": self._lr_schedule.get_last_lr()[0],
            "grad_norm": results.grad_norm,
        }
        record.update(_expert_balance(results.expert_load))
        record.update(zip(REWARDS, results.preference))
        self._observers.results_read(step, results.observed, record)
        self._observers.phase_begins(step, "optimizer")
        if self._applies_update(record, results):
            self._optimizer.step()
            self.state.bad_steps = 0
            self._recent_losses.add(results.loss)
        self._optimizer.zero_grad(set_to_none=True)
        self._lr_schedule.step()
        if self._data.masks_targets:
            record["trained_tokens"] = round(results.trained_tokens)
        tokens = self._train.batch_size * self._train.seq_len
        record["tokens_per_s"] = tokens / seconds
        record["mfu"] = mfu(tokens / seconds / self._runtime.world_size, self._flops_per_token, self._peak)
        self.state.train_seconds += seconds
        return record, seconds

    def _read_results(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, rows: np.ndarray, preference: torch.Tensor
    ) -> StepResults:
        """Collective: the step's one host synchronisation. Loss, norm and stop flag come over together, with the
        targets trained, the experts' load, DPO's rewards and what the observers asked for. The optimizer step
        depends on them (a non-finite step leaves the weights untouched), so it cannot be skipped. Each comes to the
        compute device first: with parallel.cpu_offload the gradient norm is a host tensor."""
        agreed = self._agreed_flag()
        load = self.model.expert_load()
        loads = [] if load is None else [load]
        observed = self._observers.values_to_read(step)
        self._observers.phase_begins(step, "reading the step's results")
        trained = self._trained_tokens(rows)
        scalars = [full_tensor(loss), grad_norm, agreed, trained, preference, *loads, *observed]
        loss_value, norm_value, agreed_value, trained_value, *rest = torch.cat(
            [value.to(device=self._runtime.device, dtype=torch.float64).reshape(-1) for value in scalars]
        ).tolist()
        rewards, rest = rest[: preference.numel()], rest[preference.numel() :]
        counted = sum(tensor.numel() for tensor in loads)
        return StepResults(loss_value, norm_value, agreed_value, trained_value, rest[:counted], rest[counted:], rewards)

    def _seconds_since_last_read(self, started: float) -> float:
        """A step's time runs from the step before's read to this one's: the device is waited for only there, so the
        step before's optimizer, still queued at its read, is in this period and every period holds one of each.
        After validation, tasks or a checkpoint (which wait for the device themselves) it runs from this step's
        start."""
        read_at = time.perf_counter()
        seconds = read_at - (started if self._previous_read is None else self._previous_read)
        self._previous_read = read_at
        return seconds

    def _trained_tokens(self, rows: np.ndarray) -> torch.Tensor:
        """Collective where the data marks untrained targets: the targets trained in this step's global batch
        (counted on the host from this rank's rows, summed over the data-parallel ranks on the device); else 0."""
        if not self._data.masks_targets:
            return torch.zeros((), device=self._runtime.device)
        mine = torch.full((), float((rows[:, 1:] >= 0).sum()), device=self._runtime.device)
        return self.model.reduce_mean(mine) * self.model.plan.dp_size

    def _agreed_flag(self) -> torch.Tensor:
        """Collective: what every rank does after this step, agreed in one MAX all-reduce read with the step's
        results: STOP (a rank was asked to stop: save and exit), CLOCK_SAVE (checkpoint.every_minutes have passed
        on rank 0's clock since the last save), or 0. Filled on the device: torch.tensor(value, device=cuda) would
        copy from host memory, a sync each step."""
        stop = self._preemption.stop_requested(self._runtime)
        interval = self._checkpoint_minutes * 60
        due = self._runtime.is_main and interval > 0 and time.monotonic() - self._last_save >= interval
        flag = torch.full((), STOP if stop else CLOCK_SAVE if due else 0.0, device=self._runtime.device)
        if self._runtime.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def _applies_update(self, record: dict[str, Any], results: StepResults) -> bool:
        """Whether the step's update reaches the weights: not when its loss or gradient norm is not finite, nor
        when its loss is a spike under train.on_spike=skip; under rollback a spike ends the run (RolledBack) for its
        restart to leave the batch out. Loss and norm are reduced over all ranks and the recent losses are the same
        on each, so every rank takes the same decision."""
        step, loss = record["step"], results.loss
        if not (math.isfinite(loss) and math.isfinite(results.grad_norm)):
            self._skip(record, f"step {step}: loss {loss}, gradient norm {results.grad_norm}: not finite")
            return False
        median = self._recent_losses.spike_median(loss)
        if median is None:
            return True
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
        self.state.bad_steps += 1
        log.warning(f"{reason}: the weights were left unchanged ({self.state.bad_steps} skipped step(s) in a row)")
        if self.state.bad_steps >= self._train.max_bad_steps:
            raise TrainingDiverged(
                f"step {record['step']}: {self.state.bad_steps} steps in a row skipped for a non-finite loss or "
                f"gradient norm or a loss spike (train.max_bad_steps={self._train.max_bad_steps}), the run stops; "
                f"its last checkpoint is intact. Lower optim.lr, raise optim.warmup_steps, or check the data"
            )

    def run(self) -> LoopState:
        """The steps up to train.steps, then the last checkpoint's write waited for; however the run ends, the
        observers are closed."""
        self.model.module.train()
        try:
            while self.state.step < self._train.steps:
                self.advance()
            self.checkpoints.finish()
        finally:
            self._observers.close()
        return self.state

    def advance(self) -> None:
        """One step and what the run does around it: validation, memory, checkpoint completion, the record,
        saving, stopping when asked."""
        record = self.train_step()
        self.state.step = step = record["step"]
        stop = self._stop_requested
        save = stop or self._clock_save_due or self._is_checkpoint_step(step)
        if self._is_eval_step(step) or self._is_task_step(step) or save:
            self._previous_read = None  # their time is not the next step's
        if self._is_eval_step(step):
            self._observers.phase_begins(step, "validation")
            record.update(self.validate())
        if self._is_task_step(step):
            self._observers.phase_begins(step, "downstream tasks")
            record.update(evaluate_tasks(self.model, self._tasks, self._train.micro_batch_size))
        self._observers.phase_begins(step, "logging")
        record.update(self._data.source_tokens(self._train.seq_len))
        record.update(step_memory(self._runtime.device))
        self.checkpoints.poll()
        self.state.records.append(record)
        self._on_record(record)
        if save:
            self._observers.phase_begins(step, "checkpoint")
            self.checkpoints.save(step, by_clock=not (stop or self._is_checkpoint_step(step)))
            self._last_save = time.monotonic()
        if stop:  # every rank stops here: they agreed on it with the step's results
            self.checkpoints.finish()
            raise Preempted(step, self._preemption.signal_name or "a signal on another rank")


def _expert_balance(load: list[float]) -> dict[str, Any]:
    """Routed slots per expert, all mixture blocks together, and their imbalance (none without experts)."""
    if not load:
        return {}
    return {
        "expert_load": [round(value) for value in load],
        "expert_imbalance": max(load) * len(load) / max(sum(load), 1),
    }
