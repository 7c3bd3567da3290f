"""Stopping cleanly when asked: SIGTERM or SIGUSR1 (what SLURM sends before preempting or at the time limit with
`--signal`), or a first Ctrl-C, make every rank finish its current step, save a checkpoint and exit with
PREEMPTED_EXIT, so a launcher can requeue the job and the next run resumes from that step. A second Ctrl-C aborts.

The signal may reach only some ranks (or reach them at different steps), so after each step the ranks agree on
whether any of them was asked: one max all-reduce of a flag.
"""

from __future__ import annotations

import signal
import sys

import torch
import torch.distributed as dist

from llmtrain.runtime import Runtime

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry" — a checkpoint was saved.
PREEMPTED_EXIT = 75

_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Preempted(Exception):
    """Raised after the checkpoint of `step` is written, to end the run with PREEMPTED_EXIT."""

    def __init__(self, step: int, signal_name: str):
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint saved")
        self.step = step


class PreemptionWatch:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.signal_name: str | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in _SIGNALS}

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.signal_name is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            print(f"llmtrain: {self.signal_name} received on rank {self.runtime.rank}: finishing this step, "
                  f"then saving a checkpoint and exiting with {PREEMPTED_EXIT}"
                  + (" (Ctrl-C again to abort)" if signum == signal.SIGINT else ""), file=sys.stderr, flush=True)

    def requested(self) -> bool:
        """Collective: whether any rank has been asked to stop."""
        flag = torch.tensor([self.signal_name is not None], dtype=torch.int32, device=self.runtime.device)
        if self.runtime.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
