"""The training loop: for each optimizer step, the parallel model's forward/backward over this rank's micro-batches,
the global-batch loss, clipping, the optimizer and schedule steps, then metrics, validation and checkpoints on
schedule, and a clean stop when the job is asked to end (preemption.py). What watches the steps without steering
them (the hang watchdog, the straggler report, the profiler, the fault points) hears of them through the hooks of
observers.py; whether a step's update reaches the weights (non-finite steps, loss spikes), update_guard.py; what a
step optimizes, the job's Objective (objectives.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from llmtrain import faults
from llmtrain.config import RootConfig
from llmtrain.data import Data, RankSlice
from llmtrain.data.tasks import Task
from llmtrain.errors import Preempted
from llmtrain.model import GPTConfig
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.parallel.precision import uses_bf16
from llmtrain.parallel.tensors import full_tensor
from llmtrain.process import attempts
from llmtrain.process.runtime import Runtime
from llmtrain.train.downstream import evaluate_tasks
from llmtrain.train.metrics import begin_step_memory, mfu, peak_flops, step_memory
from llmtrain.train.objectives import Objective
from llmtrain.train.observers import Observers, StepObserver
from llmtrain.train.state import LoopState
from llmtrain.train.update_guard import UpdateGuard

log = logging.getLogger("llmtrain")

# The agreed flag's values (Trainer._agreed_flag), strongest last: MAX over the ranks keeps it.
CLOCK_SAVE, STOP = 1.0, 2.0


class Checkpoints(Protocol):
    def save(self, step: int, by_clock: bool = False) -> None: ...

    def poll(self) -> None: ...

    def finish(self) -> None: ...


@dataclass(frozen=True)
class StepResults:
    """What a step's one host read brings: loss and gradient norm (reduced over the ranks), the ranks' agreed flag
    (Trainer._agreed_flag), the objective's metrics by name and the observers' values (Observers.values_to_read)."""

    loss: float
    grad_norm: float
    agreed: float
    metrics: dict[str, float]
    observed: list[float]


@dataclass(frozen=True)
class ModelFacts:
    """What a job's model is, counted once it is built: its resolved shape (the vocabulary from the tokenizer,
    padding), its parameters (the padding rows left out), those that train (the low-rank adapters alone, where it has
    them) and the training FLOPs per token its MFU is measured by."""

    shape: GPTConfig
    parameters: int
    trained: int
    flops_per_token: float


@dataclass
class Components:
    """What one job trains with, whole when made (llmtrain/run/build.py's build_training builds it): the config, the
    model laid out with its optimizer, the LR schedule, the data and this rank's slices of each batch, what a step
    optimizes, the checkpoints, the loop's state (restored when resuming) and what the model asks to record."""

    config: RootConfig
    runtime: Runtime
    model: ParallelModel
    facts: ModelFacts
    lr_schedule: torch.optim.lr_scheduler.LRScheduler
    data: Data
    train_slice: RankSlice
    objective: Objective
    checkpoints: Checkpoints
    state: LoopState
    wandb_id: str | None  # the W&B run this job continues (rank 0)
    run_dir: str  # where the run's attempts leave what the next one reads (llmtrain/process/attempts.py)
    tasks: list[Task]  # eval.tasks, read and tokenised (empty: none)
    # what the model built asks to record of each step (the experts' load of a mixture: expert_load.py)
    observers: list[StepObserver]


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
        self._config, self._train, self._runtime = parts.config, parts.config.train, parts.runtime
        self.model, self._optimizer, self._lr_schedule = parts.model, parts.model.optimizer, parts.lr_schedule
        self._data, self._objective = parts.data, parts.objective
        self.checkpoints, self.state, self._tasks = parts.checkpoints, parts.state, parts.tasks
        self._on_record, self._preemption = on_record, preemption
        self._flops_per_token = parts.facts.flops_per_token
        self._peak = peak_flops(parts.runtime.device, bf16=uses_bf16(self._train.precision, parts.runtime.device))
        # steps at which the batch they would take is left out: its loss spiked before a rollback (attempts.py)
        self._left_out = attempts.batches_left_out(parts.run_dir)
        guard = UpdateGuard(
            self._config, parts.runtime, parts.state, parts.data, parts.train_slice, parts.run_dir, self._left_out
        )
        self._observers = Observers([guard, *parts.observers, *observers])
        self._stop_requested = False  # a rank was asked to stop: set by each step, acted on at its end
        self._clock_save_due = False  # checkpoint.every_minutes have passed: set by each step, acted on at its end
        self._last_save = time.monotonic()  # or the run's start
        self._previous_read: float | None = None  # when the step before read its results, if it was the last wait

    def _is_checkpoint_step(self, step: int) -> bool:
        every = self._config.checkpoint.every
        return step == self._train.steps or (every > 0 and step % every == 0)

    def _is_eval_step(self, step: int) -> bool:
        every = self._train.eval_every
        return every > 0 and (step % every == 0 or step == self._train.steps)

    def _is_task_step(self, step: int) -> bool:
        every = self._config.eval.every or self._train.eval_every
        return bool(self._tasks) and every > 0 and (step % every == 0 or step == self._train.steps)

    def validate(self) -> dict[str, float]:
        """Collective: the objective's validation (`val_loss`, ...), the model in eval mode meanwhile."""
        self.model.module.eval()
        record = self._objective.validation()
        self.model.module.train()
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
        batch = self._data.train.next()
        self._observers.phase_begins(step, "preparing the batch")
        prepared = self._objective.prepared(batch)
        self._observers.phase_begins(step, "forward/backward")
        trained = self.model.reduce_mean(self.model.forward_backward(prepared.micro_batches))
        loss = self._observers.gradients_computed(step, trained if prepared.loss is None else prepared.loss)
        self._observers.phase_begins(step, "clipping")
        grad_norm = self.model.clip_grad_norm(self._config.optim.grad_clip)
        results = self._read_results(step, loss, grad_norm, prepared.metrics)
        seconds = self._seconds_since_last_read(started)
        self._stop_requested = results.agreed >= STOP
        self._clock_save_due = results.agreed == CLOCK_SAVE
        record: dict[str, Any] = {
            "step": step,
            "loss": results.loss,
            "lr": self._lr_schedule.get_last_lr()[0],
            "grad_norm": results.grad_norm,
        }
        record.update(self._objective.recorded(results.metrics))
        self._observers.results_read(step, results.observed, record)
        self._observers.phase_begins(step, "optimizer")
        if self._observers.allows_update(step, record):
            self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._lr_schedule.step()
        tokens = self._train.batch_size * self._train.seq_len
        record["tokens_per_s"] = tokens / seconds
        record["mfu"] = mfu(tokens / seconds / self._runtime.world_size, self._flops_per_token, self._peak)
        self.state.train_seconds += seconds
        return record, seconds

    def _read_results(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, metrics: dict[str, torch.Tensor]
    ) -> StepResults:
        """Collective: the step's one host synchronisation. Loss, norm and stop flag come over together, with the
        objective's metrics and what the observers asked for. The optimizer step depends on them (a non-finite step
        leaves the weights untouched), so it cannot be skipped. Each comes to the compute device first: with
        parallel.cpu_offload the gradient norm is a host tensor."""
        agreed = self._agreed_flag()
        observed = self._observers.values_to_read(step)
        self._observers.phase_begins(step, "reading the step's results")
        scalars = [full_tensor(loss), grad_norm, agreed, *metrics.values(), *observed]
        loss_value, norm_value, agreed_value, *rest = torch.cat(
            [value.to(device=self._runtime.device, dtype=torch.float64).reshape(-1) for value in scalars]
        ).tolist()
        measured = dict(zip(metrics, rest[: len(metrics)]))
        return StepResults(loss_value, norm_value, agreed_value, measured, rest[len(metrics) :])

    def _seconds_since_last_read(self, started: float) -> float:
        """A step's time runs from the step before's read to this one's: the device is waited for only there, so the
        step before's optimizer, still queued at its read, is in this period and every period holds one of each.
        After validation, tasks or a checkpoint (which wait for the device themselves) it runs from this step's
        start."""
        read_at = time.perf_counter()
        seconds = read_at - (started if self._previous_read is None else self._previous_read)
        self._previous_read = read_at
        return seconds

    def _agreed_flag(self) -> torch.Tensor:
        """Collective: what every rank does after this step, agreed in one MAX all-reduce read with the step's
        results: STOP (a rank was asked to stop: save and exit), CLOCK_SAVE (checkpoint.every_minutes have passed
        on rank 0's clock since the last save), or 0. Filled on the device: torch.tensor(value, device=cuda) would
        copy from host memory, a sync each step."""
        stop = self._preemption.stop_requested(self._runtime)
        interval = self._config.checkpoint.every_minutes * 60
        due = self._runtime.is_main and interval > 0 and time.monotonic() - self._last_save >= interval
        flag = torch.full((), STOP if stop else CLOCK_SAVE if due else 0.0, device=self._runtime.device)
        if self._runtime.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

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
