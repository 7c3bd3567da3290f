"""Stopping cleanly when asked: SIGTERM, SIGUSR1 or SIGUSR2 (what SLURM sends before preempting or at the time
limit with `--signal`; submitit's warning is SIGUSR2), or a first Ctrl-C, make every rank finish its current step,
save a checkpoint and exit with PREEMPTED_EXIT, so a launcher can requeue the job and the next run resumes from
that step. A second Ctrl-C aborts.

train.py installs the watch before it loads torch, so a signal that arrives while the job starts is kept and acted
on at the first step boundary instead of killing the process. The signal may reach only some ranks (or reach them
at different steps), so after each step the ranks agree on whether any of them was asked: one max all-reduce.

Which process announces a signal (one line per node) is the Runtime's to say, but the watch exists before any
Runtime: it learns its rank from `attach` or, at the latest, at the first step boundary (`requested`), and
announces a signal received before that then.
"""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING

from llmtrain.errors import PREEMPTED_EXIT

if TYPE_CHECKING:
    from llmtrain.process.runtime import Runtime

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class PreemptionWatch:
    """Records the first stop request from its construction until `close` (or the end of a `with` block)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._rank: tuple[int, int] | None = None  # (rank, local rank), once a Runtime has been seen
        self._announced = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (*PREEMPTION_SIGNALS, signal.SIGINT)}

    def __enter__(self) -> PreemptionWatch:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def record(self, signum: int) -> bool:
        """Remember the first stop request; whether this was it."""
        if self.signal_name is not None:
            return False
        self.signal_name = signal.Signals(signum).name
        return True

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.signal_name is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        if self.record(signum):
            self._announce()

    def attach(self, runtime: Runtime) -> None:
        """Learn this process's rank now that a Runtime exists: a signal is announced from now on when it arrives,
        one received earlier at once."""
        self._rank = (runtime.rank, runtime.local_rank)
        self._announce()

    def _announce(self) -> None:
        """One line per node (its local rank 0) for the recorded signal, as soon as this process knows its rank."""
        if self.signal_name is None or self._rank is None or self._announced:
            return
        self._announced = True
        rank, local_rank = self._rank
        if local_rank == 0:
            print(
                f"llmtrain: {self.signal_name} received on rank {rank}: once every rank has finished its step, "
                f"they save a checkpoint and exit {PREEMPTED_EXIT} (a line says so when it is saved)"
                + (" (Ctrl-C again to abort)" if self.signal_name == "SIGINT" else ""),
                file=sys.stderr,
                flush=True,
            )

    def stop_requested(self, runtime: Runtime) -> bool:
        """Whether this rank has been asked to stop (announcing a signal received while the job started)."""
        if self._rank is None:  # not attached yet
            self.attach(runtime)
        return self.signal_name is not None

    def hand_over(self) -> None:
        """Run the handler that watched for the received signal before this watch did, now that the checkpoint is
        saved: under submitit that handler requeues the job (and exits)."""
        if self.signal_name is None:
            return
        signum = signal.Signals[self.signal_name]
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, None)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
