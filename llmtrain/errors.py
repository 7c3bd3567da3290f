"""What ends a run on purpose, each with its own exit code (README: exit codes), and `exit_for`, which ends a
process with an error's code (how a whole job ends, with its reports and shutdown, is llmtrain/run/exits.py's). A
leaf module: it imports nothing of llmtrain and nothing heavy, so configuration, data and model code raise these
without loading Hydra or torch."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ClassVar, NoReturn


class RunError(Exception):
    """A run that cannot go on, for a reason its message states in one line. `exit_code` is the process's exit
    status. `main_rank_speaks`: rank 0 prints the line for every rank (False: the rank it happened on prints it,
    as only that rank knows). `ranks_meet`: every rank raises it at the same point, so they meet before exiting
    (False: a peer may never reach a meeting point). `restartable`: a launcher's restart may find it gone (the
    others end the run for good: a restarted worker leaves at once, llmtrain/run/exits.py)."""

    exit_code: ClassVar[int] = 1
    main_rank_speaks: ClassVar[bool] = True
    ranks_meet: ClassVar[bool] = False
    restartable: ClassVar[bool] = False
    prefix: ClassVar[str] = "error: "


class ConfigError(RunError, ValueError):
    """A user-fixable configuration problem; its message is one line naming the key and the fix."""

    exit_code = 2


class TrainingDiverged(RunError):
    """Too many consecutive steps with a non-finite loss or gradient norm (every rank decides at the same step)."""

    exit_code = 3
    ranks_meet = True


class OutOfMemory(RunError, RuntimeError):
    """A rank's device ran out of memory; the message is what was held and what to change."""

    exit_code = 4
    main_rank_speaks = False


class OutOfMemoryRetried(OutOfMemory):
    """Out of memory in a step where a smaller micro-batch is left to try (llmtrain/process/attempts.py): a restart or
    requeue resumes with it, the global batch unchanged."""

    restartable = True


class CheckpointWriteError(RunError, RuntimeError):
    """A checkpoint could not be written; the previous one stays. DCP shares a rank's failure with every rank."""

    exit_code = 5


class DataUnavailable(RunError):
    """A streamed data source still failed with a network error after its retries (llmtrain/data/sources.py). Not
    the configuration's fault: exit 1, which launch/slurm.sbatch requeues a limited number of times. Said by the
    rank whose stream failed, the one that knows."""

    main_rank_speaks = False
    restartable = True


# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry" — a checkpoint was saved.
PREEMPTED_EXIT = 75
# A rank made no progress for train.hang_timeout (llmtrain/train/watchdog.py): requeued a limited number of times,
# resuming from the last complete checkpoint.
HUNG_EXIT = 76


# A loss spike under train.on_spike=rollback: restarted or requeued, the run resumes from its last complete
# checkpoint with the spike's batch left out.
ROLLED_BACK_EXIT = 78


class RolledBack(RunError):
    """Raised on every rank at a loss spike under train.on_spike=rollback, after its batch is noted to be left out."""

    exit_code = ROLLED_BACK_EXIT
    ranks_meet = True
    restartable = True


# A peer's process ended mid-run (killed, crashed, its node lost): requeued or restarted like a hang, resuming from
# the last complete checkpoint.
PEER_LOST_EXIT = 77


class PeerLost(RunError, RuntimeError):
    """The collectives failed because another rank's process ended; said by the lowest rank that is left."""

    exit_code = PEER_LOST_EXIT


class Preempted(RunError):
    """Raised on every rank after the checkpoint of `step` is written: the job is requeued to resume."""

    exit_code = PREEMPTED_EXIT
    ranks_meet = True
    prefix = "llmtrain: "

    def __init__(self, step: int, signal_name: str):
        super().__init__(
            f"stopped by {signal_name} after step {step}; checkpoint saved; exiting with {PREEMPTED_EXIT} "
            f"(requeue to resume)"
        )
        self.step = step


def exit_for(error: RunError, is_main: bool, shutdown: Callable[[bool], None]) -> NoReturn:
    """The one way a RunError ends a process: its line (from rank 0, or from the rank it happened on), the
    process group shut down (`shutdown(synchronize)`: meeting the other ranks first when they all raised it), its
    exit code."""
    if is_main or not error.main_rank_speaks:
        print(f"{error.prefix}{error}", file=sys.stderr)
    shutdown(error.ranks_meet)
    sys.exit(error.exit_code)


@contextmanager
def exits_on_run_error() -> Iterator[None]:
    """A one-process tool's RunError ends it as it ends a run: its one line on stderr and its exit code."""
    try:
        yield
    except RunError as error:
        exit_for(error, is_main=True, shutdown=lambda _: None)  # one process: no group to leave


def first_line(error: BaseException | str, limit: int = 160) -> str:
    """The first non-empty line of an error's message (its type's name when it has none), for quoting a library's
    error inside a one-line ConfigError."""
    text = str(error)
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return line[:limit] if line or isinstance(error, str) else type(error).__name__


# A process killed by SIGPIPE exits with 128 + 13 in the shell's terms.
CLOSED_PIPE_EXIT = 141


@contextmanager
def closed_pipe_is_quiet() -> Iterator[None]:
    """A reader that stops early (`--help | head`, quitting `less`) ends the output, as it ends any Unix tool's:
    no traceback and no error line, stdout pointed at the null device so that Python's final flush cannot fail
    again, and the exit status of a process SIGPIPE killed."""
    try:
        yield
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(CLOSED_PIPE_EXIT)


def note_step(error: BaseException, step: int) -> None:
    """Remember on `error` the training step it ended (where a crash happened is part of telling a bug, which
    recurs at the same step, from the machine's fault)."""
    error.__dict__.setdefault("llmtrain_step", step)


def failed_step(error: BaseException) -> int | None:
    """The training step `error` ended (note_step), None when it came from outside the steps."""
    return error.__dict__.get("llmtrain_step")
