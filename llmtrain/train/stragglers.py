"""Stragglers: which rank is slow, and by how much (logging.straggler_threshold).

In a synchronous step every rank waits for the slowest, so the step time says that one rank is slow but not which.
Each rank measures its own busy time in the step's compute (from the step's start through forward/backward and
clipping, before the step's one host read): on a CPU the training thread's CPU time, which time blocked in a
collective does not add to; on a GPU the compute stream's time between two CUDA events, read after the host read
has synchronised anyway. On logging steps the ranks gather the previous step's times in one small device
collective, read with that step's loss and norm, so nothing adds a synchronisation. The record gets the slowest
rank and its lag (its time over the median of the ranks that do the same work: the ranks of its pipeline stage),
and a rank that lags by more than the threshold on STRAGGLER_CHECKS logging steps in a row gets one warning."""

from __future__ import annotations

import logging
import statistics
import time

import torch
from torch.distributed.device_mesh import DeviceMesh

from llmtrain.runtime import Runtime, all_gather_single

log = logging.getLogger("llmtrain")

STRAGGLER_CHECKS = 3


class StragglerWatch:
    """Measures this rank's busy time each step (`begin`, `end_of_compute`, `after_host_read`) and, on logging steps,
    gathers every rank's (`gathered`) and reports (`report`). `stage_of`: each rank's pipeline stage (its peers)."""

    def __init__(self, runtime: Runtime, every: int, threshold: float, stage_of: list[int]):
        self.runtime = runtime
        self.every = every
        self.threshold = threshold
        self.stage_of = stage_of
        self.previous_seconds = 0.0  # this rank's busy time in the step before (what a logging step gathers)
        self._cuda = runtime.device.type == "cuda"
        self._started = 0.0
        self._measured = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._lagging: dict[int, int] = {}  # rank -> logging steps in a row over the threshold
        self._warned: set[int] = set()

    def begin(self) -> None:
        if self._cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._started = time.thread_time()

    def end_of_compute(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._measured = time.thread_time() - self._started

    def after_host_read(self) -> None:
        """The step's host read has waited for the device: the events' time can be read without a new wait."""
        if self._events is not None:
            start, end = self._events
            self._measured = start.elapsed_time(end) / 1000
        self.previous_seconds = self._measured

    def gathered(self, step: int) -> torch.Tensor | None:
        """On a logging step, every rank's busy time in the step before (a device tensor, one value per rank), to be
        read with the step's results; None on other steps or alone."""
        if self.runtime.world_size == 1 or step % self.every or step == 1:
            return None
        mine = torch.full((1,), self.previous_seconds, dtype=torch.float64, device=self.runtime.device)
        every_rank = torch.empty(self.runtime.world_size, dtype=torch.float64, device=self.runtime.device)
        all_gather_single(every_rank, mine)
        return every_rank

    def report(self, step: int, seconds: list[float], record: dict) -> None:
        """The slowest rank and its lag into `record`; a warning for a rank that keeps lagging."""
        lags = [seconds[rank] / self._median_of_peers(rank, seconds) - 1 for rank in range(len(seconds))]
        slowest = max(range(len(lags)), key=lags.__getitem__)
        record["slowest_rank"], record["straggler_lag"] = slowest, round(lags[slowest], 4)
        for rank, lag in enumerate(lags):
            self._lagging[rank] = self._lagging.get(rank, 0) + 1 if lag > self.threshold else 0
            if self._lagging[rank] >= STRAGGLER_CHECKS and rank not in self._warned:
                self._warned.add(rank)
                if not self.runtime.is_main:  # every rank knows; one says so
                    continue
                log.warning(
                    f"step {step}: rank {rank} has been {lag:.0%} slower than its peers' median on "
                    f"{STRAGGLER_CHECKS} logging steps in a row (logging.straggler_threshold={self.threshold}): a "
                    f"throttled or shared device? metrics.jsonl has slowest_rank and straggler_lag"
                )

    def _median_of_peers(self, rank: int, seconds: list[float]) -> float:
        peers = [seconds[other] for other in range(len(seconds)) if self.stage_of[other] == self.stage_of[rank]]
        return max(statistics.median(peers), 1e-9)


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
