"""Stragglers: which rank is slow, and by how much (logging.straggler_threshold).

In a synchronous step every rank waits for the slowest, so the step time says that one rank is slow but not which.
What tells them apart is where the time went: a slow rank arrives late at each collective and waits little in it,
its peers wait for it. So each rank measures, over its step from start to its one host read, its busy time: the
step's time less the time it spent waiting in collectives.
  - On a CPU the training thread's CPU time: a collective blocks the thread without using it (gloo moves the data
    in threads of its own).
  - On a GPU the step's time less how long its NCCL kernels ran, from torch's flight recorder (init_runtime sets
    TORCH_NCCL_ENABLE_TIMING, so each completed collective carries its kernel's time, which is mostly the wait for
    the last rank to arrive). CUDA events around the compute would not do: they include the compute stream's
    waits on those collectives, so the ranks' times come out equal, the last to start the shortest.
On logging steps the ranks gather the previous step's times (its collectives have finished by then) in one small
device collective, read with that step's loss and norm, so nothing adds a synchronisation. A rank's lag is its busy
time over the median of the others that do the same work (the ranks of its pipeline stage), as a share of its
step: the share of the step the others spent waiting for it. The record gets the slowest rank and its lag, and a
rank that lags by more than the threshold on STRAGGLER_CHECKS logging steps in a row gets one warning."""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from llmtrain.process.runtime import Runtime, all_gather_single
from llmtrain.train.flight_recorder import flight_entries, seconds_in_collectives
from llmtrain.train.observers import StepObserver

log = logging.getLogger("llmtrain")

STRAGGLER_CHECKS = 3


@dataclass(frozen=True)
class StepSpan:
    """One step of this rank, from its start to its host read: wall-clock nanoseconds (the flight recorder's clock)
    and, on a CPU, the training thread's CPU seconds in it."""

    started_ns: int
    ended_ns: int
    cpu_seconds: float

    @property
    def seconds(self) -> float:
        return (self.ended_ns - self.started_ns) / 1e9


class StragglerWatch(StepObserver):
    """Measures this rank's step (from `step_begins` to the step's host read, `results_read`) and, on logging steps,
    gathers every rank's measure of the step before with the step's results (`values_to_read`) and reports.
    `stage_of`: each rank's pipeline stage (its peers)."""

    def __init__(self, runtime: Runtime, every: int, threshold: float, stage_of: list[int]):
        self.runtime = runtime
        self.every = every
        self.threshold = threshold
        self.stage_of = stage_of
        self._gpu = runtime.device.type == "cuda"
        self._started: tuple[int, float] = (0, 0.0)  # this step's start: wall-clock ns, thread CPU seconds
        self._previous: StepSpan | None = None  # the step before (what a logging step gathers)
        self._lagging: dict[int, int] = {}  # rank -> logging steps in a row over the threshold
        self._warned: set[int] = set()

    def step_begins(self, step: int) -> None:
        self._started = (time.time_ns(), time.thread_time())

    def busy_seconds(self, span: StepSpan) -> float:
        """`span`'s time less this rank's waits in collectives; NaN where the flight recorder has no time yet for
        one of its collectives."""
        if not self._gpu:
            return span.cpu_seconds
        waited = seconds_in_collectives(flight_entries()[0], span.started_ns, span.ended_ns)
        return math.nan if waited is None else max(span.seconds - waited, 0.0)

    def values_to_read(self, step: int) -> torch.Tensor | None:
        """Collective on a logging step: every rank's (busy, whole) seconds of the step before (a device tensor of 2
        values per rank); None on other steps, alone, or before a first step."""
        if self.runtime.world_size == 1 or step % self.every or self._previous is None:
            return None
        mine = torch.empty(2, dtype=torch.float64, device=self.runtime.device)
        mine[0], mine[1] = self.busy_seconds(self._previous), self._previous.seconds  # fills: no host-to-device copy
        every_rank = torch.empty(2 * self.runtime.world_size, dtype=torch.float64, device=self.runtime.device)
        all_gather_single(every_rank, mine)
        return every_rank

    def results_read(self, step: int, values: list[float] | None, record: dict[str, Any]) -> None:
        """The step's host read has waited for this rank's device: the step's work is done. On a logging step, the
        ranks' seconds it gathered (`values`) go into `record` (_report)."""
        started_ns, started_cpu = self._started
        self._previous = StepSpan(started_ns, time.time_ns(), time.thread_time() - started_cpu)
        if values is not None:
            self._report(step, values, record)

    def _report(self, step: int, gathered: list[float], record: dict[str, Any]) -> None:
        """The slowest rank and its lag into `record`; a warning for a rank that keeps lagging. Nothing where a
        rank could not measure its step (a GPU whose flight recorder has no time for one of its collectives)."""
        busy, whole = gathered[0::2], gathered[1::2]
        if any(math.isnan(value) for value in busy):
            return
        lags = [self._lag(rank, busy, whole[rank]) for rank in range(len(busy))]
        slowest = max(range(len(lags)), key=lags.__getitem__)
        record["slowest_rank"], record["straggler_lag"] = slowest, round(lags[slowest], 4)
        for rank, lag in enumerate(lags):
            self._lagging[rank] = self._lagging.get(rank, 0) + 1 if lag > self.threshold else 0
            if self._lagging[rank] >= STRAGGLER_CHECKS and rank not in self._warned:
                self._warned.add(rank)
                if not self.runtime.is_main:  # every rank knows; one says so
                    continue
                log.warning(
                    f"step {step}: rank {rank}'s peers waited {lag:.0%} of the step for it on {STRAGGLER_CHECKS} "
                    f"logging steps in a row (logging.straggler_threshold={self.threshold}): a throttled or shared "
                    f"device, or a slow input? metrics.jsonl has slowest_rank and straggler_lag"
                )

    def _lag(self, rank: int, busy: list[float], whole: float) -> float:
        """How much longer `rank` was busy than the median of the others in its stage, as a share of its step."""
        stage = self.stage_of[rank]
        others = [busy[other] for other in range(len(busy)) if other != rank and self.stage_of[other] == stage]
        if not others:
            return 0.0
        return (busy[rank] - statistics.median(others)) / max(whole, 1e-9)


def stages_of_ranks(mesh: DeviceMesh, world_size: int) -> list[int]:
    """Each rank's pipeline stage in `mesh` (all 0 without pipeline parallelism): the ranks that do the same work."""
    names = mesh.mesh_dim_names or ()
    if "pp" not in names:
        return [0] * world_size
    ranks = mesh.mesh.movedim(names.index("pp"), 0)
    stage_of = [0] * world_size
    for stage in range(ranks.shape[0]):
        for rank in ranks[stage].flatten().tolist():
            stage_of[rank] = stage
    return stage_of
