"""The step watchdog (train.hang_timeout): a hung rank costs minutes, not the job's allocation.

On a cluster the costly failure is a hang, not a crash: one rank stuck (a bad GPU, a dropped link, a deadlock)
and every other rank waiting in a collective until the time limit, with no word of who or where. The training
loop tells it where it is (`phase_begins(step, phase)`, a hook of train/observers.py: an attribute write, no I/O,
no device sync). When a phase has run longer than its allowance, a thread of this process, on every rank on its
own clock:
  1. posts a "fire" key to the job's store, which every other rank's watchdog polls: they do the same at once,
     whatever their own allowance (a rank in a slow phase would otherwise be killed by the launcher before its
     deadline, its dump lost);
  2. writes <run dir>/hang/rank-<r>.txt: the step and phase, every Python thread's stack (faulthandler) and the
     collectives the process groups posted (torch's flight recorder, TORCH_FR_BUFFER_SIZE; init_runtime sets it
     unless the user did);
  3. posts where it is to the job's store and waits a few seconds for the other ranks' posts;
  4. logs one line naming the ranks that are behind and where the others wait. Behind: an earlier step or phase,
     or silent (gone, or stuck holding the interpreter), or, among ranks in the same phase (on a GPU every host
     ends up at the step's one read: kernels return at once), behind in the collectives: the oldest one a rank has
     not finished, from the flight recorder, is an earlier one than its peers' (or one it has not posted, or, on
     NCCL, one its device has not started);
  5. aborts the process groups (NCCL's kernels stop spinning on the device) and ends the process with HUNG_EXIT,
     which launch/slurm.sbatch requeues (at most LLMTRAIN_MAX_REQUEUES times): the job resumes from its last
     complete checkpoint.
It works from its own thread because the training thread is the one that is stuck, in a collective that never
returns; a rank that hangs does not keep the others from writing their dumps."""

from __future__ import annotations

import datetime
import faulthandler
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.distributed as dist

from llmtrain.errors import HUNG_EXIT
from llmtrain.process import attempts
from llmtrain.process.runtime import Runtime, roll_call
from llmtrain.train.flight_recorder import describe, flight_entries, flight_record, group_of, oldest_unfinished
from llmtrain.train.observers import StepObserver

log = logging.getLogger("llmtrain")

# The loop's phases, in the order a step runs them: a rank in an earlier one is behind the others.
PHASES = (
    "starting up",  # joining the group, building the model, loading a checkpoint, until the first step ends
    "starting the step",
    "waiting for data",
    "preparing the batch",  # the objective's passes before training's (DPO: the reference's and policy's)
    "forward/backward",
    "clipping",
    "reading the step's results",
    "optimizer",
    "validation",
    "downstream tasks",
    "logging",
    "checkpoint",
    "evaluating",  # llmtrain.evaluate's scoring calls, its steps
)
# Validation, the eval.tasks, logging (W&B over the network) and checkpoints may run longer than a step: this many
# timeouts.
SLOW_PHASES, SLOW_PHASE_ALLOWANCE = ("validation", "downstream tasks", "logging", "checkpoint"), 10
# Starting up, to the end of an attempt's first step (a checkpoint read, compilation, the data opened): this many.
STARTUP_ALLOWANCE = 20
# With train.hang_timeout unset, a GPU run arms itself after this many steps with this many times their median
# (at least AUTO_FLOOR seconds): long enough for a slow step, short against an allocation.
AUTO_AFTER_STEPS, AUTO_FACTOR, AUTO_FLOOR = 5, 20, 300.0
# How long a rank that timed out waits for the others' posts before naming who is missing.
GATHER_SECONDS = 15.0
STORE_PREFIX = "llmtrain/hang"
FIRE_KEY = f"{STORE_PREFIX}/fire"  # set by the first watchdog to fire; the others poll it
# Set by the rank that wrote the job's line once it is out: the others wait for it (at most REPORT_SECONDS) before
# ending, since the agent stops every worker as soon as one exits and the line would die with its writer.
REPORTED_KEY, REPORT_SECONDS = f"{STORE_PREFIX}/reported", 10.0


# How far a rank got with a collective: not posted by its host, posted (NCCL: its device has not reached it; gloo
# tells no more), started (NCCL: its kernel runs, waiting for the peers).
NOT_POSTED, POSTED, STARTED = 0, 1, 2


@dataclass(frozen=True)
class Position:
    """Where a rank is: its step, its phase, the innermost frame of its training thread, and where it is in its
    collectives: `collective` says it, `progress` orders it among the ranks of one group: (group, number in the
    group, NOT_POSTED | POSTED | STARTED) of the oldest collective it has not finished (with none unfinished: the
    one after its newest, not posted); None without a flight recorder."""

    rank: int
    step: int
    phase: str
    frame: str
    collective: str = ""
    progress: tuple[str, int, int] | None = None

    def order(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase)

    def encode(self) -> str:
        return json.dumps([self.rank, self.step, self.phase, self.frame, self.collective, self.progress])

    @classmethod
    def decode(cls, text: bytes) -> Position:
        rank, step, phase, frame, collective, progress = json.loads(text)
        return cls(rank, step, phase, frame, collective, None if progress is None else tuple(progress))


def collective_position(entries: list[dict]) -> tuple[str, tuple[str, int, int] | None]:
    """This process's place in its collectives (Position's `collective` and `progress`) from its flight record."""
    waiting = oldest_unfinished(entries)
    if waiting is not None:
        stage = STARTED if waiting.get("state") == "started" else POSTED
        return f"waiting in {describe(waiting)}", (group_of(waiting), waiting.get("collective_seq_id", 0), stage)
    if not entries:
        return "", None
    newest = entries[-1]
    return f"in no collective (newest: {describe(newest)})", (
        group_of(newest),
        newest.get("collective_seq_id", 0) + 1,
        NOT_POSTED,
    )


class StepWatchdog(StepObserver):
    """Watches the training thread of this rank; `close` ends the watch. `timeout` None: not armed until
    `step_ends` has seen AUTO_AFTER_STEPS steps (then AUTO_FACTOR x their median, at least `auto_floor`).
    `auto_floor` and `end_process` are the production values unless a test passes seconds it can wait for and a
    function that records the exit code instead of ending the process."""

    def __init__(
        self,
        timeout: float | None,
        runtime: Runtime,
        run_dir: str,
        *,
        auto_floor: float = AUTO_FLOOR,
        end_process: Callable[[int], None] = os._exit,
    ):
        if auto_floor <= 0:  # the watching thread polls a tenth of it: zero would spin
            raise ValueError(f"auto_floor must be positive seconds, not {auto_floor}")
        self.timeout = timeout
        self.auto_floor = auto_floor
        self.end_process = end_process
        self.runtime = runtime
        self.directory = os.path.join(run_dir, "hang")
        self.step_seconds: list[float] = []
        self._training_thread = threading.get_ident()
        self._position = Position(runtime.rank, 0, PHASES[0], "")
        self._marked_at = time.monotonic()
        self._deadline = None if timeout is None else self._marked_at + STARTUP_ALLOWANCE * timeout
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="llmtrain-watchdog", daemon=True)
        self._thread.start()

    @classmethod
    def for_run(cls, timeout: float | None, runtime: Runtime, run_dir: str) -> StepWatchdog | None:
        """The watchdog train.hang_timeout asks for: seconds; 0 off; unset (None): derived from the first steps
        on a GPU, off on a CPU (where tests and small runs pause and resume freely)."""
        if timeout == 0 or (timeout is None and runtime.device.type != "cuda"):
            return None
        return cls(timeout, runtime, run_dir)

    def phase_begins(self, step: int, phase: str) -> None:
        """The training thread entered `phase` of `step`: the clock starts again, with the phase's allowance. An
        attempt's first step (it compiles, warms up and opens the data) runs on under the start-up allowance."""
        self._position = Position(self.runtime.rank, step, phase, "")
        self._marked_at = time.monotonic()
        if self.timeout is None:
            self._deadline = None
        elif self.step_seconds:
            allowance = SLOW_PHASE_ALLOWANCE if phase in SLOW_PHASES else 1
            self._deadline = self._marked_at + self.timeout * allowance

    def step_ends(self, step: int, seconds: float) -> None:
        """A step took `seconds` (the first steps kept): with no timeout set, they decide it."""
        if len(self.step_seconds) == AUTO_AFTER_STEPS:
            return
        self.step_seconds.append(seconds)
        if self.timeout is None and len(self.step_seconds) == AUTO_AFTER_STEPS:
            median = statistics.median(self.step_seconds[1:])  # the first step compiles and warms up
            self.timeout = max(self.auto_floor, AUTO_FACTOR * median)
            log.info(f"watchdog  a rank that makes no progress for {self.timeout:.0f} s ends the job (requeued)")

    def close(self) -> None:
        """The watch ends: its thread is joined."""
        self._closed.set()
        self._thread.join()

    # -- the watching thread ----------------------------------------------------------------------------------
    def _watch(self) -> None:
        # A tenth of the shortest allowance this watchdog can have: unarmed, the timeout the first steps derive is at
        # least the floor, so the first look after arming comes in time (with the 300 s floor: once a second).
        while not self._closed.wait(min(1.0, (self.auto_floor if self.timeout is None else self.timeout) / 10)):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._fire(because="no progress within its allowance")
                return  # in production the process has ended; an end_process that returns sees one firing
            if deadline is not None and self._fired_elsewhere():
                self._fire(because="another rank's watchdog fired")
                return

    def _store(self) -> dist.Store | None:
        return dist.distributed_c10d._get_default_store() if self.runtime.distributed else None

    def _fired_elsewhere(self) -> bool:
        """Whether another rank's watchdog has fired (its key in the job's store)."""
        try:
            store = self._store()
            return store is not None and store.check([FIRE_KEY])
        except (RuntimeError, dist.DistStoreError):  # the store's host is gone: this rank's own deadline decides
            return False

    def _fire(self, because: str) -> None:
        stalled = time.monotonic() - self._marked_at
        try:
            store = self._store()
            if store is not None:
                store.set(FIRE_KEY, str(self.runtime.rank))
        except (RuntimeError, dist.DistStoreError):
            pass  # the others still fire on their own clocks
        entries, reason = flight_entries()
        collective, progress = collective_position(entries)
        here = replace(self._position, frame=self._innermost_frame(), collective=collective, progress=progress)
        path = self._write_dump(here, stalled, because, flight_record(entries, reason))
        positions = self._gather(here)
        reporter = min(positions)  # one line for the job, from the lowest rank that got this far
        if reporter == self.runtime.rank:
            line = describe_hang(positions, self.runtime.world_size, stalled, self.directory)
            log.error(line)
            attempts.record(os.path.dirname(self.directory), self.runtime.attempt, self.runtime.rank, HUNG_EXIT, line)
        else:
            log.error(f"rank {self.runtime.rank}: no progress for {stalled:.0f} s ({because}); where it was: {path}")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if len(positions) > 1:
            self._hand_over_the_report(reporter)
        self.runtime.abort()
        self.end_process(HUNG_EXIT)

    def _hand_over_the_report(self, reporter: int) -> None:
        """The reporter says its line is out; the others wait for that, so that none of them ends the job first."""
        try:
            store = self._store()
            if store is None:
                return
            if reporter == self.runtime.rank:
                store.set(REPORTED_KEY, str(reporter))
                return
            store.wait([REPORTED_KEY], datetime.timedelta(seconds=REPORT_SECONDS))
        except (RuntimeError, dist.DistStoreError):
            pass  # not reported in time, or the store's host is gone: this rank ends anyway

    def _innermost_frame(self) -> str:
        frame = sys._current_frames().get(self._training_thread)
        if frame is None:
            return "(the training thread has ended)"
        return f"{frame.f_code.co_name} ({_short_path(frame.f_code.co_filename)}:{frame.f_lineno})"

    def _write_dump(self, here: Position, stalled: float, because: str, collectives: str) -> str:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"rank-{self.runtime.rank}.txt")
        with open(path, "w") as dump:
            dump.write(
                f"rank {self.runtime.rank} of {self.runtime.world_size} (host {os.uname().nodename}, pid {os.getpid()})"
                f": no progress for {stalled:.0f} s in step {here.step}, {here.phase}, at {here.frame} ({because})\n"
                f"collectives: {here.collective or 'none recorded'}\n\n"
                "Python threads (the training thread is the one in the step):\n"
            )
            dump.flush()
            faulthandler.dump_traceback(dump, all_threads=True)
            dump.write("\nCollectives the process groups posted (torch's flight recorder, newest last):\n")
            dump.write(collectives + "\n")
        return path

    def _gather(self, here: Position) -> dict[int, Position]:
        """Post this rank's position and read the others' (those that post within GATHER_SECONDS)."""
        if not self.runtime.distributed:
            return {here.rank: here}
        posts = roll_call(self.runtime, STORE_PREFIX, here.encode(), GATHER_SECONDS)
        if not posts:  # the store's host is gone: say what this rank knows
            log.warning(f"rank {here.rank}: the job's store did not answer; naming only this rank")
        return {**{rank: Position.decode(post) for rank, post in posts.items()}, here.rank: here}


def describe_hang(positions: dict[int, Position], world_size: int, stalled: float, directory: str) -> str:
    """One line: which ranks are behind (or silent), and where the others wait."""
    silent = [rank for rank in range(world_size) if rank not in positions]
    behind = ranks_behind(list(positions.values()))
    ahead = [p for p in positions.values() if p not in behind]
    parts = [f"hang: no progress for {stalled:.0f} s (train.hang_timeout)"]
    if silent:
        parts.append(f"silent (gone, or stuck holding the interpreter): ranks {_ranks(silent)}")
    if ahead or silent:
        parts.append(f"behind: {_group(behind)}")
        if ahead:
            parts.append(f"waiting for them: {_group(ahead)}")
    else:
        parts.append(f"every rank in the same place: {_group(behind)}")
    parts.append(f"stacks and collectives in {directory}; exiting {HUNG_EXIT} to be requeued from the last checkpoint")
    return "; ".join(parts)


def ranks_behind(positions: list[Position]) -> list[Position]:
    """The ranks in the earliest step and phase; among those, when they wait in one process group, the ones
    least far in its collectives (an earlier one unfinished, or the same one not posted or not started)."""
    earliest = min(position.order() for position in positions)
    tied = [position for position in positions if position.order() == earliest]
    progress = [position.progress for position in tied]
    if any(place is None for place in progress) or len({place[0] for place in progress if place}) != 1:
        return tied
    least = min(place[1:] for place in progress if place)
    return [position for position in tied if position.progress is not None and position.progress[1:] == least]


def _group(positions: list[Position]) -> str:
    by_place: dict[tuple[int, str, str, str], list[int]] = {}
    for p in positions:
        by_place.setdefault((p.step, p.phase, p.frame, p.collective), []).append(p.rank)
    return ", ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)} in step {step} ({phase}) at {frame}"
        + (f", {collective}" if collective else "")
        for (step, phase, frame, collective), ranks in sorted(by_place.items())
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(rank) for rank in sorted(ranks))


def _short_path(filename: str) -> str:
    for root in ("llmtrain", "torch"):
        marker = f"{os.sep}{root}{os.sep}"
        if marker in filename:
            return root + os.sep + filename.rsplit(marker, 1)[1]
    return os.path.basename(filename)
